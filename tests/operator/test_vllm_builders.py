"""The objects of a `spec.engine.kind: vllm` cluster (operator/builders/vllm_pods.py),
and how the fast path treats its pods (with vLLM's connector no admin API: the
router ends or moves their requests; with ours the admin API on the side port)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdcluster.operator import names
from pdcluster.operator.builders import build_instance, build_worker_pod
from pdcluster.operator.builders.vllm_pods import TOKEN_COMMAND, TOKEN_FILE
from pdcluster.operator.failover.fast_path import loss_message
from pdcluster.operator.failover.losses import Loss, LossCause
from pdcluster.operator.failover.peers import PodIndex
from pdcluster.operator.failover.pod_facts import parse_pod_facts
from pdcluster.operator.failover.prefill_peers import compute_prefill_peers, decode_targets
from pdcluster.operator.render import render_objects
from pdcluster.runtime.router.discovery import KubernetesDiscoverySettings, decide_pod
from pdcluster.runtime.router.workers import KVEventPorts
from pdcluster.runtime.spec import EngineKind, Role

from .helpers import make_cluster

VLLM: dict[str, Any] = {
    "engine": {
        "kind": "vllm",
        "vllm": {"image": "vllm/vllm-openai:v0.32.0", "extraArgs": ["--enforce-eager"]},
    },
    "model": {"name": "llama", "path": "/models/llama"},
    "transfer": {"backend": "nixl"},
    "prefill": {"topology": {"tp": 2}, "device": "cuda"},
    "decode": {"topology": {"dp": 2}},
}


def container_of(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_vllm_worker_runs_vllm_serve_with_the_manifests_flags() -> None:
    pod = build_worker_pod(make_cluster(VLLM), Role.prefill, 0, 0)
    container = container_of(pod)
    assert container["image"] == "vllm/vllm-openai:v0.32.0"
    # The token file becomes VLLM_API_KEY inside the container, then `vllm serve` runs.
    assert container["command"] == TOKEN_COMMAND
    assert container["command"][-1] == TOKEN_FILE
    args = container["args"]
    assert args[0] == "/models/llama"
    assert args[args.index("--host") + 1] == "$(POD_IP)"
    assert args[args.index("--port") + 1] == "8000"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cuda",
    }
    assert args[-1] == "--enforce-eager"
    env = env_of(container)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert "VLLM_API_KEY" not in env, "the token never sits in the pod spec"
    names_in_order = [e["name"] for e in container["env"]]
    assert names_in_order.index("POD_IP") < names_in_order.index("VLLM_NIXL_SIDE_CHANNEL_HOST")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert TOKEN_FILE.rsplit("/", 1)[0] in mounts


def test_probes_ports_and_gpus_of_a_vllm_pod() -> None:
    prefill = container_of(build_worker_pod(make_cluster(VLLM), Role.prefill, 0, 0))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert prefill[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert [p["name"] for p in prefill["ports"]] == ["http", "nixl-side"]
    decode = container_of(build_worker_pod(make_cluster(VLLM), Role.decode, 0, 0))
    # Each dp group listens on the side-channel port + its rank.
    assert [(p["name"], p["containerPort"]) for p in decode["ports"]] == [
        ("http", 8000),
        ("nixl-side", 5600),
        ("nixl-side-1", 5601),
    ]
    assert "nvidia.com/gpu" not in decode["resources"].get("limits", {})


def test_a_stopping_vllm_pod_is_announced_then_drains_within_its_grace_period() -> None:
    spec = {
        **VLLM,
        "router": {"requestTimeoutSeconds": 120},
        "decode": {"drain": {"timeoutSeconds": 45.5, "announceSeconds": 2.5}},
    }
    cluster = make_cluster(spec)
    decode = build_worker_pod(cluster, Role.decode, 0, 0)
    container = container_of(decode)
    args = container["args"]
    # vLLM finishes its requests on SIGTERM (its default, 0, aborts them) ...
    assert args[args.index("--shutdown-timeout") + 1] == "46"
    # ... after a sleep in which routers drop the terminating pod.
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 3}}}
    assert decode["spec"]["terminationGracePeriodSeconds"] >= 3 + 46
    # The prefill's budget is the router's request timeout.
    prefill_args = container_of(build_worker_pod(cluster, Role.prefill, 0, 0))["args"]
    assert prefill_args[prefill_args.index("--shutdown-timeout") + 1] == "120"


def test_a_vllm_pod_with_no_announcement_has_no_prestop_hook() -> None:
    spec = {**VLLM, "decode": {"drain": {"announceSeconds": 0}}}
    container = container_of(build_worker_pod(make_cluster(spec), Role.decode, 0, 0))
    assert "lifecycle" not in container
    assert "--shutdown-timeout" in container["args"]


def test_a_vllm_prefill_has_no_bootstrap_service_and_its_pods_say_vllm() -> None:
    cluster = make_cluster(VLLM)
    instance = build_instance(cluster, Role.prefill, 0)
    assert instance.bootstrap_service is None
    (pod,) = instance.pods
    assert pod["metadata"]["labels"][names.LABEL_ENGINE] == "vllm"
    assert names.ANNOTATION_BOOTSTRAP_PORT not in pod["metadata"]["annotations"]
    services = [o for o in render_objects(cluster) if o["kind"] == "Service"]
    assert [s["metadata"]["name"] for s in services] == [names.router_name("demo")]


def test_an_open_worker_api_runs_vllm_serve_without_a_key() -> None:
    spec = {**VLLM, "auth": {"workerApi": "open"}}
    container = container_of(build_worker_pod(make_cluster(spec), Role.decode, 0, 0))
    assert container["command"] == ["vllm", "serve"]


def test_a_colocated_vllm_pod_has_no_connector() -> None:
    spec = {k: v for k, v in VLLM.items() if k not in ("prefill", "decode")}
    container = container_of(
        build_worker_pod(make_cluster({**spec, "colocated": {}}), Role.colocated, 0, 0)
    )
    assert "--kv-transfer-config" not in container["args"]
    assert [p["name"] for p in container["ports"]] == ["http"]


def test_a_cache_aware_vllm_pod_names_its_event_ports_to_the_routers_discovery() -> None:
    spec = {**VLLM, "router": {"policy": {"prefill": "cache_aware"}}, "decode": {}}
    cluster = make_cluster(spec)
    prefill = build_worker_pod(cluster, Role.prefill, 0, 0)
    container = container_of(prefill)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["kv-events"], ports["kv-replay"]) == (5557, 5558)
    config = json.loads(container["args"][container["args"].index("--kv-events-config") + 1])
    assert config["endpoint"] == "tcp://*:5557"
    # What the router's discovery reads back from the running pod.
    prefill["status"] = {
        "podIP": "10.0.0.7",
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    settings = KubernetesDiscoverySettings(namespace="default", label_selector="")
    target = decide_pod(prefill, settings).target
    assert target is not None and target.kv_events == KVEventPorts(5557, 5558)
    # A role routed otherwise publishes nothing and is told nothing.
    decode = build_worker_pod(cluster, Role.decode, 0, 0)
    assert names.ANNOTATION_KV_EVENTS_PORT not in decode["metadata"]["annotations"]
    assert "--kv-events-config" not in container_of(decode)["args"]
    target = decide_pod({**decode, "status": prefill["status"]}, settings).target
    assert target is not None and target.kv_events is None


def pod_object(cluster: Any, role: Role, ip: str) -> dict[str, Any]:
    pod = build_worker_pod(cluster, role, 0, 0)
    pod["metadata"]["uid"] = f"uid-{role.value}"
    pod["status"] = {"podIP": ip, "phase": "Running"}
    return pod


@pytest.mark.parametrize("engine", [EngineKind.builtin, EngineKind.vllm])
def test_the_fast_path_tells_and_polls_only_pods_with_our_admin_api(engine: EngineKind) -> None:
    spec = VLLM if engine is EngineKind.vllm else {"prefill": {}, "decode": {}}
    cluster = make_cluster(spec)
    prefill = parse_pod_facts(pod_object(cluster, Role.prefill, "10.0.0.1"))
    decode = parse_pod_facts(pod_object(cluster, Role.decode, "10.0.0.2"))
    assert prefill is not None and decode is not None
    assert prefill.engine is engine and decode.engine is engine
    index = PodIndex()
    index.update(prefill)
    index.update(decode)
    builtin = engine is EngineKind.builtin
    assert index.peers_of(prefill) == ([decode] if builtin else [])
    assert index.reachable(prefill.key) == ([decode, prefill] if builtin else [])
    assert decode_targets([prefill, decode], prefill.cluster_uid) == ([decode] if builtin else [])
    loss = Loss(prefill, LossCause.deleted, happened_at=None)
    text = loss_message(loss, [], 30.0)
    assert ("the router ends its requests" in text) is not builtin


def test_the_engine_is_part_of_the_revision_only_when_set() -> None:
    from pdcluster.operator.reconcile.revision import compute_cluster_revision
    from pdcluster.runtime.spec import parse_spec

    builtin = parse_spec({"prefill": {}, "decode": {}})
    explicit = parse_spec({"prefill": {}, "decode": {}, "engine": {"kind": "builtin"}})
    assert compute_cluster_revision(builtin) == compute_cluster_revision(explicit)
    vllm = make_cluster(VLLM).spec
    args = {**VLLM, "engine": {"kind": "vllm", "vllm": {"extraArgs": ["--max-num-seqs", "8"]}}}
    assert compute_cluster_revision(vllm) != compute_cluster_revision(make_cluster(args).spec)


OURS: dict[str, Any] = {
    **VLLM,
    "engine": {"kind": "vllm", "vllm": {"kvConnector": "PDClusterConnector"}},
    "transfer": {"backend": "tcp"},
    "prefill": {},
    "decode": {},
}


@pytest.mark.parametrize("role", [Role.prefill, Role.decode])
def test_our_connector_opens_its_side_port_and_reads_the_token_file(role: Role) -> None:
    pod = build_worker_pod(make_cluster(OURS), role, 0, 0)
    container = container_of(pod)
    # The side port (bootstrap server, admin API) replaces vLLM's NIXL side channel.
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [
        ("http", 8000),
        ("bootstrap", 8998),
    ]
    args = container["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "PDClusterConnector"
    assert kv["kv_connector_extra_config"]["sidePort"] == 8998
    env = env_of(container)
    assert env["PDCLUSTER_TOKEN_FILE"] == TOKEN_FILE
    # Registered by the connector, so the fast path's reports name this start.
    assert env["PDCLUSTER_INCARNATION"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in env and "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env
    annotations = pod["metadata"]["annotations"]
    assert annotations[names.ANNOTATION_BOOTSTRAP_PORT] == "8998"
    assert annotations[names.ANNOTATION_ADMIN_PORT] == "8998"


def test_a_colocated_pod_has_no_side_port_even_with_our_connector() -> None:
    spec = {k: v for k, v in OURS.items() if k not in ("prefill", "decode")}
    pod = build_worker_pod(make_cluster({**spec, "colocated": {}}), Role.colocated, 0, 0)
    assert [p["name"] for p in container_of(pod)["ports"]] == ["http"]
    assert names.ANNOTATION_ADMIN_PORT not in pod["metadata"]["annotations"]


def test_the_fast_path_reaches_vllm_pods_with_our_connector_on_their_side_port() -> None:
    cluster = make_cluster(OURS)
    prefill = parse_pod_facts(pod_object(cluster, Role.prefill, "10.0.0.1"))
    decode = parse_pod_facts(pod_object(cluster, Role.decode, "10.0.0.2"))
    assert prefill is not None and decode is not None
    assert prefill.engine is EngineKind.vllm and prefill.has_admin_api
    # Told, polled and given the prefill set at the side port, not vLLM's HTTP port.
    assert decode.admin_url == "http://10.0.0.2:8998"
    assert decode.http_url == "http://10.0.0.2:8000"
    # The decode names the prefill by its side port: what the router sends it.
    assert prefill.peer == "10.0.0.1:8998"
    index = PodIndex()
    index.update(prefill)
    index.update(decode)
    assert index.peers_of(prefill) == [decode]
    assert index.peers_of(decode) == [prefill]
    assert decode_targets([prefill, decode], prefill.cluster_uid) == [decode]
    assert compute_prefill_peers([prefill, decode], prefill.cluster_uid) == {"10.0.0.1:8998"}
    text = loss_message(Loss(prefill, LossCause.deleted, happened_at=None), [], 30.0)
    assert "the router ends its requests" not in text


def test_a_vllm_pod_without_the_admin_annotation_has_no_admin_api() -> None:
    pod = pod_object(make_cluster(OURS), Role.decode, "10.0.0.2")
    del pod["metadata"]["annotations"][names.ANNOTATION_ADMIN_PORT]
    facts = parse_pod_facts(pod)
    assert facts is not None and facts.admin_url is None and not facts.has_admin_api
    # Ours without the annotation (pods built before it existed): the HTTP port.
    builtin = parse_pod_facts(
        pod_object(make_cluster({"prefill": {}, "decode": {}}), Role.decode, "10.0.0.3")
    )
    assert builtin is not None and builtin.admin_url == "http://10.0.0.3:8000"
