"""PodGroup and placement rendering of multi-pod instances (operator/builders/scheduling.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from pdcluster.operator import names
from pdcluster.operator.builders.scheduling import (
    POD_GROUP_API_VERSION,
    PodScheduling,
    build_pod_group,
    build_pod_scheduling,
)
from pdcluster.operator.builders.workers import BuildError, build_instance
from pdcluster.runtime.spec import Role, SpecError, parse_spec

from .helpers import PD, UID, make_cluster

LEADER_IP = "10.0.0.1"
RACK = "topology.example.com/rack"


def selects(selector: Mapping[str, str], pod: Mapping[str, Any]) -> bool:
    labels = pod["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize(
    ("role_spec", "pods"),
    [
        ({"topology": {"tp": 4}, "gpusPerPod": 2}, 2),
        ({"topology": {"tp": 2, "pp": 2}, "gpusPerPod": 1}, 4),
        ({"topology": {"dp": 2, "tp": 4}, "gpusPerPod": 4}, 2),
        ({"topology": {"tp": 4}}, 1),
    ],
)
def test_a_pod_group_per_instance_asks_for_all_its_pods(
    role_spec: dict[str, Any], pods: int
) -> None:
    spec = {**role_spec, "scheduling": {"gang": "podGroup"}}
    cluster = make_cluster({"prefill": spec, "decode": {}})
    group = build_pod_group(cluster, Role.prefill, 1)
    assert group is not None
    assert group["apiVersion"] == POD_GROUP_API_VERSION and group["kind"] == "PodGroup"
    assert group["spec"] == {"minMember": pods}
    assert group["metadata"]["ownerReferences"][0]["uid"] == UID
    instance = build_instance(cluster, Role.prefill, 1, LEADER_IP)
    assert len(instance.pods) == pods
    # Every pod of the instance names this PodGroup; its name is the instance's.
    label = build_pod_scheduling(cluster, Role.prefill, 1).labels
    assert label == {names.LABEL_POD_GROUP: group["metadata"]["name"]}
    assert group["metadata"]["name"] == names.instance_name(
        "demo", Role.prefill, 1, instance.key.template_hash
    )


def test_pod_groups_of_different_instances_and_templates_differ() -> None:
    gang = {"scheduling": {"gang": "podGroup"}}
    cluster = make_cluster({"prefill": gang, "decode": gang})
    rolled = make_cluster(
        {"prefill": {**gang, "engine": {"maxRunningRequests": 8}}, "decode": gang}
    )
    groups = [
        build_pod_group(c, r, i)
        for c, r, i in [
            (cluster, Role.prefill, 0),
            (cluster, Role.prefill, 1),
            (cluster, Role.decode, 0),
            (rolled, Role.prefill, 0),
        ]
    ]
    assert len({g["metadata"]["name"] for g in groups if g is not None}) == 4


def test_without_the_new_fields_nothing_changes_on_the_pods() -> None:
    cluster = make_cluster(
        {"prefill": {"affinity": {"nodeAffinity": {"x": 1}}, "topology": {"tp": 2}}, "decode": {}}
    )
    for role in (Role.prefill, Role.decode):
        assert build_pod_group(cluster, role, 0) is None
        fields = build_pod_scheduling(cluster, role, 0)
        assert fields.labels == {} and fields.scheduler_name is None
        for pod in build_instance(cluster, role, 0).pods:
            assert fields.apply_to(pod) == pod


def test_scheduler_name_is_set_on_the_pods() -> None:
    spec = {"scheduling": {"gang": "podGroup", "schedulerName": "scheduler-plugins-scheduler"}}
    cluster = make_cluster({"prefill": spec, "decode": {}})
    fields = build_pod_scheduling(cluster, Role.prefill, 0)
    pod = fields.apply_to(build_instance(cluster, Role.prefill, 0).pods[0])
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    assert pod["metadata"]["labels"][names.LABEL_POD_GROUP] == names.instance_name(
        "demo", Role.prefill, 0, pod["metadata"]["labels"][names.LABEL_TEMPLATE]
    )


def test_topology_key_requires_the_instance_pods_in_one_domain() -> None:
    spec = {"topology": {"tp": 2}, "gpusPerPod": 1, "placement": {"topologyKey": RACK}}
    cluster = make_cluster({"prefill": {**spec, "replicas": 2}, "decode": {}})
    affinity = build_pod_scheduling(cluster, Role.prefill, 0).affinity
    (term,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == RACK
    selector = term["labelSelector"]["matchLabels"]
    own = build_instance(cluster, Role.prefill, 0, LEADER_IP).pods
    other = build_instance(cluster, Role.prefill, 1, LEADER_IP).pods
    decode = build_instance(cluster, Role.decode, 0, LEADER_IP).pods
    assert len(own) == 2 and all(selects(selector, p) for p in own)
    assert not any(selects(selector, p) for p in (*other, *decode))
    # Prefill prefers no other role's domain.
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in affinity["podAffinity"]


@pytest.mark.parametrize(
    ("prefill_key", "decode_key", "required", "preferred"),
    [
        (None, RACK, RACK, RACK),
        (RACK, None, None, RACK),
        (RACK, "kubernetes.io/hostname", "kubernetes.io/hostname", "kubernetes.io/hostname"),
        (None, None, None, None),
    ],
)
def test_decode_prefers_the_domain_of_prefill(
    prefill_key: str | None, decode_key: str | None, required: str | None, preferred: str | None
) -> None:
    def role(key: str | None) -> dict[str, Any]:
        return {"placement": {"topologyKey": key}} if key else {}

    cluster = make_cluster({"prefill": role(prefill_key), "decode": role(decode_key)})
    affinity = build_pod_scheduling(cluster, Role.decode, 0).affinity.get("podAffinity", {})
    req = affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    pref = affinity.get("preferredDuringSchedulingIgnoredDuringExecution")
    assert (req[0]["topologyKey"] if req else None) == required
    if preferred is None:
        assert pref is None
        return
    (term,) = pref
    assert term["weight"] == 100
    assert term["podAffinityTerm"]["topologyKey"] == preferred
    prefill_pod = build_instance(cluster, Role.prefill, 0).pods[0]
    decode_pod = build_instance(cluster, Role.decode, 0).pods[0]
    assert selects(term["podAffinityTerm"]["labelSelector"]["matchLabels"], prefill_pod)
    assert not selects(term["podAffinityTerm"]["labelSelector"]["matchLabels"], decode_pod)


def test_the_users_affinity_is_kept_and_ours_appended() -> None:
    theirs = {"labelSelector": {"matchLabels": {"app": "cache"}}, "topologyKey": "zone"}
    user = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"a": 1}},
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [theirs]},
    }
    cluster = make_cluster(
        {"prefill": {"affinity": user, "placement": {"topologyKey": RACK}}, "decode": {}}
    )
    affinity = build_pod_scheduling(cluster, Role.prefill, 0).affinity
    assert affinity["nodeAffinity"] == user["nodeAffinity"]
    terms = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0] == theirs and terms[1]["topologyKey"] == RACK
    assert cluster.spec.prefill is not None and cluster.spec.prefill.affinity == user  # untouched


@pytest.mark.parametrize(
    "affinity",
    [
        {"podAffinity": ["x"]},
        {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}},
    ],
)
def test_a_malformed_user_pod_affinity_is_a_build_error(affinity: dict[str, Any]) -> None:
    cluster = make_cluster(
        {"prefill": {"affinity": affinity, "placement": {"topologyKey": RACK}}, "decode": {}}
    )
    with pytest.raises(BuildError, match="affinity.podAffinity"):
        build_pod_scheduling(cluster, Role.prefill, 0)


def test_apply_to_leaves_the_built_pod_alone() -> None:
    cluster = make_cluster({"prefill": {"scheduling": {"gang": "podGroup"}}, "decode": {}})
    pod = build_instance(cluster, Role.prefill, 0).pods[0]
    before = repr(pod)
    build_pod_scheduling(cluster, Role.prefill, 0).apply_to(pod)
    assert repr(pod) == before
    assert PodScheduling().apply_to(pod) == pod


def test_a_missing_role_or_negative_index_is_a_build_error() -> None:
    cluster = make_cluster(PD)
    with pytest.raises(BuildError, match="no colocated role"):
        build_pod_group(cluster, Role.colocated, 0)
    gang = make_cluster({"prefill": {"scheduling": {"gang": "podGroup"}}, "decode": {}})
    with pytest.raises(BuildError, match="index must be >= 0"):
        build_pod_group(gang, Role.prefill, -1)


@pytest.mark.parametrize(
    ("role_spec", "field"),
    [
        ({"scheduling": {"gang": "gang"}}, "gang"),
        ({"scheduling": {"schedulerName": "Not A Name"}}, "schedulerName"),
        ({"scheduling": {"schedulerName": ""}}, "schedulerName"),
        ({"placement": {"topologyKey": "bad key"}}, "topologyKey"),
        ({"placement": {"topologyKey": "/rack"}}, "topologyKey"),
        ({"placement": {"zone": "a"}}, "zone"),
    ],
)
def test_bad_scheduling_and_placement_fields_are_refused(
    role_spec: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError, match=field):
        parse_spec({"prefill": role_spec, "decode": {}})


def test_good_scheduling_and_placement_fields_parse() -> None:
    spec = parse_spec(
        {
            "prefill": {
                "scheduling": {"gang": "podGroup", "schedulerName": "sched.example.com"},
                "placement": {"topologyKey": "nvidia.com/gpu.clique"},
            },
            "decode": {"placement": {"topologyKey": "kubernetes.io/hostname"}},
        }
    )
    assert (
        spec.prefill is not None and spec.prefill.scheduling.scheduler_name == "sched.example.com"
    )
