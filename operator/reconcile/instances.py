"""Group worker pods into instances and judge each instance as a gang.

An instance is a gang of `size` pods (one pod is a gang of one: the same
rules hold); pod 0 is the leader, and pods k > 0 are created only once the
leader has an IP, which they are given (builders/workers.py). Health of one
instance (role, index, template hash) at time `now`, first match wins:
- `terminating`: a member is being deleted — wait until all are gone before
  the same names can be created again;
- `broken` (a fault): a member ended (Failed/Succeeded: a rank died) or is
  lost (phase Unknown); the leader is missing while other pods exist (they
  cannot join a new leader); a pod k > 0 was started for another leader
  address than the leader's; a member is missing from a formed gang (the
  leader passed its startup probe or is Ready: its ranks cannot go on
  without the missing ones); or a member passed its startup probe and has
  been NotReady for the role's `restart.notReadyGraceSeconds` (at once when
  its Ready condition does not say since when: a grace counted from each
  pass would never end). The whole instance is then restarted (rollout.py,
  with the restart ledger's back-off and hourly budget) — but not while a
  member is still pending its first start (scheduling, image pull:
  `starting` then), so a slow pull never turns into a restart loop;
- `incomplete`: pods k > 0 are missing from a gang still forming (the
  leader's address was not known yet, or a create call failed half-way),
  so they are simply created;
- `ready`: every member exists and is Ready. The leader is Ready only once
  every rank of every pod joined it (it answers 503 `ranks_missing` until
  then), and the pods k > 0 carry no probe (Ready while they run), so this
  is the leader's readiness;
- `starting`: otherwise. A member NotReady within its grace leaves the
  instance here (or `incomplete`), and `recheck_at` says when the grace
  ends: nothing else announces that moment, so the planner wakes then.

The grace counts from the Ready condition's lastTransitionTime, so the
planner stays stateless (any operator replica, after any restart, judges
the same); that time has whole seconds from the kubelet's clock, so a skew
between it and the operator's clock moves the restart by as much. It is
not the fast path's grace (`failover.notReadyGraceSeconds`,
failover/losses.py), which fails the peers' rooms seconds after a pod
turns NotReady and restarts nothing; this one decides when waiting for the
pod to recover stops. A pod still starting (running, startup probe not
passed) is no fault: its startup probe ends it (restartPolicy Never: the
pod turns Failed) if it never starts.

Pure module.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from pdcluster.operator.api import format_time
from pdcluster.operator.builders.workers import InstanceKey
from pdcluster.operator.reconcile.observed import ObservedPod
from pdcluster.runtime.pod_layout import LEADER_POD


class Health(StrEnum):
    terminating = "terminating"
    broken = "broken"
    incomplete = "incomplete"
    ready = "ready"
    starting = "starting"


@dataclass(frozen=True)
class ObservedInstance:
    key: InstanceKey
    size: int
    pods: Mapping[int, ObservedPod]  # by pod index
    health: Health
    reason: str
    # `starting` with a member NotReady within its grace: when the first such grace ends.
    recheck_at: float | None = None

    @property
    def missing_pod_indexes(self) -> tuple[int, ...]:
        return tuple(k for k in range(self.size) if k not in self.pods)

    @property
    def leader_address(self) -> str | None:
        """The leader pod's IP, once it has one: what pods k > 0 are built with."""
        leader = self.pods.get(LEADER_POD)
        return leader.pod_ip if leader is not None else None

    @property
    def is_serving(self) -> bool:
        return self.health == Health.ready

    @property
    def is_alive(self) -> bool:
        """Ready or on its way there: counts as the slot's occupant during a rollout."""
        return self.health in (Health.ready, Health.starting)


def judge(
    key: InstanceKey,
    size: int,
    pods: Mapping[int, ObservedPod],
    *,
    now: float,
    not_ready_grace_s: float,
) -> ObservedInstance:
    """The health of instance `key` of `size` pods (`pods` by pod index) at `now`."""
    if size < 1:
        raise ValueError(f"an instance has at least one pod, got size {size}")
    if outside := sorted(k for k in pods if not 0 <= k < size):
        raise ValueError(f"pod indexes {outside} are outside an instance of {size} pods")
    if not_ready_grace_s < 0:
        raise ValueError(f"not_ready_grace_s must be >= 0, got {not_ready_grace_s}")
    health, reason, recheck_at = _health(size, pods, now, not_ready_grace_s)
    if health is Health.broken:
        pending = [p.name for _, p in sorted(pods.items()) if p.phase == "Pending"]
        if pending:
            # A restart now would only recreate pods that pull their image again.
            health = Health.starting
            reason = f"{reason}, but pod {pending[0]} is still pending its first start"
    return ObservedInstance(
        key=key, size=size, pods=pods, health=health, reason=reason, recheck_at=recheck_at
    )


def _not_ready(
    members: list[ObservedPod], now: float, grace_s: float
) -> tuple[str | None, float | None]:
    """The first member NotReady past the grace (why), and when the first grace
    still running ends. Only a pod that passed its startup probe counts."""
    grace_ends: list[float] = []
    for pod in members:
        if pod.ready or not pod.started or pod.phase != "Running":
            continue
        since = pod.not_ready_since
        if since is None:
            return f"pod {pod.name} is NotReady and its status does not say since when", None
        if now - since >= grace_s:
            return (
                f"pod {pod.name} has been NotReady since {format_time(since)}, "
                f"past restart.notReadyGraceSeconds ({grace_s:g}s)",
                None,
            )
        grace_ends.append(since + grace_s)
    return None, min(grace_ends, default=None)


def _health(
    size: int, pods: Mapping[int, ObservedPod], now: float, grace_s: float
) -> tuple[Health, str, float | None]:
    def result(
        health: Health, reason: str, recheck_at: float | None = None
    ) -> tuple[Health, str, float | None]:
        return health, reason, recheck_at

    members = [pods[k] for k in sorted(pods)]
    if not members:
        return result(Health.incomplete, f"0 of {size} pods created")
    if any(p.obj.terminating for p in members):
        return result(Health.terminating, "pods are being deleted")
    ended = [p for p in members if p.has_ended or p.phase == "Unknown"]
    if ended:
        first = ended[0]
        said = f": {first.exit_message}" if first.exit_message else ""
        return result(Health.broken, f"pod {first.name} is {first.phase}{said}")
    leader = pods.get(LEADER_POD)
    if leader is None:
        return result(
            Health.broken,
            f"the leader pod (index {LEADER_POD}) is gone; pod {members[0].name} cannot join "
            "a new one",
        )
    if leader.pod_ip is not None:
        stale = [
            p for p in members if p.leader_address is not None and p.leader_address != leader.pod_ip
        ]
        if stale:
            return result(
                Health.broken,
                f"pod {stale[0].name} was started for leader {stale[0].leader_address}, "
                f"but the leader is at {leader.pod_ip}",
            )
    missing = [k for k in range(size) if k not in pods]
    if missing and (leader.started or leader.ready):
        return result(Health.broken, f"pod index {missing[0]} of a running gang is gone")
    not_ready, grace_end = _not_ready(members, now, grace_s)
    if not_ready is not None:
        return result(Health.broken, not_ready)
    if missing:
        return result(
            Health.incomplete, f"{len(missing)} of {size} pods not created yet", grace_end
        )
    if all(p.ready for p in members):
        return result(Health.ready, "all pods ready")
    waiting = sum(1 for p in members if not p.ready)
    reason = f"{waiting} of {size} pods not ready"
    if grace_end is not None:
        reason += f"; restarted at {format_time(grace_end)} unless Ready again"
    return result(Health.starting, reason, grace_end)


def group_instances(
    pods: Iterable[ObservedPod],
    *,
    now: float,
    not_ready_grace_s: float,
    sizes_by_template: Mapping[str, int] | None = None,
) -> list[ObservedInstance]:
    """Instances sorted by key, judged at `now` with the role's NotReady grace
    (`pods` are one role's). The size of an instance comes from its pods'
    annotation; `sizes_by_template` fills in when no pod carries one."""
    groups: dict[InstanceKey, dict[int, ObservedPod]] = defaultdict(dict)
    sizes: dict[InstanceKey, int] = {}
    for pod in pods:
        key = InstanceKey(pod.role, pod.instance, pod.template_hash)
        groups[key][pod.pod_index] = pod
        if pod.instance_size is not None:
            sizes[key] = max(sizes.get(key, 0), pod.instance_size)
    out: list[ObservedInstance] = []
    for key in sorted(groups):
        members = groups[key]
        size = sizes.get(key) or (sizes_by_template or {}).get(key.template_hash) or 0
        # Never smaller than the highest index seen, whatever the annotation says.
        size = max(size, max(members) + 1)
        out.append(judge(key, size, members, now=now, not_ready_grace_s=not_ready_grace_s))
    return out
