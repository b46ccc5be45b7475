"""Local mode's supervisor: observed exits and a clock in, restart decisions out.

`pdcluster up` keeps a cluster serving the way the operator does: an
instance that lost a process is torn down and started again as a gang (all
its processes, same argv and ports), its peers are told at once, and the
rest keeps serving. Pure module: the launcher observes processes and
performs the actions; no clock, process or socket here.

Per instance the phase follows `TRANSITIONS`; a pair missing there raises
`SupervisionError`:

    RUNNING ──exit──► BACKOFF ──due──► STARTING ──ready──► RUNNING
                        ▲   (exit, ready: ignored, the │
                        │    gang is being torn down)  │
                        └──────────────exit────────────┘

Outside the table, and only there: each instance's generation (bumped by
every start, so a late exit or readiness of an older start is dropped), its
consecutive restart count, when its start is due, and one budget ledger per
role. The same rules as the operator's (`spec.<role>.restart`):

- back-off: the n-th consecutive restart of an instance starts it no
  earlier than `backoffSeconds * 2**(n-1)` (capped at `maxBackoffSeconds`)
  after the loss; the count resets once the instance is ready again;
- budget: at most `budget` restarts per role in a fixed one-hour window
  that opens at the first restart after the previous window closed. A loss
  past the budget gives up: the cluster stops, with the reason (the
  operator leaves such an instance down until the window closes; a local
  cluster has nobody watching it, so it says why and stops). So does the
  loss of a process that belongs to no instance (the router).

Invariants (tests/local/test_supervision.py): never more restarts of a role
in one window than its budget; a restart is never planned while one is
pending (every `Spawn` answers exactly one `TearDown`); after `GiveUp`
nothing else is decided.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdcluster.runtime.backoff import exponential_delay
from pdcluster.runtime.spec import RestartPolicySpec, Role

BUDGET_WINDOW_S = 3600.0


class SupervisionError(RuntimeError):
    """An event the transition table has no entry for, or an unknown instance."""


@dataclass(frozen=True, order=True)
class InstanceKey:
    role: Role
    index: int

    def __str__(self) -> str:
        return f"{self.role.value}-{self.index}"


class Phase(enum.Enum):
    RUNNING = "running"  # started and seen ready
    BACKOFF = "backoff"  # lost: torn down, its next start is due later
    STARTING = "starting"  # started again, not ready yet


class Event(enum.Enum):
    EXITED = "exited"  # a process of the instance's current start ended
    DUE = "due"  # the back-off delay passed
    READY = "ready"  # every process of the current start answers /health


TRANSITIONS: dict[Phase, dict[Event, Phase]] = {
    Phase.RUNNING: {Event.EXITED: Phase.BACKOFF},
    Phase.BACKOFF: {
        # The other processes of the gang end because they were torn down.
        Event.EXITED: Phase.BACKOFF,
        Event.DUE: Phase.STARTING,
        # Seen ready just before it was lost: the loss stands.
        Event.READY: Phase.BACKOFF,
    },
    Phase.STARTING: {Event.EXITED: Phase.BACKOFF, Event.READY: Phase.RUNNING},
}


def next_phase(phase: Phase, event: Event) -> Phase:
    try:
        return TRANSITIONS[phase][event]
    except KeyError:
        raise SupervisionError(f"no transition from {phase.name} on {event.name}") from None


def describe_exit(returncode: int) -> str:
    """`Popen.returncode` in words: `exit code 1`, `killed by SIGKILL`."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name}"


def backoff_delay(policy: RestartPolicySpec, consecutive: int) -> float:
    """Seconds before the `consecutive`-th restart in a row (0 for none): the operator's rule."""
    if consecutive < 1:
        return 0.0
    return exponential_delay(policy.backoff_seconds, policy.max_backoff_seconds, consecutive)


# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class _GangStart:
    """An action on one start of an instance: `generation` counts its starts."""

    key: InstanceKey
    generation: int


class TearDown(_GangStart):
    """Stop what is left of this start of the instance (its whole gang)."""


@dataclass(frozen=True)
class ReportLost:
    """Tell the peers now: the router holds the instance out until `Admit`;
    for a prefill, every decode fails the rooms tied to it (`/admin/fail_peer`)."""

    key: InstanceKey
    reason: str


class Spawn(_GangStart):
    """Start every process of the instance again (same argv and ports)."""


@dataclass(frozen=True)
class Admit:
    """The instance is ready again: the router may send to it."""

    key: InstanceKey


@dataclass(frozen=True)
class GiveUp:
    """Stop the whole cluster; `reason` says why."""

    reason: str


Action = TearDown | ReportLost | Spawn | Admit | GiveUp


@dataclass(frozen=True)
class InstanceView:
    """What `pdcluster ps` shows of one instance."""

    phase: Phase
    generation: int
    restarts: int
    last_exit: str | None
    start_at: float | None


class _Budget:
    """Restarts of one role in the current fixed window."""

    def __init__(self) -> None:
        self.window_start: float | None = None
        self.in_window = 0

    def is_open(self, now: float) -> bool:
        return self.window_start is not None and now < self.window_start + BUDGET_WINDOW_S

    def used(self, now: float) -> int:
        return self.in_window if self.is_open(now) else 0

    def record(self, now: float) -> None:
        if self.is_open(now):
            self.in_window += 1
        else:
            self.window_start, self.in_window = now, 1


class _Instance:
    def __init__(self) -> None:
        self.phase = Phase.RUNNING
        self.generation = 0
        self.consecutive = 0
        self.restarts = 0
        self.last_exit: str | None = None
        self.start_at: float | None = None


class Supervisor:
    """Restart decisions for the instances of one local cluster.

    `policies`: the restart policy of each supervised role. Every instance
    starts RUNNING at generation 0 (the launcher supervises a cluster once
    it was ready).
    """

    def __init__(
        self, instances: Iterable[InstanceKey], policies: Mapping[Role, RestartPolicySpec]
    ) -> None:
        self._instances = {key: _Instance() for key in instances}
        missing = {k.role for k in self._instances} - set(policies)
        if missing:
            names = ", ".join(sorted(r.value for r in missing))
            raise SupervisionError(f"no restart policy for role {names}")
        self._policies = dict(policies)
        self._budgets = {role: _Budget() for role in self._policies}
        self.given_up: str | None = None

    # ------------------------------------------------------------ observation
    def view(self, key: InstanceKey) -> InstanceView:
        inst = self._get(key)
        return InstanceView(
            inst.phase, inst.generation, inst.restarts, inst.last_exit, inst.start_at
        )

    def generation(self, key: InstanceKey) -> int:
        return self._get(key).generation

    def starting(self) -> list[InstanceKey]:
        """Instances whose readiness the launcher should watch."""
        return [k for k, i in self._instances.items() if i.phase is Phase.STARTING]

    def next_wakeup(self) -> float | None:
        due = [i.start_at for i in self._instances.values() if i.start_at is not None]
        return min(due) if due else None

    def restarts_left(self, role: Role, now: float) -> int:
        allowed: int = self._policies[role].budget
        return max(0, allowed - self._budgets[role].used(now))

    # ------------------------------------------------------------ membership
    def add_instance(self, key: InstanceKey) -> None:
        """Supervise an instance autoscaling started, once it is ready (RUNNING)."""
        if key in self._instances:
            raise SupervisionError(f"instance {key} is already supervised")
        if key.role not in self._policies:
            raise SupervisionError(f"no restart policy for role {key.role.value}")
        self._instances[key] = _Instance()

    def remove_instance(self, key: InstanceKey) -> None:
        """Stop supervising an instance autoscaling drains: its exit is no loss.
        Only a RUNNING instance is drained (one being restarted is no capacity to give)."""
        inst = self._get(key)
        if inst.phase is not Phase.RUNNING:
            raise SupervisionError(f"instance {key} is {inst.phase.value}, not running")
        del self._instances[key]

    def is_supervised(self, key: InstanceKey) -> bool:
        return key in self._instances

    # ------------------------------------------------------------ events
    def on_exit(
        self,
        process: str,
        key: InstanceKey | None,
        generation: int,
        returncode: int,
        now: float,
        how: str | None = None,
    ) -> list[Action]:
        """Process `process` of `key`'s start `generation` ended (`key` None: the router);
        `how` says why where the return code cannot (the launcher killed it)."""
        if self.given_up is not None:
            return []
        how = how or describe_exit(returncode)
        if key is None:
            return self._give_up(f"{process} exited ({how}); the cluster cannot serve without it")
        inst = self._get(key)
        if generation != inst.generation:
            return []  # a process of an older start, torn down before
        phase = next_phase(inst.phase, Event.EXITED)
        if inst.phase is Phase.BACKOFF:
            return []
        inst.last_exit = f"{process}: {how}"
        policy = self._policies[key.role]
        budget = self._budgets[key.role]
        if budget.used(now) >= policy.budget:
            return self._give_up(
                f"{process} exited ({how}) and the {key.role.value} restart budget is spent "
                f"({policy.budget} per hour)"
            )
        budget.record(now)
        inst.consecutive += 1
        inst.restarts += 1
        inst.phase = phase
        inst.start_at = now + backoff_delay(policy, inst.consecutive)
        reason = f"{process} {how}"
        return [TearDown(key, generation), ReportLost(key, reason)]

    def on_ready(self, key: InstanceKey, generation: int) -> list[Action]:
        """Every process of `key`'s start `generation` is ready."""
        if self.given_up is not None:
            return []
        inst = self._get(key)
        if generation != inst.generation:
            return []  # readiness of a start that is gone
        was = inst.phase
        inst.phase = next_phase(was, Event.READY)
        if was is Phase.BACKOFF:
            return []
        inst.consecutive = 0
        return [Admit(key)]

    def tick(self, now: float) -> list[Action]:
        """Start the instances whose back-off passed."""
        if self.given_up is not None:
            return []
        acts: list[Action] = []
        for key, inst in sorted(self._instances.items()):
            if inst.start_at is None or now < inst.start_at:
                continue
            inst.phase = next_phase(inst.phase, Event.DUE)
            inst.start_at = None
            inst.generation += 1
            acts.append(Spawn(key, inst.generation))
        return acts

    # ------------------------------------------------------------ helpers
    def _get(self, key: InstanceKey) -> _Instance:
        try:
            return self._instances[key]
        except KeyError:
            raise SupervisionError(f"unknown instance {key}") from None

    def _give_up(self, reason: str) -> list[Action]:
        self.given_up = reason
        for inst in self._instances.values():
            inst.start_at = None
        return [GiveUp(reason)]
