"""Plan one role: create, restart, roll and scale its instances.

Per instance slot i < replicas, with `cur` the instance at the current
template hash and `old` those at earlier hashes:
- no `cur`, no live `old`: create `cur` (after the slot's restart back-off);
- `cur` broken (a pod ended, was lost, went missing, or stayed NotReady past
  `restart.notReadyGraceSeconds`: the gang rule of instances.py): tear it
  down as a gang (budget permitting) and record the restart; it is
  recreated on a later pass once the back-off has passed;
- `cur` incomplete: create its missing pods (pods k > 0 once its leader
  has an IP, instances.py); `cur` terminating: wait;
- `cur` Ready: retire every `old` of the slot (a rollout step completes);
- `old` broken or incomplete: delete it (an outdated gang is never
  restarted); its slot is then recreated at the current template at once.

Rollout keeps capacity (`rollout.maxSurge` > 0, the default): a slot whose
`old` still serves gets its `cur` only while fewer than maxSurge such
replacements are in flight, and the `old` goes only after `cur` is Ready.
In place (`rollout.maxUnavailable` > 0, for a cluster with no spare GPU):
while fewer than maxUnavailable slots are unavailable, a slot whose `old`
still serves has it drained and removed first; the slot waits until every
pod of it is gone (its GPUs and quota free again), then gets its `cur`.
Slots >= replicas are deleted (scale down).

Going away on purpose drains through the leader (`_retire_instance`): a
scale-down, a retired `old` and an in-place replacement delete the
instance's leader pod first (it stops taking requests and finishes those in
flight, up to the role's drain budget), and its other pods only once the
leader is gone, so no collective of an in-flight request loses a rank. A
broken instance (gang restart, an outdated gang that broke) has nothing to
drain: every pod goes at once.

`decide_slot` makes the decision above for one slot from its instances and
the restart ledger's answers (a `SlotDecision`); `plan_role` turns each
decision into actions, then counts the decisions into the role's report and
spends the surge.

Rollout keeps pairs: prefill and decode exchange KV only within one cluster
revision (the router pairs by the `pdcluster.io/revision` label). When the
revision changes, a Ready `old` of another revision is retired only once
the new revision can serve on its own (`retire_other_revisions`, decided by
the planner across roles); until then both revisions keep a full pair.

Invariants (tested): no action touches an object another owner holds; a
surge plan never deletes the last serving instance of a slot whose
replacement is not Ready; an in-place plan never has more than
maxUnavailable slots unavailable through its own deletions, and never
creates into a slot whose old pods still exist; a pod k > 0 of a serving
instance is never deleted before its leader is gone; a broken instance is
torn down at most once per restart.

Pure module.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from pdcluster.operator.builders.desired import DesiredRole, DesiredState
from pdcluster.operator.builders.meta import ObjectKey, object_key
from pdcluster.operator.names import LABEL_REVISION
from pdcluster.operator.reconcile.actions import Action, Create, Delete, Emit, EventType, Reason
from pdcluster.operator.reconcile.instances import Health, ObservedInstance, group_instances
from pdcluster.operator.reconcile.observed import Observed
from pdcluster.operator.reconcile.restarts import RestartLedger
from pdcluster.runtime.pod_layout import LEADER_POD
from pdcluster.runtime.spec import RestartPolicySpec, Role


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
    instances: tuple[ObservedInstance, ...] = ()  # as observed, before this plan's actions


@dataclass
class RolePlan:
    actions: list[Action] = field(default_factory=list)
    foreign: list[ObjectKey] = field(default_factory=list)
    wake_at: list[float] = field(default_factory=list)
    instances: list[ObservedInstance] = field(default_factory=list)


def _delete_instance(plan: RolePlan, inst: ObservedInstance, grace_s: int | None = None) -> None:
    """Every pod of `inst` at once: nothing to drain (a broken gang, a stale one)."""
    for k in sorted(inst.pods):
        pod = inst.pods[k]
        if not pod.obj.terminating:
            plan.actions.append(Delete(pod.obj.key, pod.obj.uid, grace_s))


def _has_live_leader(inst: ObservedInstance) -> bool:
    leader = inst.pods.get(LEADER_POD)
    return leader is not None and not leader.obj.terminating


def _retire_instance(plan: RolePlan, inst: ObservedInstance, grace_s: int | None) -> None:
    """Drain `inst` through its leader: delete the leader (with the drain's grace)
    and nothing else while it exists; once it is gone, the other pods."""
    leader = inst.pods.get(LEADER_POD)
    if leader is None:
        _delete_instance(plan, inst)
    elif not leader.obj.terminating:
        plan.actions.append(Delete(leader.obj.key, leader.obj.uid, grace_s))


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
    current: ObservedInstance | None,
) -> int:
    """Create the missing pods of slot `index` (`current`: its instance at the
    current template, None: none yet), and its bootstrap Service if missing;
    returns how many pods were planned.

    Pods k > 0 need the leader's IP: with no instance yet only the leader is
    created, and the others on a later pass (the leader's status update
    brings one), once `current.leader_address` is known.

    With `gang: podGroup` the instance's PodGroup comes first when missing (the
    executor creates in order, so it exists before any pod names it); one that
    another owner holds blocks the pods, which would join its gang.
    """
    leader_address = current.leader_address if current is not None else None
    manifests = desired.instance(role.role, index, leader_address)
    present = current.pods if current is not None else {}
    members = [m for k, m in enumerate(manifests.pods) if k not in present]
    if manifests.bootstrap_service is not None:
        members.append(manifests.bootstrap_service)
    if manifests.pod_group is not None:
        group = observed.get(object_key(manifests.pod_group))
        if group is not None and not group.is_owned_by(desired.cluster.ref.uid):
            plan.foreign.append(group.key)
            return 0
        if members:
            members.insert(0, manifests.pod_group)
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


def serves_revision(
    observed: Observed, role: Role, revision: str, *, now: float, not_ready_grace_s: float
) -> bool:
    """Whether some Ready instance of `role` runs `revision`."""
    instances = group_instances(
        (p for p in observed.pods if p.role == role), now=now, not_ready_grace_s=not_ready_grace_s
    )
    return any(inst.is_serving and instance_revision(inst) == revision for inst in instances)


class SlotStep(StrEnum):
    """What one slot < replicas does this pass (the module docstring's cases)."""

    create = "create"  # empty: create the instance at the current template
    backoff = "backoff"  # no current instance: its restart back-off still runs
    surge = "surge"  # an outdated instance serves: replace it (surge, or in place)
    vacate = "vacate"  # in place: the outdated instance's pods are still going away
    complete = "complete"  # the current instance is Ready: retire the outdated ones
    fill = "fill"  # the current instance lacks pods: create them
    start = "start"  # the current instance is starting: wait
    terminating = "terminating"  # the current instance is going away: wait
    restart = "restart"  # the current instance is broken: tear it down as a gang
    budget_spent = "budget_spent"  # broken, but the restart budget is spent: keep it


@dataclass(frozen=True)
class SlotDecision:
    """One slot's step, and what the role's counts and actions need from it."""

    step: SlotStep
    current: ObservedInstance | None  # the instance at the current template
    drop: tuple[ObservedInstance, ...] = ()  # outdated and broken or incomplete: deleted now
    retire: tuple[ObservedInstance, ...] = ()  # outdated, replaced by a Ready current one
    num_held: int = 0  # outdated of another revision, kept until that revision can go
    is_ready: bool = False  # served by a Ready instance of any template
    is_existing: bool = False  # has a live instance of any template
    holds_surge: bool = False  # a replacement in flight: counts against maxSurge
    not_before: float | None = None  # `backoff`: when the slot may be recreated
    outdated: tuple[ObservedInstance, ...] = ()  # `surge`: the serving instances to replace


def decide_slot(
    slot: Sequence[ObservedInstance],
    *,
    target: str,
    now: float,
    recreate_at: float | None,
    can_restart: bool,
    revision: str,
    retire_other_revisions: bool = True,
    in_place: bool = False,
) -> SlotDecision:
    """Decide one slot from its instances alone. `recreate_at` and `can_restart`
    are the restart ledger's answers for this slot (back-off end, budget left);
    `in_place`: the role rolls with no surge, so a slot is created only once no
    pod of an outdated instance is left in it."""
    cur = next((i for i in slot if i.key.template_hash == target), None)
    outdated = [i for i in slot if i.key.template_hash != target]
    live_olds = [i for i in outdated if i.is_alive]
    retire: tuple[ObservedInstance, ...] = ()
    num_held = 0
    not_before: float | None = None
    if cur is None:
        if recreate_at is not None and now < recreate_at:
            step, not_before = SlotStep.backoff, recreate_at
        elif live_olds:
            step = SlotStep.surge
        elif in_place and outdated:
            step = SlotStep.vacate
        else:
            step = SlotStep.create
    elif cur.health == Health.ready:
        step = SlotStep.complete
        # An outdated instance of another revision stays while its revision's
        # pair still serves and the new revision cannot yet serve alone.
        is_held = [
            not retire_other_revisions and instance_revision(old) != revision for old in live_olds
        ]
        retire = tuple(old for old, held in zip(live_olds, is_held, strict=True) if not held)
        num_held = sum(is_held)
    elif cur.health == Health.broken:
        step = SlotStep.restart if can_restart else SlotStep.budget_spent
    else:
        step = _WAIT_STEPS[cur.health]
    # A replacement that is starting, failing or backing off holds a surge slot.
    is_replacing = bool(live_olds) and (cur is None or cur.health != Health.ready)
    return SlotDecision(
        step,
        cur,
        drop=tuple(i for i in outdated if i.health in (Health.broken, Health.incomplete)),
        retire=retire,
        num_held=num_held,
        is_ready=any(i.is_serving for i in slot),
        is_existing=cur is not None or bool(live_olds),
        holds_surge=is_replacing and step != SlotStep.surge,
        not_before=not_before,
        outdated=tuple(live_olds) if step == SlotStep.surge else (),
    )


_WAIT_STEPS = {
    Health.incomplete: SlotStep.fill,
    Health.starting: SlotStep.start,
    Health.terminating: SlotStep.terminating,
}


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
        now=now,
        not_ready_grace_s=role.restart.not_ready_grace_seconds,
        sizes_by_template={target: role.pods_per_instance},
    )
    # A NotReady grace that ends later turns its instance broken then: look again.
    plan.wake_at.extend(i.recheck_at for i in plan.instances if i.recheck_at is not None)
    by_slot: dict[int, list[ObservedInstance]] = defaultdict(list)
    for inst in plan.instances:
        by_slot[inst.key.index].append(inst)

    for index in sorted(i for i in by_slot if i >= role.replicas):
        if any(inst.health != Health.terminating for inst in by_slot[index]):
            for inst in by_slot[index]:
                _retire_instance(plan, inst, role.grace_period_s)
        if any(_has_live_leader(inst) for inst in by_slot[index]):
            _event(
                plan,
                EventType.Normal,
                Reason.InstanceRemoved,
                f"{role.role.value} instance {index} removed (replicas={role.replicas})",
            )
    ledger = ledger.forget_from(role.replicas)

    # Decide slot by slot (the ledger a slot sees includes earlier slots' restarts), then count.
    decisions: list[SlotDecision] = []
    for index in range(role.replicas):
        decided = decide_slot(
            by_slot.get(index, []),
            target=target,
            now=now,
            recreate_at=ledger.recreate_at(index, role.restart),
            can_restart=ledger.can_restart(role.restart, now),
            revision=desired.revision,
            retire_other_revisions=retire_other_revisions,
            in_place=role.rollout.is_in_place,
        )
        ledger = _act_on_slot(plan, desired, observed, role, index, decided, ledger, now)
        decisions.append(decided)

    # Replace slots still served by an outdated instance: beside it while the
    # surge allows, then in place while the unavailability allows.
    surge_candidates = [i for i, d in enumerate(decisions) if d.step == SlotStep.surge]
    in_flight = sum(d.holds_surge for d in decisions)
    num_surged = max(0, role.rollout.max_surge - in_flight)
    for index in surge_candidates[:num_surged]:
        _create_instance(plan, desired, observed, role, index)
    unavailable = sum(not d.is_ready for d in decisions)
    num_drained = max(0, role.rollout.max_unavailable - unavailable)
    for index in surge_candidates[num_surged:][:num_drained]:
        for old in decisions[index].outdated:
            _retire_instance(plan, old, role.grace_period_s)
        _event(
            plan,
            EventType.Normal,
            Reason.InstanceReplaced,
            f"{role.role.value} instance {index} drains to be replaced in place by template "
            f"{role.template_hash} (rollout.maxUnavailable={role.rollout.max_unavailable})",
        )

    steps = [d.step for d in decisions]
    retired = sum(len(d.retire) for d in decisions)
    held = sum(d.num_held for d in decisions)
    report = RoleReport(
        role=role.role,
        desired=role.replicas,
        ready=sum(d.is_ready for d in decisions),
        updated=steps.count(SlotStep.complete),
        existing=sum(d.is_existing for d in decisions),
        broken=steps.count(SlotStep.restart) + steps.count(SlotStep.budget_spent),
        waiting_backoff=steps.count(SlotStep.backoff)
        + steps.count(SlotStep.terminating)
        + steps.count(SlotStep.vacate),
        budget_exhausted=SlotStep.budget_spent in steps,
        rolling=bool(surge_candidates)
        or SlotStep.vacate in steps
        or in_flight > 0
        or retired > 0
        or held > 0,
        ledger=ledger,
        instances=tuple(plan.instances),
    )
    return plan, report


def _act_on_slot(
    plan: RolePlan,
    desired: DesiredState,
    observed: Observed,
    role: DesiredRole,
    index: int,
    decided: SlotDecision,
    ledger: RestartLedger,
    now: float,
) -> RestartLedger:
    """Append slot `index`'s actions to the plan; returns the ledger after them."""
    for old in decided.drop:
        _delete_instance(plan, old)
    cur = decided.current
    step = decided.step
    if step == SlotStep.backoff:
        assert decided.not_before is not None
        plan.wake_at.append(decided.not_before)
    elif step == SlotStep.create:
        _create_instance(plan, desired, observed, role, index)
    elif step == SlotStep.complete:
        ledger = ledger.mark_ready(index)
        for old in decided.retire:
            _retire_instance(plan, old, role.grace_period_s)
            _event(
                plan,
                EventType.Normal,
                Reason.InstanceReplaced,
                f"{role.role.value} instance {index} now runs template {role.template_hash}; "
                f"retired template {old.key.template_hash}",
            )
    elif step == SlotStep.fill:
        assert cur is not None
        _create_members(plan, desired, observed, role, index, cur)
    elif step == SlotStep.budget_spent:
        assert cur is not None
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
    elif step == SlotStep.restart:
        assert cur is not None
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
    return ledger


def plan_absent_role(role: Role, observed: Observed, now: float) -> RolePlan:
    """A role the spec no longer has (e.g. colocated -> disaggregated): remove it all."""
    plan = RolePlan()
    # Every instance goes whatever its health: the default grace only labels them.
    plan.instances = group_instances(
        (p for p in observed.pods if p.role == role),
        now=now,
        not_ready_grace_s=RestartPolicySpec().not_ready_grace_seconds,
    )
    for inst in plan.instances:
        _delete_instance(plan, inst)
    return plan
