"""Multi-pod instances in the operator: the gang's health, the leader address its
pods are built with, whom the fast path tells, and what the status lists."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

from pdcluster.operator import names
from pdcluster.operator.builders.meta import ObjectKey
from pdcluster.operator.builders.workers import InstanceKey, build_instance, build_worker_pod
from pdcluster.operator.failover.peers import PodIndex
from pdcluster.operator.failover.pod_facts import PodFacts, parse_pod_facts
from pdcluster.operator.failover.prefill_peers import compute_prefill_peers, decode_targets
from pdcluster.operator.reconcile.instances import Health, judge
from pdcluster.operator.reconcile.observed import ObservedObject, ObservedPod
from pdcluster.operator.render import PLACEHOLDER_LEADER_ADDRESS, render_objects
from pdcluster.runtime.spec import Role

from .helpers import UID, Sim, make_cluster
from .podmaker import worker_pod

TWO_POD = {
    "prefill": {"topology": {"tp": 2}, "gpusPerPod": 1, "restart": {"backoffSeconds": 1}},
    "decode": {"topology": {"tp": 2}, "gpusPerPod": 1},
}
LEADER_IP = "10.0.0.7"
KEY = InstanceKey(Role.prefill, 0, "abc123")


# ----------------------------------------------------------------- gang health
# A pod as the planner sees it: (phase, ready, started), plus its leader address.
STATES: dict[str, tuple[str, bool, bool]] = {
    "pending": ("Pending", False, False),
    "starting": ("Running", False, False),  # startup probe not passed
    "not_ready": ("Running", False, True),  # passed it, now not Ready
    "ready": ("Running", True, True),
    "failed": ("Failed", False, False),
    "lost": ("Unknown", False, False),
}


def observed_pod(
    index: int, state: str, *, leader_address: str | None = LEADER_IP, terminating: bool = False
) -> ObservedPod:
    phase, ready, started = STATES[state]
    name = f"demo-prefill-0-abc123-{index}"
    obj = ObservedObject(ObjectKey("Pod", name), f"uid-{index}", UID, {}, {}, terminating)
    return ObservedPod(
        obj=obj,
        role=Role.prefill,
        instance=0,
        pod_index=index,
        template_hash="abc123",
        instance_size=2,
        phase=phase,
        ready=ready,
        pod_ip=LEADER_IP if index == 0 and phase != "Pending" else None,
        started=started,
        leader_address=leader_address if index else None,
    )


def expected_health(leader: str | None, follower: str | None) -> Health:
    """The gang rule (reconcile/instances.py), written out for a 2-pod instance."""
    present = [s for s in (leader, follower) if s is not None]
    if any(s in ("failed", "lost") for s in present) or (leader is None and follower):
        return Health.starting if "pending" in present else Health.broken
    if follower is None:
        assert leader is not None
        formed = STATES[leader][2] or STATES[leader][1]
        return Health.broken if formed else Health.incomplete
    if leader == follower == "ready":
        return Health.ready
    return Health.starting


@pytest.mark.parametrize(
    ("leader", "follower"),
    [
        (a, b)
        for a, b in itertools.product([None, *STATES], repeat=2)
        if not (a is None and b is None)
    ],
)
def test_gang_health_over_every_pair_of_pod_states(
    leader: str | None, follower: str | None
) -> None:
    pods = {}
    if leader is not None:
        pods[0] = observed_pod(0, leader)
    if follower is not None:
        pods[1] = observed_pod(1, follower)
    inst = judge(KEY, 2, pods)
    assert inst.health is expected_health(leader, follower), inst.reason
    assert inst.is_serving == (leader == follower == "ready")


def test_a_terminating_member_makes_the_gang_wait_whatever_the_others_do() -> None:
    for state in STATES:
        pods = {0: observed_pod(0, state), 1: observed_pod(1, "ready", terminating=True)}
        assert judge(KEY, 2, pods).health is Health.terminating


def test_a_pod_started_for_another_leader_breaks_the_gang() -> None:
    pods = {0: observed_pod(0, "starting"), 1: observed_pod(1, "ready", leader_address="10.9.9.9")}
    inst = judge(KEY, 2, pods)
    assert inst.health is Health.broken
    assert "10.9.9.9" in inst.reason and LEADER_IP in inst.reason


def test_a_failed_pod_waits_for_a_pod_pending_its_first_start_before_restarting() -> None:
    inst = judge(KEY, 2, {0: observed_pod(0, "failed"), 1: observed_pod(1, "pending")})
    assert inst.health is Health.starting
    assert "pending its first start" in inst.reason


# ------------------------------------------------------- pods and the leader address
def test_only_the_leader_is_built_until_its_address_is_known() -> None:
    cluster = make_cluster(TWO_POD)
    alone = build_instance(cluster, Role.prefill, 0)
    assert alone.num_pods == 2 and len(alone.pods) == 1
    both = build_instance(cluster, Role.prefill, 0, LEADER_IP)
    leader, follower = both.pods
    assert leader == alone.pods[0]  # the leader's manifest does not depend on the address
    container = follower["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PDCLUSTER_LEADER_ADDRESS"] == LEADER_IP
    assert container["args"][container["args"].index("--pod-index") + 1] == "1"
    # Only the leader serves HTTP and the bootstrap server: the others have no probes.
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & container.keys()
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= leader["spec"]["containers"][
        0
    ].keys()
    assert names.ANNOTATION_BOOTSTRAP_PORT not in follower["metadata"]["annotations"]
    # The bootstrap Service selects the leader only.
    assert both.bootstrap_service is not None
    assert both.bootstrap_service["spec"]["selector"][names.LABEL_POD_INDEX] == "0"


def test_render_shows_every_pod_with_a_placeholder_leader_address() -> None:
    pods = [o for o in render_objects(make_cluster(TWO_POD)) if o["kind"] == "Pod"]
    assert len(pods) == 4
    followers = [p for p in pods if p["metadata"]["labels"][names.LABEL_LEADER] == "false"]
    assert {p["metadata"]["annotations"][names.ANNOTATION_LEADER_ADDRESS] for p in followers} == {
        PLACEHOLDER_LEADER_ADDRESS
    }


def test_placement_affinity_and_the_scheduler_name_reach_every_pod() -> None:
    rack = "topology.example.com/rack"
    spec = copy.deepcopy(TWO_POD)
    spec["prefill"]["placement"] = {"topologyKey": rack}
    spec["prefill"]["scheduling"] = {"schedulerName": "gang-scheduler"}
    cluster = make_cluster(spec)
    for pod in build_instance(cluster, Role.prefill, 0, LEADER_IP).pods:
        assert pod["spec"]["schedulerName"] == "gang-scheduler"
        (term,) = pod["spec"]["affinity"]["podAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["topologyKey"] == rack
    # gang: podGroup (its PodGroup objects and their lifetime): tests/operator/test_pod_groups.py


# --------------------------------------------------------- the fast path's peers
def follower_pod(role: Role, ip: str, leader_ip: str) -> dict[str, Any]:
    pod = copy.deepcopy(build_worker_pod(make_cluster(TWO_POD), role, 0, 1, leader_ip))
    base = worker_pod(role, spec=TWO_POD, ip=ip)
    pod["metadata"].update(uid=f"uid-{role.value}-0-1", creationTimestamp="2026-01-01T00:00:00Z")
    pod["status"] = base["status"]
    return pod


def facts(raw: dict[str, Any]) -> PodFacts:
    pod = parse_pod_facts(raw)
    assert pod is not None
    return pod


def test_a_lost_non_leader_pod_is_named_by_its_leader_and_only_leaders_are_told() -> None:
    prefill_leader = facts(worker_pod(Role.prefill, spec=TWO_POD, ip="127.0.0.10"))
    prefill_other = facts(follower_pod(Role.prefill, "127.0.0.11", "127.0.0.10"))
    decode_leader = facts(worker_pod(Role.decode, spec=TWO_POD, ip="127.0.0.20"))
    decode_other = facts(follower_pod(Role.decode, "127.0.0.21", "127.0.0.20"))
    # Decode knows a prefill instance by its leader's bootstrap server; prefill
    # knows a decode instance by its leader's address.
    assert prefill_other.peer == prefill_leader.peer == "127.0.0.10:8998"
    assert decode_other.peer == "127.0.0.20"
    index = PodIndex()
    every = [prefill_leader, prefill_other, decode_leader, decode_other]
    for pod in every:
        index.update(pod)
    # Only a leader serves the admin API: it alone is told, polled and published to.
    assert [p.name for p in index.peers_of(prefill_other)] == [decode_leader.name]
    assert [p.name for p in index.peers_of(decode_other)] == [prefill_leader.name]
    reachable = {p.name for p in index.reachable(prefill_other.key)}
    assert reachable == {prefill_leader.name, decode_leader.name}
    assert compute_prefill_peers(every, UID) == {"127.0.0.10:8998"}
    assert [p.name for p in decode_targets(every, UID)] == [decode_leader.name]


# ---------------------------------------------------------------------- status
def test_status_lists_each_instance_with_its_pods() -> None:
    from pdcluster.operator.api import PDClusterStatus
    from pdcluster.operator.reconcile.status import compute_status

    sim = Sim(TWO_POD)
    for _ in range(4):
        sim.step()
        sim.store.make_all_ready()
    plan, _ = sim.step()
    hashes = {r.role: r.template_hash for r in sim.desired.roles}
    status = compute_status(
        sim.cluster, plan, hashes, sim.desired.revision, PDClusterStatus(), sim.now
    )
    assert status.prefill is not None
    (inst,) = status.prefill.instances
    assert inst.ready and inst.health == "ready" and inst.index == 0
    assert [(p.index, p.phase, p.ready) for p in inst.pods] == [
        (0, "Running", True),
        (1, "Running", True),
    ]
    assert [p.name for p in inst.pods] == [
        names.pod_name("demo", Role.prefill, 0, hashes[Role.prefill], k) for k in (0, 1)
    ]
    dumped = status.model_dump(by_alias=True, exclude_none=True)
    assert dumped["prefill"]["instances"][0]["templateHash"] == hashes[Role.prefill]
