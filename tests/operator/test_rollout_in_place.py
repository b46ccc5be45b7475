"""Going away on purpose: drains through the leader, and rollouts that need no spare GPU.

The store keeps a deleted pod, terminating, until the test ends its drain,
as a kubelet does; a "full" cluster is one where a role's pods, terminating
ones included, can never exceed its replicas times its pods per instance
(a ResourceQuota that leaves no room for a surge pod).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.operator.reconcile.actions import Create, Delete
from pdcluster.operator.reconcile.instances import Health, group_instances
from pdcluster.runtime.spec import DRAIN_MARGIN_SECONDS, Role

from .helpers import Sim, observe_store
from .test_reconcile_plan import converge

TWO_POD_PREFILL = {"topology": {"tp": 2}, "gpusPerPod": 1}


def in_place(role: dict[str, Any], max_unavailable: int = 1) -> dict[str, Any]:
    return {**role, "rollout": {"maxSurge": 0, "maxUnavailable": max_unavailable}}


def graceful_sim(spec: dict[str, Any]) -> Sim:
    sim = Sim(spec)
    sim.store.graceful_pod_deletes = True
    converge(sim)
    return sim


def pods_of(sim: Sim, role: Role) -> list[dict[str, Any]]:
    return sim.store.pods(role=role.value)


def deleted_pods(plan: Any) -> list[str]:
    return [a.key.name for a in plan.actions if isinstance(a, Delete) and a.key.kind == "Pod"]


def is_leader(name: str) -> bool:
    return name.endswith("-0")


def ready_slots(sim: Sim, role: Role) -> int:
    observed = observe_store(sim.store, sim.cluster)
    instances = group_instances(
        (p for p in observed.pods if p.role == role), now=sim.now, not_ready_grace_s=30.0
    )
    return len({i.key.index for i in instances if i.health == Health.ready})


# ---------------------------------------------------------- drain through the leader
def test_scale_down_drains_the_leader_first_and_stops_its_followers_once_it_is_gone() -> None:
    sim = graceful_sim({"prefill": {**TWO_POD_PREFILL, "replicas": 2}, "decode": {}})
    sim.set_spec({"prefill": {**TWO_POD_PREFILL, "replicas": 1}, "decode": {}})
    plan, events = sim.step()
    (leader,) = deleted_pods(plan)
    assert is_leader(leader) and "-prefill-1-" in leader
    grace = next(a.grace_period_s for a in plan.actions if isinstance(a, Delete))
    # The announcement and the drain's budget, not Kubernetes' 30 s.
    assert grace == 1 + 300 + DRAIN_MARGIN_SECONDS
    assert [e.reason.value for e in events] == ["InstanceRemoved"]
    # While the leader drains, its follower keeps running, and nothing more happens.
    for _ in range(3):
        plan, events = sim.step()
        assert deleted_pods(plan) == [] and events == []
    assert len(pods_of(sim, Role.prefill)) == 4
    sim.store.end_terminating()
    plan, events = sim.step()
    (follower,) = deleted_pods(plan)
    assert follower == leader[:-1] + "1"
    assert events == []  # one InstanceRemoved for the whole drain
    sim.store.end_terminating()
    assert not sim.plan().writes
    assert len(pods_of(sim, Role.prefill)) == 2


def test_a_surge_rollout_retires_the_old_instance_leader_first() -> None:
    sim = graceful_sim({"prefill": TWO_POD_PREFILL, "decode": {}})
    sim.set_spec({"prefill": {**TWO_POD_PREFILL, "engine": {"chunkSize": 256}}, "decode": {}})
    deletions: list[list[str]] = []
    for _ in range(12):
        plan, _ = sim.step()
        deletions.append(deleted_pods(plan))
        sim.store.make_all_ready()
        sim.store.end_terminating()
    old = [names for names in deletions if names]
    assert len(old) == 2 and is_leader(old[0][0]) and not is_leader(old[1][0])
    assert ready_slots(sim, Role.prefill) == 1


def test_a_broken_gang_has_nothing_to_drain_and_goes_at_once() -> None:
    sim = graceful_sim({"prefill": TWO_POD_PREFILL, "decode": {}})
    follower = next(p for p in pods_of(sim, Role.prefill) if not is_leader(p["metadata"]["name"]))
    sim.store.set_pod(follower["metadata"]["name"], "Failed", False)
    plan, _ = sim.step()
    assert len(deleted_pods(plan)) == 2


# ------------------------------------------------------------------ in place
def full_cluster_rollout(
    sim: Sim, new_spec: dict[str, Any], drains: random.Random, passes: int = 80
) -> list[tuple[int, int]]:
    """Roll to `new_spec`, ending drains in random order; returns (ready, pods) of
    prefill after each pass, and checks the full cluster's rules on the way."""
    replicas = {r.role: r.replicas * r.pods_per_instance for r in sim.desired.roles}
    sim.set_spec(new_spec)
    target = {r.role: r.template_hash for r in sim.desired.roles}
    trace = []
    for _ in range(passes):
        plan, _ = sim.step()
        for role, most in replicas.items():
            # Never a pod beyond the quota, terminating ones included.
            assert len(pods_of(sim, role)) <= most, plan.actions
        for action in plan.actions:
            if isinstance(action, Create) and action.key.kind == "Pod":
                labels = action.manifest["metadata"]["labels"]
                assert (
                    labels["pdcluster.io/template-hash"]
                    == target[Role(labels["pdcluster.io/role"])]
                )
        trace.append((ready_slots(sim, Role.prefill), len(pods_of(sim, Role.prefill))))
        sim.store.make_all_ready()
        terminating = sim.store.terminating_pods()
        sim.store.end_terminating(t for t in terminating if drains.random() < 0.5)
        done = all(
            p["metadata"]["labels"]["pdcluster.io/template-hash"] == target[role]
            for role in target
            for p in pods_of(sim, role)
        )
        if done and ready_slots(sim, Role.prefill) == sim.desired.role(Role.prefill).replicas:
            return trace
    raise AssertionError(f"the rollout did not finish: {trace}")


@settings(max_examples=25, deadline=None)
@given(
    replicas=st.integers(1, 4),
    max_unavailable=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    two_pods=st.booleans(),
)
def test_an_in_place_rollout_never_needs_a_spare_instance_nor_drops_more_than_allowed(
    replicas: int, max_unavailable: int, seed: int, two_pods: bool
) -> None:
    layout = TWO_POD_PREFILL if two_pods else {}
    role = in_place({**layout, "replicas": replicas}, max_unavailable)
    decode = in_place({"replicas": 1})
    sim = graceful_sim({"prefill": role, "decode": decode})
    trace = full_cluster_rollout(
        sim,
        {"prefill": role, "decode": decode, "image": "pdcluster:0.2.0"},
        random.Random(seed),
    )
    # The rollout itself takes at most maxUnavailable slots out at a time.
    assert all(ready >= replicas - max_unavailable for ready, _ in trace)
    assert min(ready for ready, _ in trace) < replicas  # it did go in place


def test_in_place_waits_for_every_pod_of_the_old_instance_before_creating() -> None:
    sim = graceful_sim({"prefill": in_place(TWO_POD_PREFILL), "decode": {}})
    sim.set_spec(
        {"prefill": in_place({**TWO_POD_PREFILL, "engine": {"chunkSize": 256}}), "decode": {}}
    )
    plan, events = sim.step()
    (leader,) = deleted_pods(plan)
    assert is_leader(leader)
    assert "InstanceReplaced" in [e.reason.value for e in events]
    sim.store.end_terminating()
    plan, _ = sim.step()
    assert len(deleted_pods(plan)) == 1  # the follower, now that the leader is gone
    assert not any(isinstance(a, Create) and a.key.kind == "Pod" for a in plan.actions)
    plan, _ = sim.step()  # the follower still terminates: the slot stays empty
    assert not any(isinstance(a, Create) and a.key.kind == "Pod" for a in plan.actions)
    assert sim.plan().report(Role.prefill).rolling  # type: ignore[union-attr]
    sim.store.end_terminating()
    plan, _ = sim.step()
    created = [a.key.name for a in plan.actions if isinstance(a, Create) and a.key.kind == "Pod"]
    assert len(created) == 1 and is_leader(created[0])


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_default_rollout_stays_surge_first(replicas: int) -> None:
    sim = graceful_sim({"prefill": {"replicas": replicas}, "decode": {}})
    sim.set_spec({"prefill": {"replicas": replicas, "engine": {"chunkSize": 256}}, "decode": {}})
    plan, _ = sim.step()
    assert deleted_pods(plan) == []  # the old one serves until its replacement is Ready
    assert sum(isinstance(a, Create) and a.key.kind == "Pod" for a in plan.actions) == 1
