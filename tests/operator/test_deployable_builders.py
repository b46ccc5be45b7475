"""What a GPU cluster needs from the builders: the model's volume, the user's pod
overlay, disruption budgets, drain grace and the scrape rule, for every role."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.operator.builders import build_desired, build_network_policies, build_worker_pod
from pdcluster.operator.builders.disruption import build_disruption_budgets
from pdcluster.operator.builders.model_volume import build_model_mount
from pdcluster.operator.builders.networkpolicy import ScrapeSource
from pdcluster.operator.builders.overlay import (
    explain_pod_security_refusal,
    pod_security_level,
)
from pdcluster.operator.builders.router import build_router_deployment
from pdcluster.runtime.spec import DRAIN_MARGIN_SECONDS, Role, SpecError, parse_spec

from .helpers import make_cluster, need
from .test_builders import K8S_VERSION

SOURCES = {
    "pvc://models/llama-8b": (
        {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        "/models/llama-8b",
    ),
    "pvc://models": (
        {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        "/models",
    ),
    "host:///data/llama": ({"hostPath": {"path": "/data/llama", "type": "Directory"}}, "/models"),
    "oci://registry.example/models/llama:3.1": (
        {"image": {"reference": "registry.example/models/llama:3.1"}},
        "/models",
    ),
}


def spec_with(**extra: Any) -> dict[str, Any]:
    return {"prefill": {}, "decode": {}, **extra}


def model(uri: str, **source: Any) -> dict[str, Any]:
    return {"name": "llama", "source": {"uri": uri, **source}}


def worker(spec: dict[str, Any], role: Role = Role.prefill, pod_index: int = 0) -> dict[str, Any]:
    leader = "10.0.0.1" if pod_index else None
    return build_worker_pod(make_cluster(spec), role, 0, pod_index, leader)


def container(pod: dict[str, Any], name: str = "worker") -> dict[str, Any]:
    spec = pod["spec"] if "containers" in pod["spec"] else pod["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c["env"]}


# --------------------------------------------------------------- model sources
@pytest.mark.parametrize("uri", sorted(SOURCES))
@pytest.mark.parametrize("role", [Role.prefill, Role.decode])
def test_a_mounted_source_reaches_the_engine_read_only_at_one_path(uri: str, role: Role) -> None:
    volume, model_dir = SOURCES[uri]
    pod = worker(spec_with(model=model(uri)), role)
    (mounted,) = [v for v in pod["spec"]["volumes"] if v["name"] == "model"]
    assert {k: v for k, v in mounted.items() if k != "name"} == volume
    c = container(pod)
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert env_of(c)["PDCLUSTER_MODEL_DIR"] == model_dir
    assert "initContainers" not in pod["spec"]
    need("kubernetes_validate").validate(pod, K8S_VERSION, strict=True)


def test_an_hf_source_downloads_once_into_its_cache_claim_then_reads_offline() -> None:
    pod = worker(
        spec_with(
            model=model("hf://meta-llama/Llama-3.1-8B@v1", cacheClaim="hf", tokenSecretName="hf")
        )
    )
    (fetch,) = pod["spec"]["initContainers"]
    assert fetch["args"] == [
        "fetch-model",
        "hf://meta-llama/Llama-3.1-8B@v1",
        "--cache",
        "/models/hub",
        "--token-file",
        "/var/run/secrets/pdcluster.io/hf-token/HF_TOKEN",
    ]
    # The download writes the claim; the engine only reads it, offline.
    assert {"name": "model", "mountPath": "/models"} in fetch["volumeMounts"]
    assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
    assert "env" not in fetch or all("valueFrom" not in e for e in fetch["env"])  # token as file
    c = container(pod)
    assert env_of(c)["HF_HUB_CACHE"] == "/models/hub" and env_of(c)["HF_HUB_OFFLINE"] == "1"
    assert "PDCLUSTER_MODEL_DIR" not in env_of(c)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "hf"}
    assert volumes["hf-token"]["secret"]["secretName"] == "hf"
    assert not any(m["name"] == "hf-token" for m in c["volumeMounts"])
    need("kubernetes_validate").validate(pod, K8S_VERSION, strict=True)
    # What an engine that reads the hub cache itself is given (no token: no Secret).
    mount = build_model_mount(
        make_cluster(spec_with(model=model("hf://org/name", cacheClaim="hf"))).spec
    )
    assert (mount.hf_repo, mount.hf_revision, mount.secrets) == ("org/name", "main", ())


@pytest.mark.parametrize(
    ("source", "phrase"),
    [
        ({"uri": "s3://bucket/llama"}, "(pvc|host|oci|hf)://"),
        ({"uri": "pvc://Models/llama"}, "needs a claim name"),
        ({"uri": "pvc://models/../etc"}, "may not contain"),
        ({"uri": "host://relative"}, "absolute node path"),
        ({"uri": "hf://justname", "cacheClaim": "c"}, "needs ORG/NAME"),
        ({"uri": "hf://org/name"}, "needs cacheClaim"),
        ({"uri": "pvc://m/x", "cacheClaim": "c"}, "belong to hf:// only"),
        ({"uri": "pvc://m/x", "pullPolicy": "Always"}, "belongs to oci:// only"),
    ],
)
def test_a_bad_source_is_refused_naming_the_field(source: dict[str, Any], phrase: str) -> None:
    with pytest.raises(SpecError, match="model.source") as err:
        parse_spec(spec_with(model={"name": "llama", **{"source": source}}))
    assert phrase in str(err.value)


def test_a_model_takes_a_path_or_a_source_not_both() -> None:
    with pytest.raises(SpecError, match="not both"):
        parse_spec(spec_with(model={**model("pvc://m"), "path": "/x"}))


# ------------------------------------------------------------------- overlay
OVERLAY: dict[str, Any] = {
    "labels": {"team": "llm"},
    "annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"},
    "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}],
    "envFrom": [{"configMapRef": {"name": "tuning"}}],
    "volumes": [{"name": "scratch", "emptyDir": {}}],
    "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    "imagePullSecrets": ["regcred"],
    "priorityClassName": "inference",
    "runtimeClassName": "nvidia",
    "shmSize": "16Gi",
    "capabilities": ["IPC_LOCK"],
}


@pytest.mark.parametrize("pod_index", [0, 1])
def test_the_overlay_adds_to_the_worker_pod_and_keeps_what_we_own(pod_index: int) -> None:
    spec = spec_with(prefill={"topology": {"tp": 2}, "gpusPerPod": 1, "pod": OVERLAY})
    plain = worker(
        spec_with(prefill={"topology": {"tp": 2}, "gpusPerPod": 1}), Role.prefill, pod_index
    )
    pod = worker(spec, Role.prefill, pod_index)
    c, before = container(pod), container(plain)
    assert pod["metadata"]["labels"]["team"] == "llm"
    ours = {
        k: v for k, v in plain["metadata"]["labels"].items() if k != "pdcluster.io/template-hash"
    }
    assert pod["metadata"]["labels"].items() >= ours.items()
    assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["priorityClassName"] == "inference"
    assert pod["spec"]["runtimeClassName"] == "nvidia"
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    # Ours first, unchanged; the user's appended.
    names = [e["name"] for e in c["env"]]
    assert names[: len(before["env"])] == [e["name"] for e in before["env"]]
    assert c["env"][-1] == {"name": "NCCL_IB_HCA", "value": "mlx5"}
    assert c["envFrom"] == [{"configMapRef": {"name": "tuning"}}]
    assert c["volumeMounts"][-1] == {"name": "scratch", "mountPath": "/scratch"}
    for owned in ("command", "args", "ports", "image", "resources"):
        assert c[owned] == before[owned]
    assert c.get("readinessProbe") == before.get("readinessProbe")
    security = c["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert security["allowPrivilegeEscalation"] is False and security["runAsNonRoot"] is True
    need("kubernetes_validate").validate(pod, K8S_VERSION, strict=True)


def test_the_router_takes_its_own_overlay_and_placement() -> None:
    spec = spec_with(
        router={
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "pod": {"imagePullSecrets": ["regcred"], "labels": {"team": "llm"}},
        }
    )
    deployment = build_router_deployment(make_cluster(spec))
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "llm"
    assert template["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert template["spec"]["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    need("kubernetes_validate").validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("overlay", "field"),
    [
        ({"env": [{"name": "POD_IP", "value": "1.2.3.4"}]}, "pod.env"),
        ({"env": [{"name": "PDCLUSTER_ROLE", "value": "decode"}]}, "pod.env"),
        ({"envFrom": [{"prefix": "PDCLUSTER_", "configMapRef": {"name": "x"}}]}, "pod.envFrom"),
        ({"labels": {"pdcluster.io/role": "decode"}}, "pod.labels"),
        ({"annotations": {"pdcluster.io/leader-address": "1.2.3.4"}}, "pod.annotations"),
        ({"volumes": [{"name": "cluster-token", "emptyDir": {}}]}, "pod.volumes"),
        (
            {
                "volumes": [{"name": "v", "emptyDir": {}}],
                "volumeMounts": [{"name": "v", "mountPath": "/var/run/secrets/pdcluster.io/token"}],
            },
            "pod.volumeMounts",
        ),
        (
            {
                "volumes": [{"name": "v", "emptyDir": {}}],
                "volumeMounts": [{"name": "v", "mountPath": "/"}],
            },
            "pod.volumeMounts",
        ),
        ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, "pod.volumeMounts"),
        ({"capabilities": ["SYS_ADMIN"]}, "pod.capabilities"),
        ({"command": ["sh"]}, "command"),
        ({"readinessProbe": {}}, "readinessProbe"),
    ],
)
@pytest.mark.parametrize("where", ["prefill", "router"])
def test_an_overlay_touching_what_we_own_is_refused_naming_the_field(
    overlay: dict[str, Any], field: str, where: str
) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec_with(**{where: {"pod": overlay}}))
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("overlay", "model_uri", "level"),
    [
        ({}, None, "restricted"),
        ({"capabilities": ["NET_BIND_SERVICE"]}, None, "restricted"),
        ({"capabilities": ["CHOWN"]}, None, "baseline"),
        ({"capabilities": ["IPC_LOCK"]}, None, "privileged"),
        ({"hostNetwork": True}, None, "privileged"),
        ({"hostIPC": True}, None, "privileged"),
        ({}, "host:///data/llama", "privileged"),
        ({}, "pvc://models/llama", "restricted"),
        ({}, "oci://registry.example/llama:1", "restricted"),
    ],
)
def test_the_pod_security_level_a_pod_needs(
    overlay: dict[str, Any], model_uri: str | None, level: str
) -> None:
    extra: dict[str, Any] = {"prefill": {"pod": overlay}}
    if model_uri:
        extra["model"] = model(model_uri)
    pod = worker(spec_with(**extra))
    assert pod_security_level(pod["spec"])[0] == level
    message = explain_pod_security_refusal("prefill", pod["spec"], "team-a")
    if level != "restricted":
        assert f"pod-security.kubernetes.io/enforce={level}" in message


# ------------------------------------------------------- disruption and drain
@pytest.mark.parametrize(
    ("replicas", "gpus_per_pod", "max_unavailable", "min_available"),
    [
        (1, None, 1, 1),  # the last instance stays: a drain waits
        (3, None, 1, 2),
        (4, None, 2, 2),
        (2, 1, 1, 3),  # tp2 over two pods: one pod (one instance) at a time
        (1, 1, 1, 2),
        (0, None, 1, 0),
    ],
)
def test_a_budget_never_lets_an_eviction_take_the_last_instance(
    replicas: int, gpus_per_pod: int | None, max_unavailable: int, min_available: int
) -> None:
    role: dict[str, Any] = {
        "replicas": replicas,
        "topology": {"tp": 2},
        "disruptionBudget": {"maxUnavailable": max_unavailable},
    }
    if gpus_per_pod:
        role["gpusPerPod"] = gpus_per_pod
    cluster = make_cluster(spec_with(decode=role))
    budgets = {b["metadata"]["name"]: b for b in build_disruption_budgets(cluster, (Role.decode,))}
    budget = budgets["demo-decode-budget"]
    assert budget["spec"]["minAvailable"] == min_available
    assert budget["spec"]["selector"]["matchLabels"] == {
        "pdcluster.io/cluster": "demo",
        "pdcluster.io/role": "decode",
    }
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert budgets["demo-router-budget"]["spec"]["minAvailable"] == 1
    need("kubernetes_validate").validate(budget, K8S_VERSION, strict=True)


def test_a_disabled_budget_is_not_built() -> None:
    cluster = make_cluster(spec_with(prefill={"disruptionBudget": {"enabled": False}}))
    names = {o["metadata"]["name"] for o in build_desired(cluster).objects}
    assert "demo-prefill-budget" not in names and "demo-decode-budget" in names


@pytest.mark.parametrize(
    ("extra", "leader_grace", "router_grace"),
    [
        # The router's request timeout by default, for workers and router alike; a
        # worker's also covers its announcement (1 s by default).
        ({}, 301 + DRAIN_MARGIN_SECONDS, 300 + DRAIN_MARGIN_SECONDS),
        ({"router": {"requestTimeoutSeconds": 42.5}}, 44 + DRAIN_MARGIN_SECONDS, 73),
        ({"prefill": {"drain": {"timeoutSeconds": 600}}}, 631, 330),
        ({"prefill": {"drain": {"timeoutSeconds": 600, "announceSeconds": 0}}}, 630, 330),
        ({"prefill": {"drain": {"announceSeconds": 4.5}}}, 305 + DRAIN_MARGIN_SECONDS, 330),
    ],
)
def test_the_grace_period_covers_the_drain_and_followers_outlive_their_leader(
    extra: dict[str, Any], leader_grace: int, router_grace: int
) -> None:
    spec = spec_with(**extra)
    spec["prefill"] = {**spec["prefill"], "topology": {"tp": 2}, "gpusPerPod": 1}
    leader, follower = worker(spec, Role.prefill, 0), worker(spec, Role.prefill, 1)
    assert leader["spec"]["terminationGracePeriodSeconds"] == leader_grace
    assert follower["spec"]["terminationGracePeriodSeconds"] == leader_grace + DRAIN_MARGIN_SECONDS
    desired = build_desired(make_cluster(spec))
    prefill = desired.role(Role.prefill)
    assert prefill is not None and prefill.grace_period_s == leader_grace
    router = build_router_deployment(make_cluster(spec))
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == router_grace


# ------------------------------------------------------------------ scraping
def test_the_workers_policy_admits_the_scrapers_to_the_metrics_port_only() -> None:
    cluster = make_cluster(spec_with())
    scrape = ScrapeSource.namespace("monitoring", {"app.kubernetes.io/name": "prometheus"})
    workers, router = build_network_policies(cluster, "pdc-system", scrape)
    rule = workers["spec"]["ingress"][-1]
    assert rule == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }
    assert (
        build_network_policies(cluster, "pdc-system")[0]["spec"]["ingress"]
        == workers["spec"]["ingress"][:-1]
    )
    need("kubernetes_validate").validate(workers, K8S_VERSION, strict=True)


# ------------------------------------------------------------- the worked example
def test_the_worked_gpu_example_renders_pods_a_reviewer_accepts() -> None:
    from pathlib import Path

    import yaml

    from pdcluster.operator.render import cluster_for_render, render_objects
    from pdcluster.runtime.spec import load_manifest_text

    text = (Path(__file__).parents[2] / "examples" / "llama-8b-pvc-4p4d-nixl-rdma.yaml").read_text()
    manifest = load_manifest_text(text)
    assert (
        manifest.spec.transfer.backend.value == "nixl" and manifest.spec.transfer.ucx.require_rdma
    )
    objects = render_objects(cluster_for_render(yaml.safe_load(text), "llm"))
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert (
        sorted(p["metadata"]["labels"]["pdcluster.io/role"] for p in pods)
        == ["decode"] * 4 + ["prefill"] * 4
    )
    for pod in pods:
        c = container(pod)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert env_of(c)["PDCLUSTER_MODEL_DIR"] == "/models/llama-3.1-8b-instruct"
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {
            "claimName": "models",
            "readOnly": True,
        }
        assert pod["spec"]["terminationGracePeriodSeconds"] == 301 + DRAIN_MARGIN_SECONDS
        assert pod_security_level(pod["spec"])[0] == "privileged"
        need("kubernetes_validate").validate(pod, K8S_VERSION, strict=True)
    budgets = {
        o["metadata"]["name"]: o["spec"]["minAvailable"]
        for o in objects
        if o["kind"] == "PodDisruptionBudget"
    }
    assert budgets == {
        "llama-8b-prefill-budget": 3,
        "llama-8b-decode-budget": 3,
        "llama-8b-router-budget": 1,
    }
