"""Pure builders: every child manifest from the spec, without a cluster."""

from __future__ import annotations

import base64
import itertools
from typing import Any

import pytest
import yaml

from pdcluster.operator import names
from pdcluster.operator.builders import (
    BuildError,
    build_bootstrap_service,
    build_config_map,
    build_desired,
    build_instance,
    build_network_policies,
    build_router_deployment,
    build_router_service,
    build_runtime_rbac,
    build_token_secret,
    build_worker_pod,
)
from pdcluster.runtime.spec import Role, load_manifest_text

from .helpers import NS, PD, UID, make_cluster, need

K8S_VERSION = "1.37.0"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Every (dp, tp, cp, pp) with axes in {1, 2} plus a few wider ones, with each
# gpusPerPod that divides the rank count.
TOPOLOGIES = [
    (dp, tp, cp, pp, g)
    for dp, tp, cp, pp in [*itertools.product((1, 2), repeat=4), (1, 4, 1, 2), (3, 1, 1, 1)]
    for g in _divisors(dp * tp * cp * pp)
]


def role_cluster(role: Role, topo: tuple[int, int, int, int, int], **extra: Any):
    dp, tp, cp, pp, gpus = topo
    rs = {"topology": {"dp": dp, "tp": tp, "cp": cp, "pp": pp}, "gpusPerPod": gpus, **extra}
    if role == Role.colocated:
        return make_cluster({"colocated": rs})
    if role == Role.prefill:
        return make_cluster({"prefill": rs, "decode": {"topology": {"pp": pp}}})
    # Decode: cp must be 1 and pp must match prefill's (or be 1).
    rs["topology"]["cp"] = 1
    rs["gpusPerPod"] = gpus if (dp * tp * pp) % gpus == 0 else 1
    return make_cluster({"prefill": {"topology": {"pp": pp}}, "decode": rs})


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]
    }


def arg_after(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: "dp{}tp{}cp{}pp{}g{}".format(*t))
def test_gpus_per_pod_is_obeyed_and_the_leader_comes_first(role: Role, topo) -> None:
    # Without the leader's address only pod 0 is built; the manifest the pods
    # read keeps gpusPerPod as written (never raised to the rank count).
    cluster = role_cluster(role, topo)
    spec = getattr(cluster.spec, role.value)
    inst = build_instance(cluster, role, 3)
    ranks, gpus = spec.topology.num_ranks, spec.gpus_per_pod or spec.topology.num_ranks
    assert inst.num_pods == ranks // gpus
    (pod,) = inst.pods
    args = pod["spec"]["containers"][0]["args"]
    env = env_of(pod)
    assert arg_after(args, "--role") == role.value
    assert arg_after(args, "--instance") == "3"
    assert arg_after(args, "--pod-index") == "0"
    assert env["PDCLUSTER_LEADER_POD"] == pod["metadata"]["name"]
    assert env["PDCLUSTER_NUM_RANKS"] == str(ranks)
    assert env["PDCLUSTER_RANKS_PER_POD"] == str(gpus)
    assert env["PDCLUSTER_FIRST_RANK"] == "0"
    assert "PDCLUSTER_LEADER_ADDRESS" not in env
    labels = pod["metadata"]["labels"]
    assert labels[names.LABEL_POD_INDEX] == "0"
    assert labels[names.LABEL_LEADER] == "true"
    assert labels[names.LABEL_INSTANCE_INDEX] == "3"
    assert labels[names.LABEL_ROLE] == role.value
    assert pod["metadata"]["annotations"][names.ANNOTATION_INSTANCE_SIZE] == str(ranks // gpus)
    placed = load_manifest_text(build_config_map(cluster)["data"]["manifest.yaml"])
    placed_role = getattr(placed.spec, role.value)
    assert placed_role.pods_per_instance == ranks // gpus
    assert placed_role.topology == spec.topology
    assert build_desired(cluster).role(role).pods_per_instance == ranks // gpus


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: "dp{}tp{}cp{}pp{}g{}".format(*t))
def test_spread_placement_covers_every_rank_once(role: Role, topo) -> None:
    cluster = role_cluster(role, topo)
    spec = getattr(cluster.spec, role.value)
    inst = build_instance(cluster, role, 3, "10.1.2.3")
    ranks, gpus = spec.topology.num_ranks, spec.gpus_per_pod
    assert len(inst.pods) == ranks // gpus
    leader = inst.pods[0]["metadata"]["name"]
    first_ranks = []
    for k, pod in enumerate(inst.pods):
        env = env_of(pod)
        assert arg_after(pod["spec"]["containers"][0]["args"], "--pod-index") == str(k)
        assert env["PDCLUSTER_LEADER_POD"] == leader
        assert env["PDCLUSTER_RANKS_PER_POD"] == str(gpus)
        assert pod["metadata"]["labels"][names.LABEL_POD_INDEX] == str(k)
        assert pod["metadata"]["annotations"][names.ANNOTATION_INSTANCE_SIZE] == str(len(inst.pods))
        assert pod["metadata"]["labels"][names.LABEL_LEADER] == str(k == 0).lower()
        if k:
            # Pods k > 0 join the leader at the address they are given, serve no HTTP.
            assert env["PDCLUSTER_LEADER_ADDRESS"] == "10.1.2.3"
            assert pod["metadata"]["annotations"][names.ANNOTATION_LEADER_ADDRESS] == "10.1.2.3"
            assert "readinessProbe" not in pod["spec"]["containers"][0]
        first_ranks.append(int(env["PDCLUSTER_FIRST_RANK"]))
    # Pods own disjoint, contiguous rank ranges that together cover the instance.
    assert first_ranks == list(range(0, ranks, gpus))
    assert len(set(inst.pod_names)) == len(inst.pods)


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_pods_bind_their_own_address_and_read_the_manifest_from_the_config_map(
    role: Role,
) -> None:
    cluster = role_cluster(role, (1, 1, 1, 1, 1))
    pod = build_instance(cluster, role, 0).pods[0]
    router = build_router_deployment(cluster)["spec"]["template"]
    for spec in (pod["spec"], router["spec"]):
        (container,) = spec["containers"]
        args, env = container["args"], env_of({"spec": spec})
        # Pods of one node may share a network: 0.0.0.0 would collide.
        assert arg_after(args, "--host") == "$(POD_IP)"
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert arg_after(args, "-f") == "env:PDCLUSTER_MANIFEST"
        assert env["PDCLUSTER_MANIFEST"] == {
            "configMapKeyRef": {"name": "demo-config", "key": "manifest.yaml"}
        }
        # The manifest comes by variable: no ConfigMap volume to mount.
        assert not [v for v in spec["volumes"] if "configMap" in v]


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_only_prefill_gets_bootstrap_port_and_service(role: Role) -> None:
    cluster = role_cluster(role, (1, 2, 1, 1, 1))
    inst = build_instance(cluster, role, 0)
    args = inst.pods[0]["spec"]["containers"][0]["args"]
    annotations = inst.pods[0]["metadata"]["annotations"]
    if role == Role.prefill:
        assert arg_after(args, "--bootstrap-port") == "8998"
        assert annotations[names.ANNOTATION_BOOTSTRAP_PORT] == "8998"
        assert inst.bootstrap_service is not None
    else:
        assert "--bootstrap-port" not in args
        assert names.ANNOTATION_BOOTSTRAP_PORT not in annotations
        assert inst.bootstrap_service is None
    assert annotations[names.ANNOTATION_HTTP_PORT] == "8000"


def test_bootstrap_service_selects_only_the_leader_of_its_instance() -> None:
    cluster = make_cluster({"prefill": {"replicas": 2, "topology": {"tp": 2}}, "decode": {}})
    svc = build_bootstrap_service(cluster, 1)
    selector = svc["spec"]["selector"]
    pods = [
        *build_instance(cluster, Role.prefill, 0).pods,
        *build_instance(cluster, Role.prefill, 1).pods,
    ]
    selected = [
        p["metadata"]["name"] for p in pods if selector.items() <= p["metadata"]["labels"].items()
    ]
    assert selected == [build_instance(cluster, Role.prefill, 1).pods[0]["metadata"]["name"]]
    assert svc["spec"]["clusterIP"] == "None"


def test_every_child_carries_labels_and_a_controller_owner_reference() -> None:
    cluster = make_cluster(
        {"prefill": {"replicas": 2}, "decode": {"topology": {"tp": 2}, "gpusPerPod": 2}}
    )
    desired = build_desired(cluster)
    children = [*desired.objects, build_token_secret(cluster, "t0k3n")]
    for role in desired.roles:
        inst = desired.instance(role.role, 0)
        children += [*inst.pods, *([inst.bootstrap_service] if inst.bootstrap_service else [])]
    for child in children:
        meta = child["metadata"]
        assert meta["namespace"] == NS
        assert meta["labels"][names.LABEL_CLUSTER] == "demo"
        assert meta["labels"][names.LABEL_NAME] == "pdcluster"
        assert meta["labels"][names.LABEL_INSTANCE] == "demo"
        (ref,) = meta["ownerReferences"]
        assert ref == {
            "apiVersion": "pdcluster.io/v1alpha1",
            "kind": "PDCluster",
            "name": "demo",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def all_children(cluster) -> list[dict[str, Any]]:
    desired = build_desired(cluster)
    out = [*desired.objects, build_token_secret(cluster, "tok")]
    for role in desired.roles:
        inst = desired.instance(role.role, 0)
        out += list(inst.pods)
        if inst.bootstrap_service:
            out.append(inst.bootstrap_service)
    return out


SCHEDULING = {
    "device": "cuda",
    "resources": {"limits": {"cpu": "4", "memory": "16Gi"}, "requests": {"cpu": "2"}},
    "nodeSelector": {"gpu": "h100"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    },
}


@pytest.mark.parametrize(
    "spec",
    [
        PD,
        {"colocated": {"replicas": 2}},
        {
            "prefill": {"topology": {"tp": 4, "pp": 2}, "gpusPerPod": 4, **SCHEDULING},
            "decode": {"topology": {"tp": 2, "pp": 2}, "gpusPerPod": 2, **SCHEDULING},
            "router": {"service": {"type": "LoadBalancer", "port": 443}, "replicas": 2},
            "auth": {"tokenSecretName": "mine", "routerApiKeySecretName": "keys"},
        },
    ],
    ids=["pd", "colocated", "scheduled"],
)
def test_every_child_is_valid_against_the_kubernetes_schema(spec) -> None:
    validator = need("kubernetes_validate")
    for child in all_children(make_cluster(spec)):
        validator.validate(child, K8S_VERSION, strict=True)


def test_cuda_pods_request_gpus_and_scheduling_fields_pass_through() -> None:
    cluster = make_cluster(
        {"prefill": {"topology": {"tp": 4}, "gpusPerPod": 2, **SCHEDULING}, "decode": {}}
    )
    pod = build_worker_pod(cluster, Role.prefill, 0, 0)
    spec = pod["spec"]
    resources = spec["containers"][0]["resources"]
    # gpusPerPod 2: each of the instance's two pods runs 2 ranks, one GPU each.
    assert resources["limits"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 2}
    assert resources["requests"] == {"cpu": "2"}
    assert spec["nodeSelector"] == SCHEDULING["nodeSelector"]
    assert spec["tolerations"] == SCHEDULING["tolerations"]
    assert spec["affinity"] == SCHEDULING["affinity"]
    assert spec["restartPolicy"] == "Never"


def test_cpu_pods_request_no_gpus_and_leave_scheduling_unset() -> None:
    pod = build_worker_pod(make_cluster(PD), Role.decode, 0, 0)
    resources = pod["spec"]["containers"][0]["resources"]
    assert "limits" not in resources and "nvidia.com/gpu" not in resources["requests"]
    assert not {"nodeSelector", "tolerations", "affinity"} & pod["spec"].keys()


@pytest.mark.parametrize(
    ("role_extra", "words"),
    [
        ({"device": "cuda", "resources": {"limits": {"nvidia.com/gpu": 3}}}, "runs 1 ranks"),
        ({"resources": {"limits": {"nvidia.com/gpu": 1}}}, "device is cpu"),
        ({"resources": {"limit": {"cpu": 1}}}, "unknown keys ['limit']"),
        ({"resources": {"limits": "4"}}, "must be a mapping"),
    ],
)
def test_contradictory_resources_are_rejected_with_a_reason(role_extra, words) -> None:
    cluster = make_cluster({"prefill": role_extra, "decode": {}})
    with pytest.raises(BuildError, match="prefill.resources") as err:
        build_desired(cluster)
    assert words in str(err.value)


def test_out_of_range_pod_index_is_an_error() -> None:
    cluster = make_cluster({"prefill": {"topology": {"tp": 2}, "gpusPerPod": 1}, "decode": {}})
    with pytest.raises(BuildError, match="pod index 2 is out of range"):
        build_worker_pod(cluster, Role.prefill, 0, 2, "10.0.0.1")
    with pytest.raises(BuildError, match="needs its leader pod's address"):
        build_worker_pod(cluster, Role.prefill, 0, 1)
    for bad in ("", "10.0.0.1:8000", "http://10.0.0.1", "a b"):
        with pytest.raises(BuildError, match="pod index 1"):
            build_worker_pod(cluster, Role.prefill, 0, 1, bad)
    with pytest.raises(BuildError, match="no colocated role"):
        build_instance(cluster, Role.colocated, 0)


def token_volume(pod: dict[str, Any]) -> dict[str, Any]:
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "cluster-token"]
    return dict(volume["secret"])


def test_pods_read_the_token_from_the_cluster_secret_or_the_users() -> None:
    own = token_volume(build_worker_pod(make_cluster(PD), Role.prefill, 0, 0))
    assert own["secretName"] == "demo-token"
    assert own["items"] == [{"key": "token", "path": "token"}]
    mine = make_cluster({**PD, "auth": {"tokenSecretName": "mine"}})
    assert token_volume(build_worker_pod(mine, Role.decode, 0, 0))["secretName"] == "mine"
    assert build_desired(mine).owns_token_secret is False


def test_config_map_holds_the_validated_manifest_the_pods_read() -> None:
    cluster = make_cluster({**PD, "kvCache": {"pageSize": 32}, "decode": {"replicas": 2}})
    text = build_config_map(cluster)["data"]["manifest.yaml"]
    parsed = load_manifest_text(text)
    # Everything as validated; only an unset zmqCurve is filled in (see below).
    assert parsed.spec.model_copy(update={"auth": cluster.spec.auth}) == cluster.spec
    assert parsed.metadata.name == "demo" and parsed.metadata.namespace == NS
    assert "status" not in yaml.safe_load(text)


@pytest.mark.parametrize(("auth", "curve"), [({}, True), ({"zmqCurve": False}, False)])
def test_pods_run_curve_unless_the_spec_turns_it_off(auth: dict[str, Any], curve: bool) -> None:
    cluster = make_cluster({**PD, "auth": auth})
    assert cluster.spec.auth.zmq_curve is (None if not auth else False)
    parsed = load_manifest_text(build_config_map(cluster)["data"]["manifest.yaml"])
    assert parsed.spec.auth.zmq_curve is curve


def test_token_secret_encodes_the_token_and_rejects_empty_ones() -> None:
    secret = build_token_secret(make_cluster(PD), "s3cret")
    assert base64.b64decode(secret["data"]["token"]) == b"s3cret"
    for bad in ("", "tab\there", "é"):
        with pytest.raises(ValueError, match="printable ASCII"):
            build_token_secret(make_cluster(PD), bad)


def test_router_discovers_its_cluster_by_labels_and_exposes_the_service_port() -> None:
    cluster = make_cluster(
        {**PD, "router": {"replicas": 3, "service": {"type": "NodePort", "port": 9000}}}
    )
    dep, svc = build_router_deployment(cluster), build_router_service(cluster)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert arg_after(args, "--namespace") == NS and arg_after(args, "--cluster") == "demo"
    assert "--kubernetes" in args
    assert dep["spec"]["replicas"] == 3
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == selector
    assert svc["spec"]["type"] == "NodePort" and svc["spec"]["ports"][0]["port"] == 9000
    # Worker discovery skips router pods: their role label is not a worker role.
    assert dep["spec"]["template"]["metadata"]["labels"][names.LABEL_ROLE] == "router"


def test_router_rolls_when_what_it_reads_changes_but_not_on_scaling() -> None:
    def router_hash(spec):
        dep = build_router_deployment(make_cluster(spec))
        return dep["spec"]["template"]["metadata"]["annotations"]["pdcluster.io/router-hash"]

    base = router_hash(PD)
    assert router_hash({**PD, "decode": {"replicas": 5}}) == base
    assert router_hash({**PD, "router": {"replicas": 4}}) == base
    # Policies are put to the running router (live_settings.py); which roles
    # cache_aware follows is fixed at its start.
    assert router_hash({**PD, "router": {"policy": {"decode": "random"}}}) == base
    assert router_hash({**PD, "router": {"policy": {"decode": "cache_aware"}}}) != base
    assert router_hash({**PD, "router": {"requestTimeoutSeconds": 30}}) != base
    assert router_hash({**PD, "image": "pdcluster:0.2.0"}) != base


def test_runtime_rbac_only_reads_pods_in_its_namespace() -> None:
    account, role, binding = build_runtime_rbac(make_cluster(PD))
    assert role["kind"] == "Role"  # namespaced, never a ClusterRole
    granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    # What the router's discovery needs; no pod posts events or writes anything.
    assert granted == {("pods", "get"), ("pods", "list"), ("pods", "watch")}
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NS}
    ]
    pod = build_worker_pod(make_cluster(PD), Role.prefill, 0, 0)
    assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_builders_are_deterministic() -> None:
    spec = {"prefill": {"replicas": 2, "topology": {"tp": 2}}, "decode": {}}
    assert all_children(make_cluster(spec)) == all_children(make_cluster(spec))


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_network_policies_admit_only_own_pods_and_the_operator_to_workers() -> None:
    cluster = make_cluster({**PD, "router": {"service": {"port": 443}}})
    workers, router = build_network_policies(cluster, operator_namespace="ops")
    for policy in (workers, router):
        need("kubernetes_validate").validate(policy, K8S_VERSION, strict=True)
        assert policy["metadata"]["ownerReferences"][0]["uid"] == UID
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    worker_pod = build_worker_pod(cluster, Role.prefill, 0, 0)
    router_pod = build_router_deployment(cluster)["spec"]["template"]
    selects = workers["spec"]["podSelector"]["matchLabels"]
    assert _matches(selects, worker_pod["metadata"]["labels"])
    assert not _matches(selects, router_pod["metadata"]["labels"])
    own, operator = workers["spec"]["ingress"]
    # Peers and the router: any port (KV transfer, process group); no one else.
    (peer,) = own["from"]
    assert "ports" not in own and "namespaceSelector" not in peer
    assert _matches(peer["podSelector"]["matchLabels"], router_pod["metadata"]["labels"])
    assert _matches(peer["podSelector"]["matchLabels"], worker_pod["metadata"]["labels"])
    other = make_cluster(PD, name="other")
    other_pod = build_worker_pod(other, Role.prefill, 0, 0)
    assert not _matches(peer["podSelector"]["matchLabels"], other_pod["metadata"]["labels"])
    (op,) = operator["from"]
    assert op["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ops"}
    assert operator["ports"] == [{"protocol": "TCP", "port": 8000}]
    # The router: its Service's target port (the container's "http"), from anywhere.
    assert _matches(router["spec"]["podSelector"]["matchLabels"], router_pod["metadata"]["labels"])
    service = build_router_service(cluster)
    (svc_port,) = service["spec"]["ports"]
    (container,) = router_pod["spec"]["containers"]
    target = next(p for p in container["ports"] if p["name"] == svc_port["targetPort"])
    assert router["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": target["containerPort"]}]}
    ]


def test_without_an_operator_namespace_no_operator_pods_are_admitted() -> None:
    workers, _ = build_network_policies(make_cluster(PD))
    assert len(workers["spec"]["ingress"]) == 1
    assert {o["metadata"]["name"] for o in build_desired(make_cluster(PD)).objects} >= {
        "demo-workers-ingress",
        "demo-router-ingress",
    }


@pytest.mark.parametrize("role", [Role.prefill, Role.decode])
def test_liveness_reads_the_engine_stall_and_readiness_the_full_health(role: Role) -> None:
    (container,) = build_worker_pod(make_cluster(PD), role, 0, 0)["spec"]["containers"]
    # A hung engine fails /health/live (engine_stalled): the kubelet restarts it.
    # A worker only waiting for its peers fails /health alone: out of the pool, kept alive.
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
