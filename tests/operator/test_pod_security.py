"""Worker and router pods fit a namespace enforcing Pod Security `restricted`,
write only to emptyDir volumes, get secrets as files, and request CPU and
memory by default (pure builders)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pdcluster.operator.builders import (
    BuildError,
    build_desired,
    build_router_deployment,
    build_worker_pod,
    podsecurity,
)
from pdcluster.operator.builders.overlay import pod_security_level
from pdcluster.operator.builders.workers import token_secret_for
from pdcluster.operator.failover.pod_facts import parse_pod_facts
from pdcluster.operator.render import cluster_for_render, render_objects
from pdcluster.runtime.spec import Role

from .helpers import PD, make_cluster

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
GPU_EXAMPLE = "llama-8b-pvc-4p4d-nixl-rdma/"
# Volume types the restricted profile allows.
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
    "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What Pod Security Admission `restricted` (v1.37) would refuse in a pod spec."""
    found: list[str] = []
    pod_ctx = spec.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            found.append(host)
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds)}")
    if pod_ctx.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    for c in [*(spec.get("initContainers") or []), *spec["containers"]]:
        ctx, name = c.get("securityContext") or {}, c["name"]
        if ctx.get("privileged"):
            found.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            found.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities {caps['add']}")
        if ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is not True:
            found.append(f"{name}: runAsNonRoot must be true")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            found.append(f"{name}: hostPort")
    return found


def example_pod_specs() -> list[tuple[str, dict[str, Any]]]:
    specs = []
    for example in EXAMPLES:
        cluster = cluster_for_render(yaml.safe_load(example.read_text()))
        for obj in render_objects(cluster):
            if obj["kind"] == "Pod":
                specs.append((f"{example.stem}/{obj['metadata']['name']}", obj["spec"]))
            elif obj["kind"] == "Deployment":
                spec = obj["spec"]["template"]["spec"]
                specs.append((f"{example.stem}/{obj['metadata']['name']}", spec))
    return specs


POD_SPECS = example_pod_specs()


def test_examples_have_both_kinds_of_pods() -> None:
    names = [name for name, _ in POD_SPECS]
    assert any(n.endswith("-router") for n in names)
    assert any("-prefill-" in n for n in names) and any("-decode-" in n for n in names)


@pytest.mark.parametrize(("name", "spec"), POD_SPECS, ids=[n for n, _ in POD_SPECS])
def test_every_pod_passes_the_restricted_profile(name: str, spec: dict[str, Any]) -> None:
    """Every pod fits `restricted` but where its overlay asks for more: the GPU
    example's workers add IPC_LOCK (RDMA), and the operator knows it."""
    opted_in = name.startswith(GPU_EXAMPLE) and not name.endswith("-router")
    expected = ["worker: adds capabilities ['IPC_LOCK']"] if opted_in else []
    assert restricted_violations(spec) == expected
    assert pod_security_level(spec)[0] == ("privileged" if opted_in else "restricted")


def test_the_restricted_check_refuses_what_it_should() -> None:
    spec = build_worker_pod(make_cluster(PD), Role.prefill, 0, 0)["spec"]
    (container,) = spec["containers"]
    del spec["securityContext"], container["securityContext"]
    spec["hostNetwork"] = True
    spec["volumes"].append({"name": "h", "hostPath": {"path": "/"}})
    found = restricted_violations(spec)
    assert "hostNetwork" in found and "volume h: ['hostPath']" in found
    assert len([f for f in found if f.startswith("worker:")]) == 4


@pytest.mark.parametrize(("name", "spec"), POD_SPECS, ids=[n for n, _ in POD_SPECS])
def test_the_root_file_system_is_read_only_and_every_written_path_is_an_empty_dir(
    name: str, spec: dict[str, Any]
) -> None:
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = {
        m["mountPath"]
        for m in container["volumeMounts"]
        if "emptyDir" in volumes[m["name"]] and not m.get("readOnly")
    }
    # tempfile (the router's manifest copy, torch caches), decode's shm KV pool.
    assert {"/tmp", "/dev/shm"} <= writable
    home = {e["name"]: e.get("value") for e in container["env"]}["HOME"]
    assert any(home == p or home.startswith(p + "/") for p in writable)
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]


@pytest.mark.parametrize(("name", "spec"), POD_SPECS, ids=[n for n, _ in POD_SPECS])
def test_no_secret_reaches_a_pod_as_an_environment_value(name: str, spec: dict[str, Any]) -> None:
    (container,) = spec["containers"]
    refs = [e for e in container["env"] if "secretKeyRef" in (e.get("valueFrom") or {})]
    assert refs == [] and not any("secretRef" in s for s in container.get("envFrom") or [])


def test_only_the_router_mounts_a_service_account_token() -> None:
    for name, spec in POD_SPECS:
        expected = name.endswith("-router")
        assert spec["automountServiceAccountToken"] is expected, name


def test_workers_read_the_token_from_a_read_only_secret_file() -> None:
    mine = make_cluster({**PD, "auth": {"tokenSecretName": "mine"}})
    pod = build_worker_pod(mine, Role.decode, 0, 0)
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "PDCLUSTER_TOKEN" not in env
    path = env[podsecurity.TOKEN_FILE_ENV]
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"] == {
        "secretName": "mine",
        "items": [{"key": "token", "path": path.rsplit("/", 1)[1]}],
        "defaultMode": 0o400,
    }
    # The operator still finds the Secret of a pod to call its admin API.
    facts = parse_pod_facts({**pod, "metadata": {**pod["metadata"], "uid": "u"}})
    assert facts is not None and facts.token_secret == "mine"


def test_a_pod_built_before_token_files_still_names_its_secret() -> None:
    pod = build_worker_pod(make_cluster(PD), Role.prefill, 0, 0)
    spec = pod["spec"]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != podsecurity.TOKEN_VOLUME]
    spec["containers"][0]["env"].append(
        {"name": "PDCLUSTER_TOKEN", "valueFrom": {"secretKeyRef": {"name": "old", "key": "token"}}}
    )
    facts = parse_pod_facts({**pod, "metadata": {**pod["metadata"], "uid": "u"}})
    assert facts is not None and facts.token_secret == "old"


def test_router_reads_api_keys_and_the_cluster_token_from_files() -> None:
    cluster = make_cluster({**PD, "auth": {"routerApiKeySecretName": "keys"}})
    spec = build_router_deployment(cluster)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    args = container["args"]
    path = args[args.index("--api-key-file") + 1]
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "keys" and mount["readOnly"] is True
    # The cluster token, which it sends to the workers, is a file too, never an env value.
    (token,) = [v for v in spec["volumes"] if v["name"] == podsecurity.TOKEN_VOLUME]
    assert token["secret"]["secretName"] == token_secret_for(cluster)
    env = {e["name"]: e for e in container["env"]}
    assert "PDCLUSTER_TOKEN" not in env
    token_file = env[podsecurity.TOKEN_FILE_ENV]["value"]
    assert any(token_file.startswith(m["mountPath"] + "/") for m in container["volumeMounts"])
    open_router = build_router_deployment(make_cluster(PD))["spec"]["template"]["spec"]
    assert "--api-key-file" not in open_router["containers"][0]["args"]


def worker_resources(role_extra: dict[str, Any]) -> dict[str, Any]:
    cluster = make_cluster({"prefill": role_extra, "decode": {}})
    resources: dict[str, Any] = build_worker_pod(cluster, Role.prefill, 0, 0)["spec"]["containers"][
        0
    ]["resources"]
    return resources


def router_resources(router: dict[str, Any]) -> dict[str, Any]:
    cluster = make_cluster({**PD, "router": router})
    spec = build_router_deployment(cluster)["spec"]["template"]["spec"]
    resources: dict[str, Any] = spec["containers"][0]["resources"]
    return resources


def test_cpu_and_memory_are_requested_by_default() -> None:
    assert worker_resources({}) == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert router_resources({}) == {"requests": {"cpu": "250m", "memory": "256Mi"}}


def test_the_roles_resources_win_over_the_default_requests() -> None:
    assert worker_resources({"resources": {"requests": {"cpu": "6"}}}) == {
        "requests": {"cpu": "6", "memory": "2Gi"}
    }
    # A limit alone makes Kubernetes request the limit: no default request beside it.
    assert worker_resources({"resources": {"limits": {"memory": "40Gi"}}}) == {
        "limits": {"memory": "40Gi"},
        "requests": {"cpu": "1"},
    }
    gpu = worker_resources({"device": "cuda"})
    assert gpu["limits"] == {"nvidia.com/gpu": 1} and gpu["requests"]["memory"] == "2Gi"
    assert router_resources({"resources": {"requests": {"memory": "1Gi"}}}) == {
        "requests": {"cpu": "250m", "memory": "1Gi"}
    }


@pytest.mark.parametrize(
    ("resources", "words"),
    [({"limit": {}}, "unknown keys ['limit']"), ({"requests": "1"}, "must be a mapping")],
)
def test_malformed_router_resources_are_refused(resources, words) -> None:
    with pytest.raises(BuildError, match="router.resources") as err:
        build_desired(make_cluster({**PD, "router": {"resources": resources}}))
    assert words in str(err.value)
