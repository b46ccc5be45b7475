"""The gang rule of one multi-pod instance: keep it, restart it whole, wait, or give up.

An instance of N pods (runtime/pod_layout.py) lives and dies as one: its
ranks cannot go on without any of them. From the observed pods of one
instance, the clock, the role's restart policy and the restart ledger
(restarts.py), `decide_gang` returns one `GangDecision`. First match wins:

1. `wait`: a pod is being deleted — a teardown is under way;
2. no pod at all: `wait` until the ledger's back-off has passed
   (`not_before`), then `create` every pod;
3. a *fault*: a pod ended (crashed: Failed/Succeeded), is lost (phase
   Unknown, or missing while another pod of the gang passed its start), or
   is NotReady for `restart.notReadyGraceSeconds` after having passed its
   startup probe (at once when its status does not say since when). Then:
   - `wait` while some pod is still pending its first start (scheduling,
     image pull): a restart now would only recreate pods that pull again,
     so a slow pull never turns into a restart loop;
   - `give_up` when the hourly budget is spent (`not_before`: when it
     refills); the pods stay for inspection;
   - otherwise `restart`: delete **every** pod of the instance (`delete`),
     never only the faulty one; the caller records it in the ledger, whose
     back-off then delays the recreation (step 2);
4. pods missing from a gang that never formed (a create call failed
   half-way): `create` them;
5. `keep`; `not_before` is when a NotReady pod's grace ends, if one is.

A pod still starting (running, startup probe not passed) is no fault: its
startup probe ends it (restartPolicy Never: the pod turns Failed) if it
never starts.

The planner does not call `decide_gang`: it judges instances with
reconcile/instances.py (the same fault, pending-first-start and
never-formed rules, plus the leader-address ones) and leaves back-off and
budget to rollout.py and the restart ledger. What only this module has is
restarting on NotReady past `notReadyGraceSeconds`.

Times are epoch seconds. Pure module.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pdcluster.operator.reconcile.restarts import RestartLedger
from pdcluster.runtime.spec import RestartPolicySpec


class PodState(StrEnum):
    """One pod of a gang, as its status shows it (`pod_state_from_status`)."""

    pending_first_start = "pending_first_start"  # no container has run yet
    starting = "starting"  # running, startup probe not passed yet
    ready = "ready"
    not_ready = "not_ready"  # passed its startup probe, now not Ready
    ended = "ended"  # the container exited (restartPolicy Never): crashed
    lost = "lost"  # phase Unknown: its node stopped reporting
    terminating = "terminating"  # being deleted

    @property
    def has_started(self) -> bool:
        """Passed its startup probe at some point: the gang formed with it."""
        return self in (PodState.ready, PodState.not_ready, PodState.ended, PodState.lost)


@dataclass(frozen=True)
class GangPod:
    name: str
    state: PodState
    # not_ready: when the Ready condition last turned False (None: unknown,
    # which counts as past the grace).
    not_ready_since: float | None = None


class GangStep(StrEnum):
    keep = "keep"
    create = "create"  # create the pods in `create`
    restart = "restart"  # delete every pod in `delete`; record a restart
    wait = "wait"  # nothing now; look again at `not_before` (None: on the next pod event)
    give_up = "give_up"  # broken, but the restart budget is spent


@dataclass(frozen=True)
class GangDecision:
    step: GangStep
    reason: str
    delete: tuple[str, ...] = ()  # restart: the names of every pod of the instance
    create: tuple[int, ...] = ()  # create: pod indexes
    not_before: float | None = None
    faulty_pod: str | None = None  # the pod whose fault led here (Events name it)


@dataclass(frozen=True)
class _Fault:
    pod_index: int
    pod: str | None  # None: missing
    why: str


def _faults(
    size: int, pods: Mapping[int, GangPod], now: float, grace_s: float
) -> tuple[list[_Fault], float | None]:
    """The faults of the gang, and when the first NotReady grace still running ends."""
    faults: list[_Fault] = []
    grace_ends: list[float] = []
    is_formed = any(p.state.has_started for p in pods.values())
    for k in range(size):
        pod = pods.get(k)
        if pod is None:
            if is_formed:
                faults.append(_Fault(k, None, f"pod index {k} of a running gang is gone"))
            continue
        if pod.state is PodState.ended:
            faults.append(_Fault(k, pod.name, f"pod {pod.name} ended"))
        elif pod.state is PodState.lost:
            faults.append(_Fault(k, pod.name, f"pod {pod.name} is lost (node not reporting)"))
        elif pod.state is PodState.not_ready:
            since = pod.not_ready_since
            if since is None:
                # No transition time to count the grace from: a grace restarted on
                # every pass would never end, so the pod counts as faulty now.
                faults.append(_Fault(k, pod.name, f"pod {pod.name} not ready (since unknown)"))
            elif now - since >= grace_s:
                faults.append(
                    _Fault(k, pod.name, f"pod {pod.name} not ready for {now - since:.0f}s")
                )
            else:
                grace_ends.append(since + grace_s)
    return faults, min(grace_ends, default=None)


def decide_gang(
    size: int,
    pods: Mapping[int, GangPod],
    *,
    index: int,
    now: float,
    policy: RestartPolicySpec,
    ledger: RestartLedger,
) -> GangDecision:
    """The one step for instance `index` of `size` pods; `pods` by pod index."""
    if size < 1:
        raise ValueError(f"an instance has at least one pod, got size {size}")
    if outside := sorted(k for k in pods if not 0 <= k < size):
        raise ValueError(f"pod indexes {outside} are outside an instance of {size} pods")
    members = [pods[k] for k in sorted(pods)]
    if any(p.state is PodState.terminating for p in members):
        return GangDecision(GangStep.wait, "pods are being deleted")
    if not members:
        recreate_at = ledger.recreate_at(index, policy)
        if recreate_at is not None and now < recreate_at:
            return GangDecision(GangStep.wait, "restart back-off", not_before=recreate_at)
        return GangDecision(GangStep.create, "no pods", create=tuple(range(size)))

    faults, grace_end = _faults(size, pods, now, policy.not_ready_grace_seconds)
    if faults:
        first = faults[0]
        pending = [p.name for p in members if p.state is PodState.pending_first_start]
        if pending:
            return GangDecision(
                GangStep.wait,
                f"{first.why}, but pod {pending[0]} is still pending its first start",
                faulty_pod=first.pod,
            )
        if not ledger.can_restart(policy, now):
            return GangDecision(
                GangStep.give_up,
                f"{first.why}; the restart budget ({policy.budget}/hour) is spent",
                not_before=ledger.budget_reopens_at(now),
                faulty_pod=first.pod,
            )
        return GangDecision(
            GangStep.restart,
            first.why,
            delete=tuple(p.name for p in members),
            faulty_pod=first.pod,
        )
    missing = tuple(k for k in range(size) if k not in pods)
    if missing:
        return GangDecision(
            GangStep.create, f"{len(missing)} of {size} pods not created yet", create=missing
        )
    if all(p.state is PodState.ready for p in members):
        return GangDecision(GangStep.keep, "all pods ready")
    waiting = sum(p.state is not PodState.ready for p in members)
    return GangDecision(GangStep.keep, f"{waiting} of {size} pods not ready", not_before=grace_end)


def _time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment.timestamp()


def _mappings(value: Any) -> list[Mapping[str, Any]]:
    """The mappings in `value` when it is a list (what a status list holds); else none."""
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def pod_state_from_status(
    status: Mapping[str, Any], terminating: bool = False
) -> tuple[PodState, float | None]:
    """A pod's PodState (and, when not_ready, since when) from its `status`.

    `containerStatuses[].started` is true only once the startup probe passed,
    which is what separates a slow start from a pod that stopped being Ready.
    """
    if terminating:
        return PodState.terminating, None
    phase = status.get("phase")
    if phase in ("Failed", "Succeeded"):
        return PodState.ended, None
    if phase == "Unknown":
        return PodState.lost, None
    if phase != "Running":
        return PodState.pending_first_start, None
    containers = _mappings(status.get("containerStatuses"))
    if not containers or not all(c.get("started") is True for c in containers):
        return PodState.starting, None
    conditions = _mappings(status.get("conditions"))
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is not None and ready.get("status") == "True":
        return PodState.ready, None
    since = _time(ready.get("lastTransitionTime")) if ready is not None else None
    return PodState.not_ready, since
