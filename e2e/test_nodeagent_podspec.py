"""From pod spec to process: environment, argv and refused features (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from e2e.nodeagent import podspec
from e2e.nodeagent.podspec import (
    ContainerConfigError,
    VolumeMountError,
    build_base_environment,
    check_volumes,
    claimed_volumes,
    expand_references,
    host_mount_paths,
    referenced_objects,
    resolve_argv,
    resolve_environment,
    secret_mount_paths,
    secret_volume_files,
    secret_volume_secrets,
    translate_mount_paths,
    wants_service_account_token,
)

POD: dict[str, Any] = {
    "metadata": {
        "name": "web-0",
        "namespace": "prod",
        "uid": "u-1",
        "labels": {"app": "web", "role": "decode"},
        "annotations": {"note": "hi"},
    },
    "spec": {"nodeName": "pdc-node-1", "serviceAccountName": "runner"},
}


def env_of(container: dict[str, Any], objects: dict[Any, Any] | None = None) -> dict[str, str]:
    return resolve_environment(
        POD, container, pod_ip="127.5.1.7", host_ip="127.5.0.1", objects=objects or {}
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("$(A)", "1"),
        ("x$(A)y$(B)", "x1y2"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(A)", "$(A)"),
        ("$$$(A)", "$1"),
        ("$(A", "$(A"),
        ("no refs", "no refs"),
    ],
)
def test_variable_references_expand_like_kubernetes(value: str, expected: str) -> None:
    assert expand_references(value, {"A": "1", "B": "2"}) == expected


@given(st.text(alphabet=st.characters(blacklist_characters="$"), max_size=50))
def test_text_without_references_is_unchanged(text: str) -> None:
    assert expand_references(text, {"A": "1"}) == text


def test_field_refs_resolve_from_the_pod() -> None:
    def ref(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    container = {
        "env": [
            {"name": "IP", **ref("status.podIP")},
            {"name": "HOST", **ref("status.hostIP")},
            {"name": "NAME", **ref("metadata.name")},
            {"name": "NS", **ref("metadata.namespace")},
            {"name": "ROLE", **ref("metadata.labels['role']")},
            {"name": "NOTE", **ref("metadata.annotations['note']")},
            {"name": "NODE", **ref("spec.nodeName")},
            {"name": "SA", **ref("spec.serviceAccountName")},
            {"name": "URL", "value": "http://$(IP):8000"},
        ]
    }
    assert env_of(container) == {
        "IP": "127.5.1.7",
        "HOST": "127.5.0.1",
        "NAME": "web-0",
        "NS": "prod",
        "ROLE": "decode",
        "NOTE": "hi",
        "NODE": "pdc-node-1",
        "SA": "runner",
        "URL": "http://127.5.1.7:8000",
    }


def test_env_overrides_env_from_and_prefixes_apply() -> None:
    container = {
        "envFrom": [
            {"configMapRef": {"name": "cfg"}, "prefix": "CFG_"},
            {"secretRef": {"name": "s"}},
        ],
        "env": [{"name": "CFG_A", "value": "override"}],
    }
    objects = {("ConfigMap", "cfg"): {"A": "a", "B": "b"}, ("Secret", "s"): {"TOKEN": "t"}}
    assert referenced_objects(container) == {("ConfigMap", "cfg"), ("Secret", "s")}
    assert env_of(container, objects) == {"CFG_A": "override", "CFG_B": "b", "TOKEN": "t"}


@pytest.mark.parametrize(
    ("env", "objects", "message"),
    [
        (
            [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k"}}}],
            {("Secret", "gone"): None},
            'secret "gone" not found in namespace prod',
        ),
        (
            [{"name": "T", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "nokey"}}}],
            {("ConfigMap", "cfg"): {"k": "v"}},
            "couldn't find key nokey in ConfigMap prod/cfg",
        ),
        (
            [{"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}],
            {},
            "resourceFieldRef is not supported",
        ),
        (
            [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "status.phase"}}}],
            {},
            "fieldRef 'status.phase' is not supported",
        ),
    ],
)
def test_unresolvable_env_is_a_config_error(
    env: list[dict[str, Any]], objects: dict[Any, Any], message: str
) -> None:
    with pytest.raises(ContainerConfigError, match=message):
        env_of({"env": env}, objects)


def test_optional_references_may_be_missing() -> None:
    container = {
        "env": [
            {
                "name": "T",
                "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": True}},
            }
        ],
        "envFrom": [{"secretRef": {"name": "gone", "optional": True}}],
    }
    assert env_of(container, {("Secret", "gone"): None}) == {}


def test_argv_is_command_plus_args_expanded() -> None:
    container = {"command": ["pdcluster", "worker"], "args": ["--host", "$(IP)", "$$(IP)"]}
    assert resolve_argv(container, {"IP": "127.1.1.1"}) == [
        "pdcluster",
        "worker",
        "--host",
        "127.1.1.1",
        "$(IP)",
    ]


def test_a_container_without_command_is_refused() -> None:
    with pytest.raises(ContainerConfigError, match="set `command`"):
        resolve_argv({"name": "c", "image": "busybox", "args": ["x"]}, {})


def test_only_token_empty_dir_secret_host_path_and_claim_volumes_are_accepted() -> None:
    pod = {
        "spec": {
            "volumes": [
                {"name": "kube-api-access-abcde", "projected": {}},
                {"name": "shm", "emptyDir": {"medium": "Memory"}},
                {"name": "key", "secret": {"secretName": "key"}},
                {"name": "cfg", "configMap": {"name": "cfg"}},
            ]
        }
    }
    fine = {
        "volumeMounts": [
            {
                "name": "kube-api-access-abcde",
                "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            },
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "key", "mountPath": "/var/run/key"},
        ]
    }
    check_volumes(pod, fine)
    with pytest.raises(
        ContainerConfigError, match="volume 'cfg' \\(configMap\\) mounted at '/etc/cfg'"
    ):
        check_volumes(pod, {"volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}]})


SECRET_POD: dict[str, Any] = {
    "metadata": {"name": "w", "namespace": "prod"},
    "spec": {
        "volumes": [
            {
                "name": "tok",
                "secret": {"secretName": "cluster", "items": [{"key": "token", "path": "t/token"}]},
            },
            {"name": "all", "secret": {"secretName": "keys"}},
            {"name": "maybe", "secret": {"secretName": "absent", "optional": True}},
            {"name": "unmounted", "secret": {"secretName": "never-read"}},
        ]
    },
}
SECRET_CONTAINER: dict[str, Any] = {
    "volumeMounts": [
        {"name": "tok", "mountPath": "/var/run/tok"},
        {"name": "all", "mountPath": "/etc/keys/"},
        {"name": "maybe", "mountPath": "/etc/maybe"},
    ]
}


def test_secret_volumes_become_files_of_their_keys() -> None:
    assert secret_volume_secrets(SECRET_POD, SECRET_CONTAINER) == {
        ("Secret", "cluster"),
        ("Secret", "keys"),
        ("Secret", "absent"),
    }
    objects = {
        ("Secret", "cluster"): {"token": "s3cret", "other": "not picked"},
        ("Secret", "keys"): {"a": "1", "b": "2"},
        ("Secret", "absent"): None,
    }
    files = secret_volume_files(SECRET_POD, SECRET_CONTAINER, objects)
    assert files == {"tok": {"t/token": "s3cret"}, "all": {"a": "1", "b": "2"}, "maybe": {}}


@pytest.mark.parametrize(
    ("objects", "words"),
    [
        ({("Secret", "keys"): {}}, 'secret "cluster" not found in namespace prod'),
        ({("Secret", "cluster"): {"other": "x"}}, "couldn't find key token in Secret prod/cluster"),
    ],
)
def test_a_missing_secret_or_key_keeps_the_volume_unmounted(objects, words) -> None:
    with pytest.raises(VolumeMountError, match=words):
        secret_volume_files(SECRET_POD, SECRET_CONTAINER, {("Secret", "keys"): {}, **objects})


def test_an_item_path_may_not_leave_its_volume() -> None:
    pod = {"spec": {"volumes": [{"name": "v", "secret": {"secretName": "s", "items": [
        {"key": "k", "path": "../escape"}]}}]}}  # fmt: skip
    container = {"volumeMounts": [{"name": "v", "mountPath": "/x"}]}
    with pytest.raises(ContainerConfigError, match="item path"):
        secret_volume_files(pod, container, {("Secret", "s"): {"k": "v"}})


def test_paths_under_a_secret_mount_are_rewritten_to_its_folder() -> None:
    mounts = secret_mount_paths(
        SECRET_POD, SECRET_CONTAINER, {"tok": "/pod/tok", "all": "/pod/all", "maybe": "/pod/m"}
    )
    assert mounts == {"/var/run/tok": "/pod/tok", "/etc/keys": "/pod/all", "/etc/maybe": "/pod/m"}
    assert translate_mount_paths("/var/run/tok/t/token", mounts) == "/pod/tok/t/token"
    assert translate_mount_paths("/etc/keys", mounts) == "/pod/all"
    # Only whole path components under a mount, nothing else.
    for untouched in ("/var/run/tokens/x", "--flag=/var/run/tok/t", "relative/var/run/tok"):
        assert translate_mount_paths(untouched, mounts) == untouched


def test_service_account_token_follows_automount() -> None:
    with_token = {"spec": {"volumes": [{"name": "kube-api-access-x", "projected": {}}]}}
    assert wants_service_account_token(with_token)
    opted_out = {"spec": {**with_token["spec"], "automountServiceAccountToken": False}}
    assert not wants_service_account_token(opted_out)
    assert not wants_service_account_token({"spec": {}})


def test_base_environment_keeps_only_what_a_process_needs() -> None:
    host = {
        "PATH": "/usr/bin:/bin",
        "HOME": "/root",
        "KUBECONFIG": "/admin/kubeconfig",
        "AWS_SECRET": "x",
        "LC_ALL": "C.UTF-8",
        "OPENBLAS_CORETYPE": "Haswell",
    }
    env = build_base_environment(host, ["/venv/bin", "/usr/bin"])
    assert env["PATH"] == "/venv/bin:/usr/bin:/bin"
    assert "KUBECONFIG" not in env and "AWS_SECRET" not in env
    assert env["LC_ALL"] == "C.UTF-8" and env["OPENBLAS_CORETYPE"] == "Haswell"
    assert env["PYTHONUNBUFFERED"] == "1"


HOST_POD: dict[str, Any] = {
    "metadata": {"name": "w", "namespace": "prod"},
    "spec": {
        "volumes": [
            {"name": "data", "hostPath": {"path": "/srv/data"}},
            {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        ]
    },
}
HOST_CONTAINER: dict[str, Any] = {
    "volumeMounts": [
        {"name": "data", "mountPath": "/data"},
        {"name": "model", "mountPath": "/models", "readOnly": True},
        {"name": "model", "mountPath": "/sub", "subPath": "llama/8b"},
    ]
}
BOUND = {"metadata": {"name": "pv-models"}, "spec": {"hostPath": {"path": "/srv/pv"}}}


def test_host_path_and_claim_mounts_resolve_to_host_folders() -> None:
    check_volumes(HOST_POD, HOST_CONTAINER)
    assert claimed_volumes(HOST_POD, HOST_CONTAINER) == {"models"}
    mounts = host_mount_paths(HOST_POD, HOST_CONTAINER, {"models": BOUND})
    assert mounts == {"/data": "/srv/data", "/models": "/srv/pv", "/sub": "/srv/pv/llama/8b"}
    assert translate_mount_paths("/models/llama", mounts) == "/srv/pv/llama"
    local = {"metadata": {"name": "pv"}, "spec": {"local": {"path": "/mnt/disk"}}}
    assert host_mount_paths(HOST_POD, HOST_CONTAINER, {"models": local})["/models"] == "/mnt/disk"


def test_an_unbound_claim_or_missing_directory_keeps_the_container_waiting(tmp_path) -> None:
    with pytest.raises(VolumeMountError, match='persistentvolumeclaim "models" .* not bound'):
        host_mount_paths(HOST_POD, HOST_CONTAINER, {"models": None})
    pod = {
        "metadata": {"name": "w", "namespace": "prod"},
        "spec": {
            "volumes": [
                {"name": "d", "hostPath": {"path": str(tmp_path / "no"), "type": "Directory"}}
            ]
        },
    }
    with pytest.raises(VolumeMountError, match="is not a directory"):
        host_mount_paths(pod, {"volumeMounts": [{"name": "d", "mountPath": "/d"}]}, {})
    nfs = {"metadata": {"name": "pv"}, "spec": {"nfs": {"server": "x", "path": "/"}}}
    with pytest.raises(ContainerConfigError, match="neither hostPath nor local"):
        host_mount_paths(HOST_POD, HOST_CONTAINER, {"models": nfs})


def test_only_a_prestop_sleep_is_run() -> None:
    assert podspec.prestop_sleep_s({"name": "c"}) == 0.0
    sleep = {"name": "c", "lifecycle": {"preStop": {"sleep": {"seconds": 3}}}}
    assert podspec.prestop_sleep_s(sleep) == 3.0
    hook = {"name": "c", "lifecycle": {"preStop": {"httpGet": {"path": "/stop", "port": 80}}}}
    with pytest.raises(podspec.ContainerConfigError, match="only the sleep action"):
        podspec.prestop_sleep_s(hook)
