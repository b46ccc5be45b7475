"""compute_status and status_changed: what `kubectl get pdc` shows, written only on change."""

from __future__ import annotations

from typing import Any

from pdcluster.operator.api import (
    ConditionType,
    PDClusterStatus,
    Phase,
    RoleStatus,
    parse_status,
)
from pdcluster.operator.reconcile.status import (
    compute_invalid_status,
    compute_status,
    status_changed,
    status_patch,
)
from pdcluster.runtime.spec import Role

from .helpers import AUTOSCALING_DECISION, PD, Sim


def status_of(sim: Sim, prev: PDClusterStatus | None = None) -> PDClusterStatus:
    plan, _ = sim.step()
    hashes = {r.role: r.template_hash for r in sim.desired.roles}
    return compute_status(
        sim.cluster, plan, hashes, sim.desired.revision, prev or PDClusterStatus(), sim.now
    )


def cond(status: PDClusterStatus, kind: ConditionType) -> tuple[str, str]:
    c = status.condition(kind)
    assert c is not None
    return c.status, c.reason


def test_new_cluster_is_pending_then_ready() -> None:
    sim = Sim(PD)
    first = status_of(sim)
    assert first.phase == Phase.Pending
    assert cond(first, ConditionType.Ready) == ("False", "InstancesNotReady")
    assert cond(first, ConditionType.Progressing) == ("True", "Creating")
    assert cond(first, ConditionType.Degraded) == ("False", "Healthy")
    assert first.prefill is not None and first.prefill.summary == "0/1"
    sim.store.make_all_ready()
    sim.now += 5
    ready = status_of(sim, first)
    assert ready.phase == Phase.Ready
    assert cond(ready, ConditionType.Ready) == ("True", "AllReady")
    assert cond(ready, ConditionType.Progressing) == ("False", "Stable")
    assert ready.prefill.summary == ready.decode.summary == ready.router.summary == "1/1"
    assert ready.observed_generation == 1
    assert ready.selector == "pdcluster.io/cluster=demo,pdcluster.io/role=decode"
    assert ready.replicas == 1


def test_transition_times_move_only_when_a_condition_flips() -> None:
    sim = Sim(PD)
    first = status_of(sim)
    sim.store.make_all_ready()
    sim.now += 5
    second = status_of(sim, first)
    degraded_before = first.condition(ConditionType.Degraded)
    degraded_after = second.condition(ConditionType.Degraded)
    assert degraded_before.last_transition_time == degraded_after.last_transition_time
    assert (
        first.condition(ConditionType.Ready).last_transition_time
        != second.condition(ConditionType.Ready).last_transition_time
    )


def test_unchanged_cluster_computes_an_equal_status_and_nothing_is_written() -> None:
    sim = Sim(PD)
    status_of(sim)
    sim.store.make_all_ready()
    settled = status_of(sim)
    stored: dict[str, Any] = settled.to_wire()
    sim.now += 60
    again = status_of(sim, parse_status(stored))
    assert again == parse_status(stored)
    assert not status_changed(stored, again)
    # Fields another writer added to the status do not force a write.
    assert not status_changed({**stored, "kopf": {"progress": {}}}, again)


def test_a_change_in_any_owned_field_is_written_and_removed_roles_are_nulled() -> None:
    sim = Sim({"colocated": {}})
    old = status_of(sim)
    stored = old.to_wire()
    sim.set_spec(PD)
    new = status_of(sim, old)
    assert status_changed(stored, new)
    patch = status_patch(new)["status"]
    assert patch["colocated"] is None and patch["prefill"]["desired"] == 1


def test_broken_instance_is_degraded_then_recovers() -> None:
    sim = Sim(PD)
    status_of(sim)
    sim.store.make_all_ready()
    ok = status_of(sim)
    (pod,) = sim.store.pods(role="decode")
    sim.store.set_pod(pod["metadata"]["name"], "Failed", False)
    degraded = status_of(sim, ok)
    assert degraded.phase == Phase.Degraded
    assert cond(degraded, ConditionType.Degraded) == ("True", "InstanceRestarting")
    assert degraded.decode.restarts == 1 and len(degraded.decode.backoff) == 1
    assert degraded.decode.summary == "0/1"
    sim.now += 2
    status_of(sim, degraded)  # recreated
    sim.store.make_all_ready()
    healed = status_of(sim, degraded)
    assert healed.phase == Phase.Ready
    assert healed.decode.restarts == 1 and healed.decode.backoff == []


def test_spent_budget_stops_progress_with_a_reason() -> None:
    sim = Sim({"prefill": {"restart": {"budget": 0}}, "decode": {}})
    status_of(sim)
    sim.store.make_all_ready()
    status_of(sim)
    (pod,) = sim.store.pods(role="prefill")
    sim.store.set_pod(pod["metadata"]["name"], "Failed", False)
    status = status_of(sim)
    assert cond(status, ConditionType.Degraded) == ("True", "RestartBudgetExhausted")
    assert cond(status, ConditionType.Progressing) == ("False", "RestartBudgetExhausted")


def test_rollout_keeps_ready_true_while_progressing() -> None:
    sim = Sim(PD)
    status_of(sim)
    sim.store.make_all_ready()
    status_of(sim)
    sim.set_spec({**PD, "image": "pdcluster:0.2.0"})
    rolling = status_of(sim)
    assert cond(rolling, ConditionType.Ready) == ("True", "AllReady")
    assert cond(rolling, ConditionType.Progressing) == ("True", "RollingUpdate")
    assert rolling.phase == Phase.Progressing


def test_foreign_object_and_missing_token_are_degraded_reasons() -> None:
    sim = Sim(PD)
    sim.store.foreign("Service", "demo-router")
    assert cond(status_of(sim), ConditionType.Degraded)[1] == "ForeignObject"
    sim = Sim({**PD, "auth": {"tokenSecretName": "absent"}})
    status = status_of(sim)
    assert cond(status, ConditionType.Degraded)[1] == "TokenSecretMissing"
    assert cond(status, ConditionType.Ready) == ("False", "InstancesNotReady")


def test_invalid_spec_keeps_counts_and_says_why() -> None:
    sim = Sim(PD)
    status_of(sim)
    sim.store.make_all_ready()
    good = status_of(sim)
    bad = compute_invalid_status(sim.cluster.ref, "decode.topology.cp must be 1", good, sim.now)
    assert bad.phase == Phase.Failed
    assert cond(bad, ConditionType.Degraded) == ("True", "InvalidSpec")
    assert bad.condition(ConditionType.Degraded).message == "decode.topology.cp must be 1"
    assert bad.decode == good.decode and bad.prefill == good.prefill
    assert cond(bad, ConditionType.Ready) == cond(good, ConditionType.Ready)


def test_unreadable_stored_status_counts_as_none() -> None:
    assert parse_status({"phase": "Exploded"}) == PDClusterStatus()
    assert parse_status("garbage") == PDClusterStatus()
    assert status_changed(None, PDClusterStatus())


def test_role_counts_follow_the_plan() -> None:
    sim = Sim({"prefill": {"replicas": 3}, "decode": {"replicas": 2}})
    status_of(sim)
    sim.store.make_all_ready()
    status = status_of(sim)
    assert status.role(Role.prefill.value).summary == "3/3"
    assert status.role(Role.decode.value).summary == "2/2"
    assert status.replicas == 2


def test_the_autoscaling_decision_is_carried_over_not_dropped() -> None:
    prev = PDClusterStatus(prefill=RoleStatus(desired=1, autoscaling=AUTOSCALING_DECISION))
    status = status_of(Sim(PD), prev)
    assert status.prefill is not None and status.prefill.autoscaling == AUTOSCALING_DECISION
    assert status.decode is not None and status.decode.autoscaling is None
