"""compute_status: the PDCluster status from a plan; status_changed: whether to write it.

Conditions (each with a reason a user can act on):
- Ready: every role serves its desired instance count (any template — a
  rollout that keeps capacity does not flip Ready) and the router is up;
- Progressing: the cluster is moving towards the spec (creating, scaling,
  rolling, restarting); False with reason `Stable` at rest, or with
  `RestartBudgetExhausted` when it cannot move on by itself;
- Degraded: something is wrong: an instance broken or backing off, the
  restart budget spent, a foreign object in the way, the token Secret
  missing, PodGroups asked for but not served (`PodGroupUnavailable`), a
  write the apiserver refused (`ApplyFailed`), an invalid spec.

`status.<role>.instances[]` is the planner's view of each instance (its
gang health and why) and of its pods, each with the global ranks it runs
(`ranks: {first, last}`, read from the pod's own spec).

A condition keeps its lastTransitionTime while its status stays the same,
so computing the status of an unchanged cluster twice gives equal values
and nothing is written.

`status.<role>.autoscaling` belongs to the autoscaling loop
(`reconcile/autoscaling.py`), which writes it on its own interval:
`compute_status` carries the stored value over, and `status_changed` /
`status_patch` leave that field out, so a reconcile pass that read the
status before the loop's last write never puts an older decision back (a
merge patch keeps a nested key it does not name).

Pure module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.api import (
    MAX_STATUS_INSTANCES,
    Condition,
    ConditionType,
    InstancePodStatus,
    InstanceStatus,
    KVTransportStatus,
    PDClusterStatus,
    Phase,
    PodRanks,
    RoleStatus,
    RouterStatus,
    format_time,
)
from pdcluster.operator.reconcile.actions import Reason
from pdcluster.operator.reconcile.cluster import Cluster, ClusterRef
from pdcluster.operator.reconcile.instances import ObservedInstance
from pdcluster.operator.reconcile.plan import Plan
from pdcluster.operator.reconcile.restarts import ledger_status_fields
from pdcluster.operator.reconcile.rollout import RoleReport
from pdcluster.runtime.spec import Role

# The apiserver's message on a refused write can be long; the Event carries it whole.
MAX_CONDITION_MESSAGE = 512
STATUS_KEYS = frozenset(field.alias or name for name, field in PDClusterStatus.model_fields.items())


def _condition(
    prev: PDClusterStatus,
    kind: ConditionType,
    value: bool,
    reason: str,
    message: str,
    generation: int,
    now: float,
) -> Condition:
    status = "True" if value else "False"
    before = prev.condition(kind)
    since = (
        before.last_transition_time
        if before is not None and before.status == status
        else format_time(now)
    )
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def _summary(roles: Iterable[RoleReport], plan: Plan) -> str:
    parts = [f"{r.role.value} {r.ready}/{r.desired}" for r in roles]
    parts.append(f"router {plan.router_ready}/{plan.router_desired}")
    return ", ".join(parts) + " ready"


def _degraded(plan: Plan, failed_writes: Sequence[str]) -> tuple[bool, str, str]:
    exhausted = [r.role.value for r in plan.roles if r.budget_exhausted]
    restarting = [r for r in plan.roles if r.broken or r.waiting_backoff]
    if plan.token_secret_missing:
        return True, Reason.TokenSecretMissing, "the token Secret named in spec.auth is missing"
    if plan.pod_groups_unavailable is not None:
        return True, Reason.PodGroupUnavailable, plan.pod_groups_unavailable[:MAX_CONDITION_MESSAGE]
    if failed_writes:
        more = f" (and {len(failed_writes) - 1} more)" if len(failed_writes) > 1 else ""
        return True, Reason.ApplyFailed, f"{failed_writes[0][:MAX_CONDITION_MESSAGE]}{more}"
    if exhausted:
        return (
            True,
            Reason.RestartBudgetExhausted,
            f"restart budget spent for {', '.join(exhausted)}; broken instances stay down "
            "until the budget window closes",
        )
    if plan.foreign:
        shown = ", ".join(str(k) for k in plan.foreign[:3])
        more = f" and {len(plan.foreign) - 3} more" if len(plan.foreign) > 3 else ""
        return True, Reason.ForeignObject, f"objects not owned by this cluster: {shown}{more}"
    if restarting:
        detail = ", ".join(
            f"{r.role.value}: {r.broken} broken, {r.waiting_backoff} restarting" for r in restarting
        )
        return True, "InstanceRestarting", detail
    return False, "Healthy", "no broken instances"


def _progressing(plan: Plan) -> tuple[bool, str, str]:
    if any(r.budget_exhausted for r in plan.roles):
        return False, Reason.RestartBudgetExhausted, "waiting for the restart budget to refill"
    rolling = [r.role.value for r in plan.roles if r.rolling]
    if rolling:
        return True, "RollingUpdate", f"replacing instances of {', '.join(rolling)} one at a time"
    if any(r.broken or r.waiting_backoff for r in plan.roles):
        return True, "Restarting", "restarting failed instances"
    if all(r.existing == 0 for r in plan.roles) and any(r.desired for r in plan.roles):
        return True, "Creating", "creating the instances"
    if any(r.existing != r.desired for r in plan.roles):
        return True, "Scaling", "creating or removing instances"
    if any(r.updated != r.desired for r in plan.roles) or plan.router_ready != plan.router_desired:
        return True, "Starting", "waiting for pods to become Ready"
    return False, "Stable", "every instance runs the current spec"


def _pod_ranks(ranks: range | None) -> PodRanks | None:
    return PodRanks(first=ranks[0], last=ranks[-1]) if ranks else None


def _instance_status(inst: ObservedInstance) -> InstanceStatus:
    return InstanceStatus(
        index=inst.key.index,
        template_hash=inst.key.template_hash,
        ready=inst.is_serving,
        health=inst.health.value,
        message=inst.reason[:1024],
        pods=[
            InstancePodStatus(
                name=p.name, index=k, phase=p.phase, ready=p.ready, ranks=_pod_ranks(p.ranks)
            )
            for k, p in sorted(inst.pods.items())
        ],
    )


def _role_status(
    report: RoleReport,
    template_hash: str,
    kv_transport: KVTransportStatus | None,
    prev: RoleStatus | None,
) -> RoleStatus:
    ledger: dict[str, Any] = ledger_status_fields(report.ledger)
    return RoleStatus(
        kv_transport=kv_transport,
        autoscaling=prev.autoscaling if prev is not None else None,
        desired=report.desired,
        ready=report.ready,
        updated=report.updated,
        summary=f"{report.ready}/{report.desired}",
        template_hash=template_hash,
        instances=[_instance_status(i) for i in report.instances[:MAX_STATUS_INSTANCES]],
        **ledger,
    )


def compute_status(
    cluster: Cluster,
    plan: Plan,
    template_hashes: dict[Role, str],
    revision: str,
    prev: PDClusterStatus,
    now: float,
    failed_writes: Sequence[str] = (),
    kv_transports: Mapping[Role, KVTransportStatus] | None = None,
) -> PDClusterStatus:
    """`failed_writes`: what the apiserver refused in this pass ("create Pod/x: 403 ...");
    `kv_transports`: what each role's workers negotiated (`kv_transport.py`)."""
    generation = cluster.ref.generation
    all_ready = (
        all(r.ready >= r.desired for r in plan.roles)
        and plan.router_ready >= plan.router_desired
        and not plan.token_secret_missing
    )
    ready_reason = "AllReady" if all_ready else "InstancesNotReady"
    if not all_ready and all(r.ready >= r.desired for r in plan.roles):
        ready_reason = "RouterNotReady"
    degraded, degraded_reason, degraded_msg = _degraded(plan, failed_writes)
    progressing, progress_reason, progress_msg = _progressing(plan)
    conditions = [
        _condition(
            prev,
            ConditionType.Ready,
            all_ready,
            ready_reason,
            _summary(plan.roles, plan),
            generation,
            now,
        ),
        _condition(
            prev,
            ConditionType.Progressing,
            progressing,
            progress_reason,
            progress_msg,
            generation,
            now,
        ),
        _condition(
            prev, ConditionType.Degraded, degraded, degraded_reason, degraded_msg, generation, now
        ),
    ]
    if degraded:
        phase = Phase.Degraded
    elif all_ready and not progressing:
        phase = Phase.Ready
    elif any(r.ready for r in plan.roles):
        phase = Phase.Progressing
    else:
        phase = Phase.Pending
    transports = kv_transports or {}
    roles = {
        r.role: _role_status(
            r, template_hashes.get(r.role, ""), transports.get(r.role), prev.role(r.role.value)
        )
        for r in plan.roles
    }
    decode = plan.report(Role.decode)
    return PDClusterStatus(
        observed_generation=generation,
        phase=phase,
        revision=revision,
        conditions=conditions,
        prefill=roles.get(Role.prefill),
        decode=roles.get(Role.decode),
        colocated=roles.get(Role.colocated),
        router=RouterStatus(
            desired=plan.router_desired,
            ready=plan.router_ready,
            summary=f"{plan.router_ready}/{plan.router_desired}",
        ),
        replicas=decode.existing if decode is not None else 0,
        selector=names.format_selector(names.role_selector(cluster.name, Role.decode)),
    )


def compute_invalid_status(
    ref: ClusterRef,
    message: str,
    prev: PDClusterStatus,
    now: float,
    reason: Reason = Reason.InvalidSpec,
) -> PDClusterStatus:
    """The spec was rejected (`InvalidSpec`) or refused by the operator's policy
    (`ImageNotAllowed`, `SecretNotAllowed`): children are left as they are, so
    the per-role counts of the last good spec stay; the conditions say what is
    wrong."""
    degraded = _condition(prev, ConditionType.Degraded, True, reason, message, ref.generation, now)
    why = "the spec is invalid" if reason == Reason.InvalidSpec else "the spec is refused"
    progressing = _condition(
        prev,
        ConditionType.Progressing,
        False,
        reason,
        f"{why}; nothing is changed until it is fixed",
        ref.generation,
        now,
    )
    kept = [c for c in prev.conditions if c.type == ConditionType.Ready]
    return prev.model_copy(
        update={
            "observed_generation": ref.generation,
            "phase": Phase.Failed,
            "conditions": [*kept, progressing, degraded],
        }
    )


def status_changed(stored: Any, new: PDClusterStatus) -> bool:
    """True when `new` differs from the status stored on the object (raw dict).

    Fields of the stored status the model does not know (another writer's)
    are ignored: only what the operator owns decides whether to write.
    """
    if not isinstance(stored, dict):
        return True
    wire = _without_autoscaling(new.to_wire())
    if any(_without_role_autoscaling(k, stored.get(k)) != v for k, v in wire.items()):
        return True
    return any(stored.get(k) is not None for k in STATUS_KEYS - wire.keys())


def status_patch(new: PDClusterStatus) -> dict[str, Any]:
    """A merge patch body for the status subresource: our fields, and null for
    the ones this status leaves out (e.g. `colocated` after a switch to PD)."""
    wire: dict[str, Any] = _without_autoscaling(new.to_wire())
    for key in STATUS_KEYS - wire.keys():
        wire[key] = None
    return {"status": wire}


_ROLE_KEYS = frozenset(role.value for role in Role)


def _without_role_autoscaling(key: str, value: Any) -> Any:
    if key in _ROLE_KEYS and isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "autoscaling"}
    return value


def _without_autoscaling(wire: dict[str, Any]) -> dict[str, Any]:
    """The status less each role's `autoscaling` (the autoscaling loop's own field)."""
    return {k: _without_role_autoscaling(k, v) for k, v in wire.items()}
