"""Multi-pod instances in the operator: the gang's health, the leader address its
pods are built with, whom the fast path tells, and what the status lists."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.operator import names
from pdcluster.operator.builders.meta import ObjectKey
from pdcluster.operator.builders.workers import InstanceKey, build_instance, build_worker_pod
from pdcluster.operator.failover.peers import PodIndex
from pdcluster.operator.failover.prefill_peers import compute_prefill_peers, decode_targets
from pdcluster.operator.reconcile.instances import Health, ObservedInstance, judge
from pdcluster.operator.reconcile.observed import (
    ObservedObject,
    ObservedPod,
    parse_object,
    parse_pod,
)
from pdcluster.operator.render import PLACEHOLDER_LEADER_ADDRESS, render_objects
from pdcluster.runtime.spec import Role

from .helpers import UID, Sim, make_cluster
from .podmaker import facts, worker_pod

TWO_POD = {
    "prefill": {"topology": {"tp": 2}, "gpusPerPod": 1, "restart": {"backoffSeconds": 1}},
    "decode": {"topology": {"tp": 2}, "gpusPerPod": 1},
}
LEADER_IP = "10.0.0.7"
KEY = InstanceKey(Role.prefill, 0, "abc123")
T10, T10_EPOCH = "2026-01-01T00:00:10Z", 1767225610.0


# ----------------------------------------------------------------- gang health
NOW = 1_000_000.0
GRACE = 30.0  # restart.notReadyGraceSeconds

# A pod as the planner sees it: (phase, ready, started, NotReady since).
STATES: dict[str, tuple[str, bool, bool, float | None]] = {
    "pending": ("Pending", False, False, None),
    "starting": ("Running", False, False, None),  # startup probe not passed
    "not_ready_in_grace": ("Running", False, True, NOW - GRACE + 5),  # passed it, now not Ready
    "not_ready_past_grace": ("Running", False, True, NOW - GRACE),
    "not_ready_since_unknown": ("Running", False, True, None),
    "ready": ("Running", True, True, None),
    "failed": ("Failed", False, False, None),
    "lost": ("Unknown", False, False, None),
}
NOT_READY_FAULTS = ("not_ready_past_grace", "not_ready_since_unknown")


def observed_pod(
    index: int,
    state: str,
    *,
    leader_address: str | None = LEADER_IP,
    terminating: bool = False,
    since: float | None = None,
    size: int = 2,
) -> ObservedPod:
    phase, ready, started, not_ready_since = STATES[state]
    name = f"demo-prefill-0-abc123-{index}"
    obj = ObservedObject(ObjectKey("Pod", name), f"uid-{index}", UID, {}, {}, terminating)
    return ObservedPod(
        obj=obj,
        role=Role.prefill,
        instance=0,
        pod_index=index,
        template_hash="abc123",
        instance_size=size,
        phase=phase,
        ready=ready,
        pod_ip=LEADER_IP if index == 0 and phase != "Pending" else None,
        started=started,
        leader_address=leader_address if index else None,
        not_ready_since=since if since is not None else not_ready_since,
    )


def judged(pods: dict[int, ObservedPod], size: int = 2, now: float = NOW) -> ObservedInstance:
    return judge(KEY, size, pods, now=now, not_ready_grace_s=GRACE)


def expected_health(leader: str | None, follower: str | None) -> tuple[Health, float | None]:
    """The gang rule (reconcile/instances.py), written out for a 2-pod instance:
    the health, and when to look again (a NotReady grace ending)."""
    present = [s for s in (leader, follower) if s is not None]
    pending = "pending" in present
    if any(s in ("failed", "lost") for s in present) or (leader is None and follower):
        return (Health.starting if pending else Health.broken), None
    assert leader is not None
    formed = STATES[leader][2] or STATES[leader][1]
    if follower is None and formed:
        return (Health.starting if pending else Health.broken), None
    if any(s in NOT_READY_FAULTS for s in present):
        return (Health.starting if pending else Health.broken), None
    recheck = NOW + 5 if "not_ready_in_grace" in present else None
    if follower is None:
        return Health.incomplete, recheck
    if leader == follower == "ready":
        return Health.ready, None
    return Health.starting, recheck


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
    inst = judged(pods)
    assert (inst.health, inst.recheck_at) == expected_health(leader, follower), inst.reason
    assert inst.is_serving == (leader == follower == "ready")


@pytest.mark.parametrize("state", [*STATES])
def test_a_one_pod_instance_follows_the_same_rule(state: str) -> None:
    inst = judged({0: observed_pod(0, state, size=1)}, size=1)
    expected = {
        "pending": Health.starting,
        "starting": Health.starting,
        "not_ready_in_grace": Health.starting,
        "ready": Health.ready,
    }.get(state, Health.broken)
    assert inst.health is expected, inst.reason
    assert inst.recheck_at == (NOW + 5 if state == "not_ready_in_grace" else None)


def test_not_ready_breaks_the_gang_only_once_the_grace_has_passed() -> None:
    since = NOW - 10
    pods = {0: observed_pod(0, "not_ready_in_grace", since=since), 1: observed_pod(1, "ready")}
    within = judged(pods)
    assert within.health is Health.starting and within.recheck_at == since + GRACE
    assert "restarted at 1970-01-12T13:47:00Z unless Ready again" in within.reason
    # The reason does not tick with the clock: an unchanged cluster writes no new status.
    assert judged(pods, now=NOW + 1).reason == within.reason
    just_before = judged(pods, now=since + GRACE - 0.001)
    assert just_before.health is Health.starting
    at_end = judged(pods, now=since + GRACE)
    assert at_end.health is Health.broken and at_end.recheck_at is None
    assert at_end.reason == (
        "pod demo-prefill-0-abc123-0 has been NotReady since 1970-01-12T13:46:30Z, "
        "past restart.notReadyGraceSeconds (30s)"
    )
    unknown = judged({0: observed_pod(0, "not_ready_since_unknown"), 1: observed_pod(1, "ready")})
    assert unknown.health is Health.broken and "does not say since when" in unknown.reason


def test_not_ready_past_the_grace_waits_for_a_pod_pending_its_first_start() -> None:
    pods = {0: observed_pod(0, "not_ready_past_grace"), 1: observed_pod(1, "pending")}
    inst = judged(pods)
    assert inst.health is Health.starting and inst.recheck_at is None
    assert "NotReady since" in inst.reason and "pending its first start" in inst.reason


def test_the_first_grace_to_end_is_when_to_look_again() -> None:
    pods = {
        0: observed_pod(0, "not_ready_in_grace", since=NOW - 3, size=3),
        1: observed_pod(1, "not_ready_in_grace", since=NOW - 20, size=3),
        2: observed_pod(2, "ready", size=3),
    }
    inst = judged(pods, size=3)
    assert inst.health is Health.starting and inst.recheck_at == NOW - 20 + GRACE


def test_a_terminating_member_makes_the_gang_wait_whatever_the_others_do() -> None:
    for state in STATES:
        pods = {0: observed_pod(0, state), 1: observed_pod(1, "ready", terminating=True)}
        assert judged(pods).health is Health.terminating


def test_a_pod_started_for_another_leader_breaks_the_gang() -> None:
    pods = {0: observed_pod(0, "starting"), 1: observed_pod(1, "ready", leader_address="10.9.9.9")}
    inst = judged(pods)
    assert inst.health is Health.broken
    assert "10.9.9.9" in inst.reason and LEADER_IP in inst.reason


def test_a_failed_pod_waits_for_a_pod_pending_its_first_start_before_restarting() -> None:
    inst = judged({0: observed_pod(0, "failed"), 1: observed_pod(1, "pending")})
    assert inst.health is Health.starting
    assert "pending its first start" in inst.reason


def test_an_instance_without_pods_is_incomplete() -> None:
    inst = judged({})
    assert (inst.health, inst.missing_pod_indexes, inst.recheck_at) == (
        Health.incomplete,
        (0, 1),
        None,
    )


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one pod, got size 0"):
        judged({}, size=0)
    with pytest.raises(ValueError, match=r"pod indexes \[2\] are outside an instance of 2 pods"):
        judged({k: observed_pod(k, "ready") for k in range(3)})
    with pytest.raises(ValueError, match="not_ready_grace_s must be >= 0, got -1"):
        judge(KEY, 2, {0: observed_pod(0, "ready")}, now=NOW, not_ready_grace_s=-1)


# A random gang: size, and per pod index either no pod or (state, NotReady since,
# terminating, started for a stale leader address).
gangs = st.integers(1, 5).flatmap(
    lambda size: st.tuples(
        st.just(size),
        st.dictionaries(
            st.integers(0, size - 1),
            st.tuples(
                st.sampled_from(list(STATES)),
                st.one_of(st.none(), st.floats(NOW - 3 * GRACE, NOW)),
                st.booleans(),
                st.booleans(),
            ),
        ),
    )
)


def random_gang(size: int, draws: dict[int, tuple[str, float | None, bool, bool]]) -> dict:
    pods = {}
    for k, (state, since, terminating, stale) in draws.items():
        pod = observed_pod(
            k,
            state,
            terminating=terminating and k == size - 1,  # rarely: one pod at most
            leader_address="10.9.9.9" if stale and k == 1 else LEADER_IP,
            size=size,
        )
        if STATES[state][2] and not STATES[state][1]:  # started, not Ready: its own since
            pod = dataclasses.replace(pod, not_ready_since=since)
        pods[k] = pod
    return pods


def hard_fault(pods: dict[int, ObservedPod], size: int) -> bool:
    """A fault that is not a NotReady one: ended, lost, leader gone, stale, missing."""
    leader = pods.get(0)
    if any(p.phase in ("Failed", "Succeeded", "Unknown") for p in pods.values()):
        return True
    if leader is None:
        return bool(pods)
    if any(p.leader_address not in (None, leader.pod_ip) for p in pods.values()):
        return leader.pod_ip is not None
    return len(pods) < size and (leader.started or leader.ready)


def not_ready_faults(pods: dict[int, ObservedPod], now: float) -> list[ObservedPod]:
    return [
        p
        for p in pods.values()
        if p.phase == "Running"
        and p.started
        and not p.ready
        and (p.not_ready_since is None or now - p.not_ready_since >= GRACE)
    ]


@settings(max_examples=300, deadline=None)
@given(gangs)
def test_the_gang_rule_holds_for_random_gangs(gang: tuple[int, dict]) -> None:
    size, draws = gang
    pods = random_gang(size, draws)
    if not pods:
        return
    inst = judged(pods, size=size)
    terminating = any(p.obj.terminating for p in pods.values())
    pending = any(p.phase == "Pending" for p in pods.values())
    # Never restarted while a pod is pending its first start (a slow pull never loops).
    if pending:
        assert inst.health is not Health.broken
    # Broken exactly when a fault is there and nothing holds the restart back.
    is_fault = hard_fault(pods, size) or bool(not_ready_faults(pods, NOW))
    if not terminating:
        assert (inst.health is Health.broken) == (is_fault and not pending), inst.reason
    # Serving needs every pod, each Ready, and no fault.
    assert inst.is_serving == (
        not (terminating or is_fault) and len(pods) == size and all(p.ready for p in pods.values())
    )
    # A grace still running is when to look again, and only while nothing is decided yet.
    if inst.recheck_at is not None:
        assert inst.health in (Health.starting, Health.incomplete)
        in_grace = [
            p.not_ready_since + GRACE
            for p in pods.values()
            if p.started and not p.ready and p.not_ready_since is not None
        ]
        assert inst.recheck_at == min(in_grace) and inst.recheck_at > NOW
        # Once it comes, the gang is broken (or still waits for a pod pending its first start).
        later = judged(pods, size=size, now=inst.recheck_at)
        assert later.health is (Health.starting if pending else Health.broken)


@settings(max_examples=200, deadline=None)
@given(gangs, st.floats(0, 10 * GRACE))
def test_time_only_moves_a_gang_towards_broken(gang: tuple[int, dict], later_s: float) -> None:
    size, draws = gang
    pods = random_gang(size, draws)
    if not pods:
        return
    before, after = judged(pods, size=size), judged(pods, size=size, now=NOW + later_s)
    if before.health is Health.broken:
        assert after.health is Health.broken
    if after.health is not Health.broken and after.health is not before.health:
        # Only one change is not towards broken: a grace ran out while a pod is still
        # pending its first start, which holds the restart back — the gang waits
        # (starting) instead of, say, creating its missing pods.
        assert after.health is Health.starting
        assert any(p.phase == "Pending" for p in pods.values())
        assert not_ready_faults(pods, NOW + later_s) and not not_ready_faults(pods, NOW)


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


def test_a_lost_non_leader_pod_is_named_precisely_and_only_leaders_are_told() -> None:
    prefill_leader = facts(worker_pod(Role.prefill, spec=TWO_POD, ip="127.0.0.10"))
    prefill_other = facts(follower_pod(Role.prefill, "127.0.0.11", "127.0.0.10"))
    decode_leader = facts(worker_pod(Role.decode, spec=TWO_POD, ip="127.0.0.20"))
    decode_other = facts(follower_pod(Role.decode, "127.0.0.21", "127.0.0.20"))
    # Decode knows a prefill instance by its leader's bootstrap server; prefill
    # knows a decode pod's ranks by that pod's own address (its leader's names
    # none of them: its ranks would never be forgotten).
    assert prefill_other.peer == prefill_leader.peer == "127.0.0.10:8998"
    assert decode_other.peer == "127.0.0.21"
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
    # tp=2, gpusPerPod=1: one rank per pod.
    assert [(p.ranks.first, p.ranks.last) for p in inst.pods if p.ranks] == [(0, 0), (1, 1)]
    assert [p.name for p in inst.pods] == [
        names.pod_name("demo", Role.prefill, 0, hashes[Role.prefill], k) for k in (0, 1)
    ]
    dumped = status.model_dump(by_alias=True, exclude_none=True)
    assert dumped["prefill"]["instances"][0]["templateHash"] == hashes[Role.prefill]
    assert dumped["prefill"]["instances"][0]["pods"][1]["ranks"] == {"first": 1, "last": 1}


@pytest.mark.parametrize(
    ("topology", "gpus_per_pod", "ranges"),
    [
        ({"tp": 2}, None, [(0, 1)]),  # gpusPerPod left out: one pod, every rank
        ({"tp": 4}, 2, [(0, 1), (2, 3)]),
        ({"tp": 16}, 8, [(0, 7), (8, 15)]),  # TP16 over two pods of 8
        ({"tp": 2, "pp": 2}, 1, [(0, 0), (1, 1), (2, 2), (3, 3)]),
    ],
)
def test_each_pod_reports_the_ranks_its_own_spec_runs(
    topology: dict[str, int], gpus_per_pod: int | None, ranges: list[tuple[int, int]]
) -> None:
    role: dict[str, Any] = {"topology": topology}
    if gpus_per_pod is not None:
        role["gpusPerPod"] = gpus_per_pod
    cluster = make_cluster({"prefill": role, "decode": {}})
    manifests = build_instance(cluster, Role.prefill, 0, LEADER_IP).pods
    parsed = [parse_observed(pod) for pod in manifests]
    # Read from the pod itself, so an instance of an older template shows its own layout.
    assert [(p.ranks[0], p.ranks[-1]) for p in parsed if p.ranks] == ranges


def parse_observed(manifest: dict[str, Any], status: dict[str, Any] | None = None) -> ObservedPod:
    raw = copy.deepcopy(manifest)
    raw["metadata"].update(uid="u-1", ownerReferences=[{"controller": True, "uid": UID}])
    raw["status"] = status or {}
    obj = parse_object(raw)
    assert obj is not None
    pod = parse_pod(obj, raw)
    assert pod is not None
    return pod


def test_a_pod_whose_env_does_not_state_its_ranks_shows_none() -> None:
    manifest = copy.deepcopy(build_worker_pod(make_cluster(TWO_POD), Role.prefill, 0, 0))
    env = manifest["spec"]["containers"][0]["env"]
    for bad in ("x", "-1", ""):
        for e in env:
            if e["name"] == names.ENV_FIRST_RANK:
                e["value"] = bad
        assert parse_observed(manifest).ranks is None
    manifest["spec"]["containers"] = "garbage"
    assert parse_observed(manifest).ranks is None


def _kubelet_status(
    phase: str, started: bool | None = None, ready: str | None = None, since: str | None = T10
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if started is not None:
        status["containerStatuses"] = [{"name": "worker", "started": started}]
    if ready is not None:
        condition = {"type": "Ready", "status": ready}
        if since is not None:
            condition["lastTransitionTime"] = since
        status["conditions"] = [condition]
    return status


@pytest.mark.parametrize(
    ("status", "started", "ready", "since"),
    [
        ({}, False, False, None),
        (_kubelet_status("Pending", started=False), False, False, None),
        (_kubelet_status("Running", started=False, ready="False"), False, False, T10_EPOCH),
        (_kubelet_status("Running", started=True, ready="True"), True, True, None),
        (_kubelet_status("Running", started=True, ready="False"), True, False, T10_EPOCH),
        (_kubelet_status("Running", started=True, ready="False", since=None), True, False, None),
        (_kubelet_status("Running", started=True, ready="False", since="soon"), True, False, None),
        # A time without a zone could be any moment: no grace counts from it.
        (
            _kubelet_status("Running", started=True, ready="False", since="2026-01-01T00:00:10"),
            True,
            False,
            None,
        ),
        (_kubelet_status("Running", started=True), True, False, None),
        (_kubelet_status("Failed", started=True), False, False, None),
        (_kubelet_status("Unknown", started=True, ready="True"), False, False, None),
    ],
)
def test_what_the_gang_rule_reads_from_a_pod_status(
    status: dict[str, Any], started: bool, ready: bool, since: float | None
) -> None:
    manifest = build_worker_pod(make_cluster(TWO_POD), Role.prefill, 0, 0)
    pod = parse_observed(manifest, status)
    assert (pod.started, pod.ready, pod.not_ready_since) == (started, ready, since)


# ------------------------------------------------------------ dp > 1 over pods
@pytest.mark.parametrize(
    ("topology", "gpus", "hosts"),
    [
        # dp2 tp1, one rank a pod: pod 1 hosts dp group 1.
        ({"dp": 2}, 1, {1: [1]}),
        # dp2 tp2 over two pods of 2: pod 1 hosts group 1.
        ({"dp": 2, "tp": 2}, 2, {1: [1]}),
        # dp2 tp2, one rank a pod: group 1 starts on pod 2; pods 1 and 3 host none.
        ({"dp": 2, "tp": 2}, 1, {1: [], 2: [1], 3: []}),
    ],
)
def test_dp_groups_over_pods_render_with_their_fixed_ports(
    topology: dict[str, int], gpus: int, hosts: dict[int, list[int]]
) -> None:
    spec = {"prefill": {"topology": topology, "gpusPerPod": gpus}, "decode": {}}
    cluster = make_cluster(spec)
    dp = topology["dp"]
    for pod_index, groups in hosts.items():
        pod = build_worker_pod(cluster, Role.prefill, 0, pod_index, LEADER_IP)
        container = pod["spec"]["containers"][0]
        args = container["args"]
        # The dp ports follow from --dist-port (each pod has its own network).
        assert "--dp-ports" not in args and "--dp-dist-ports" not in args
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        want = {}
        for d in groups:
            want[f"dist-dp{d}"] = 29500 + d
            want[f"http-dp{d}"] = 29500 + dp + d - 1
        assert {n: p for n, p in declared.items() if "-dp" in n} == want
    leader = build_worker_pod(cluster, Role.prefill, 0, 0)
    assert not [p for p in leader["spec"]["containers"][0]["ports"] if "-dp" in p["name"]]
