"""Plan one role: create, restart, roll and scale its instances.

Per instance slot i < replicas, with `cur` the instance at the current
template hash and `old` those at earlier hashes:
- no `cur`, no live `old`: create `cur` (after the slot's restart back-off);
- `cur` broken: tear it down as a gang (budget permitting) and record the
  restart; it is recreated on a later pass once the back-off has passed;
- `cur` incomplete: create its missing pods; `cur` terminating: wait;
- `cur` Ready: retire every `old` of the slot (a rollout step completes);
- `old` broken or incomplete: delete it (an outdated gang is never
  restarted); its slot is then recreated at the current template at once.

Rollout keeps capacity: a slot whose `old` still serves gets its `cur` only
while fewer than MAX_SURGE such replacements are in flight, and the `old`
goes only after `cur` is Ready. Slots >= replicas are deleted (scale down).

Rollout keeps pairs: prefill and decode exchange KV only within one cluster
revision (the router pairs by the `pdcluster.io/revision` label). When the
revision changes, a Ready `old` of another revision is retired only once
the new revision can serve on its own (`retire_other_revisions`, decided by
the planner across roles); until then both revisions keep a full pair.

Invariants (tested): no action touches an object another owner holds; a
plan never deletes the last serving instance of a slot whose replacement
is not Ready; a broken instance is torn down at most once per restart.

Pure module.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from pdcluster.operator.actions import Action, Create, Delete, Emit, EventType, Reason
from pdcluster.operator.builders.desired import DesiredRole, DesiredState
from pdcluster.operator.builders.meta import ObjectKey
from pdcluster.operator.instances import Health, ObservedInstance, group_instances
from pdcluster.operator.names import LABEL_REVISION
from pdcluster.operator.observed import Observed
from pdcluster.operator.restarts import RestartLedger
from pdcluster.runtime.spec import Role

MAX_SURGE = 1


@dataclass(frozen=True)
class RoleReport:
    """What the status needs to know about one role after planning."""

    role: Role
    desired: int
    ready: int  # slots < desired served by a Ready instance of any template
    updated: int  # slots < desired served by a Ready instance of the current template
    existing: int  # slots < desired with a live instance of any template
    broken: int  # current-template instances found broken
    waiting_backoff: int  # slots waiting for a restart back-off or a teardown to finish
    budget_exhausted: bool
    rolling: bool  # outdated instances remain
    ledger: RestartLedger


@dataclass
class RolePlan:
    actions: list[Action] = field(default_factory=list)
    foreign: list[ObjectKey] = field(default_factory=list)
    wake_at: list[float] = field(default_factory=list)
    instances: list[ObservedInstance] = field(default_factory=list)


def _delete_instance(plan: RolePlan, inst: ObservedInstance) -> None:
    for k in sorted(inst.pods):
        pod = inst.pods[k]
        if not pod.obj.terminating:
            plan.actions.append(Delete(pod.obj.key, pod.obj.uid))


def _event(
    plan: RolePlan, kind: EventType, reason: Reason, message: str, role: Role | None = None
) -> None:
    plan.actions.append(Emit(kind, reason, message, role.value if role else None))


def _create_members(
    plan: RolePlan,
    desired: DesiredState,
    observed: Observed,
    role: DesiredRole,
    index: int,
    pod_indexes: tuple[int, ...] | None,
) -> int:
    """Create the given pods (None: all) of slot `index`, and its bootstrap Service
    if missing; returns how many pods were planned."""
    manifests = desired.instance(role.role, index)
    wanted = range(len(manifests.pods)) if pod_indexes is None else pod_indexes
    members = [manifests.pods[k] for k in wanted]
    if manifests.bootstrap_service is not None:
        members.append(manifests.bootstrap_service)
    num_pods = 0
    for manifest in members:
        key = ObjectKey(manifest["kind"], manifest["metadata"]["name"])
        found = observed.get(key)
        if found is None:
            plan.actions.append(Create(manifest))
            num_pods += key.kind == "Pod"
        elif not found.is_owned_by(desired.cluster.ref.uid):
            plan.foreign.append(key)
    return num_pods


def _create_instance(
    plan: RolePlan, desired: DesiredState, observed: Observed, role: DesiredRole, index: int
) -> None:
    if _create_members(plan, desired, observed, role, index, None):
        _event(
            plan,
            EventType.Normal,
            Reason.InstanceCreated,
            f"{role.role.value} instance {index} created at template {role.template_hash} "
            f"({role.pods_per_instance} pods)",
        )


def instance_revision(inst: ObservedInstance) -> str | None:
    """The cluster revision an instance's pods were built for (None: unlabelled)."""
    for pod in inst.pods.values():
        revision = pod.obj.labels.get(LABEL_REVISION)
        if revision:
            return revision
    return None


def serves_revision(observed: Observed, role: Role, revision: str) -> bool:
    """Whether some Ready instance of `role` runs `revision`."""
    return any(
        inst.is_serving and instance_revision(inst) == revision
        for inst in group_instances(p for p in observed.pods if p.role == role)
    )


def plan_role(
    desired: DesiredState,
    role: DesiredRole,
    observed: Observed,
    ledger: RestartLedger,
    now: float,
    retire_other_revisions: bool = True,
) -> tuple[RolePlan, RoleReport]:
    plan = RolePlan()
    target = role.template_hash
    plan.instances = group_instances(
        (p for p in observed.pods if p.role == role.role),
        sizes_by_template={target: role.pods_per_instance},
    )
    by_slot: dict[int, list[ObservedInstance]] = defaultdict(list)
    for inst in plan.instances:
        by_slot[inst.key.index].append(inst)

    for index in sorted(i for i in by_slot if i >= role.replicas):
        if any(inst.health != Health.terminating for inst in by_slot[index]):
            for inst in by_slot[index]:
                _delete_instance(plan, inst)
            _event(
                plan,
                EventType.Normal,
                Reason.InstanceRemoved,
                f"{role.role.value} instance {index} removed (replicas={role.replicas})",
            )
    ledger = ledger.forget_from(role.replicas)

    ready = updated = existing = broken = waiting = 0
    budget_exhausted = False
    surge_candidates: list[int] = []
    in_flight = retired = held = 0
    for index in range(role.replicas):
        slot = by_slot.get(index, [])
        cur = next((i for i in slot if i.key.template_hash == target), None)
        live_olds: list[ObservedInstance] = []
        for old in (i for i in slot if i.key.template_hash != target):
            if old.health in (Health.broken, Health.incomplete):
                _delete_instance(plan, old)
            elif old.is_alive:
                live_olds.append(old)
        ready += any(i.is_serving for i in slot)
        existing += cur is not None or bool(live_olds)

        # A replacement that is starting, failing or backing off holds a surge slot.
        replacing = bool(live_olds) and (cur is None or cur.health != Health.ready)
        if cur is None:
            not_before = ledger.recreate_at(index, role.restart)
            if not_before is not None and now < not_before:
                waiting += 1
                in_flight += replacing
                plan.wake_at.append(not_before)
            elif live_olds:
                surge_candidates.append(index)
            else:
                _create_instance(plan, desired, observed, role, index)
            continue
        in_flight += replacing
        if cur.health == Health.ready:
            updated += 1
            ledger = ledger.mark_ready(index)
            for old in live_olds:
                if not retire_other_revisions and instance_revision(old) != desired.revision:
                    held += 1  # its revision's pair still serves; the new one cannot yet
                    continue
                retired += 1
                _delete_instance(plan, old)
                _event(
                    plan,
                    EventType.Normal,
                    Reason.InstanceReplaced,
                    f"{role.role.value} instance {index} now runs template {target}; "
                    f"retired template {old.key.template_hash}",
                )
        elif cur.health == Health.incomplete:
            _create_members(plan, desired, observed, role, index, cur.missing_pod_indexes)
        elif cur.health == Health.starting:
            pass
        elif cur.health == Health.terminating:
            waiting += 1
        else:  # broken
            broken += 1
            if not ledger.can_restart(role.restart, now):
                budget_exhausted = True
                reopen = ledger.budget_reopens_at(now)
                if reopen is not None:
                    plan.wake_at.append(reopen)
                _event(
                    plan,
                    EventType.Warning,
                    Reason.RestartBudgetExhausted,
                    f"{role.role.value} instance {index} is broken ({cur.reason}) but the "
                    f"restart budget ({role.restart.budget}/hour) is spent",
                )
                continue
            _delete_instance(plan, cur)
            ledger = ledger.record(index, now)
            retry_at = ledger.recreate_at(index, role.restart) or now
            plan.wake_at.append(retry_at)
            _event(
                plan,
                EventType.Warning,
                Reason.InstanceRestarted,
                f"{role.role.value} instance {index} restarted as a gang: {cur.reason}; "
                f"recreating in {max(0.0, retry_at - now):.0f}s",
                role.role,
            )

    # Start replacements for slots still served by an outdated instance.
    for index in surge_candidates[: max(0, MAX_SURGE - in_flight)]:
        _create_instance(plan, desired, observed, role, index)

    report = RoleReport(
        role=role.role,
        desired=role.replicas,
        ready=ready,
        updated=updated,
        existing=existing,
        broken=broken,
        waiting_backoff=waiting,
        budget_exhausted=budget_exhausted,
        rolling=bool(surge_candidates) or in_flight > 0 or retired > 0 or held > 0,
        ledger=ledger,
    )
    return plan, report


def plan_absent_role(role: Role, observed: Observed) -> RolePlan:
    """A role the spec no longer has (e.g. colocated -> disaggregated): remove it all."""
    plan = RolePlan()
    plan.instances = group_instances(p for p in observed.pods if p.role == role)
    for inst in plan.instances:
        _delete_instance(plan, inst)
    return plan
