"""When local autoscaling may stop an instance it drains — a sans-IO machine.

A drain stops an instance only once the router has said it will send it
nothing more and nothing is left in flight, on both sides:

    HOLDING ──router confirmed the hold──► WAITING ──router: 0 legs on it,
       ▲ (any other answer: retry)            │      worker: 0 in flight──► REMOVING
                                              ▲                               │
                                              └──── 409: legs in flight ──────┤
                                                                              │
                                         router removed it (or never had it) ─┴─► STOPPED

- the hold is confirmed by a 200, or a 404 (the router does not have the
  worker: it sends it nothing); a refusal, a timeout or no answer is no
  confirmation: the hold is asked again, and the instance keeps running;
- idle needs both counts *known* and zero: a router or a worker `/metrics`
  that does not answer, times out or is unreadable proves nothing (a busy
  worker is the likeliest to answer late);
- a 409 from `/admin/remove_worker` means the router still has legs on it:
  back to waiting; any other failure of the removal is asked again;
- `drain_timeout_s` bounds the wait for requests in flight (WAITING, and a
  409 in REMOVING): past it they are cut and the instance is stopped, with
  a Warning; it never ends HOLDING, since an instance the router may still
  send to would fail requests that have not even started.

Every step that does not advance says why, once per distinct reason in a
row (`DrainStep.line`), so a stuck drain is visible without a log flood.

Pure module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DrainError(ValueError):
    """An observation the current phase does not take."""


class DrainPhase(enum.Enum):
    HOLDING = "holding"  # asking the router to send the instance nothing more
    WAITING = "waiting"  # for its legs at the router and its requests to finish
    REMOVING = "removing"  # asking the router to forget it
    STOPPED = "stopped"  # it may be stopped now


@dataclass(frozen=True)
class Reply:
    """The outcome of one HTTP call: its status, or 0 when none came (`error` says why)."""

    status: int
    error: str = ""

    def describe(self) -> str:
        return f"HTTP {self.status}" if self.status else (self.error or "no answer")


@dataclass(frozen=True)
class Load:
    """What is in flight on the instance; None: that side's count is unknown (why)."""

    router_legs: int | None
    worker_in_flight: int | None
    unknown_why: str = ""


@dataclass(frozen=True)
class DrainStep:
    phase: DrainPhase
    # A line to say (Normal or Warning, with its reason), None when nothing new.
    line: str | None = None


# Which observation each live phase takes.
TAKES: dict[DrainPhase, type] = {
    DrainPhase.HOLDING: Reply,
    DrainPhase.WAITING: Load,
    DrainPhase.REMOVING: Reply,
}


class Drain:
    """One instance's drain: feed it each call's outcome, act on its phase."""

    def __init__(self, name: str, started_at: float, timeout_s: float) -> None:
        if timeout_s < 0:
            raise DrainError(f"timeout_s must be >= 0, got {timeout_s}")
        self.name = name
        self.phase = DrainPhase.HOLDING
        self.deadline = started_at + timeout_s
        self._last_reason: str | None = None

    def observe(self, seen: Reply | Load, now: float) -> DrainStep:
        """The outcome of the call the current phase makes; returns the next phase."""
        want = TAKES.get(self.phase)
        if want is None or not isinstance(seen, want):
            raise DrainError(f"{self.phase.name} takes no {type(seen).__name__}")
        if isinstance(seen, Load):
            return self._on_load(seen, now)
        if self.phase is DrainPhase.HOLDING:
            return self._on_hold(seen)
        return self._on_remove(seen, now)

    # ---------------------------------------------------------------- steps
    def _on_hold(self, reply: Reply) -> DrainStep:
        if reply.status in (200, 404):
            return self._to(DrainPhase.WAITING)
        return self._stay(
            "DrainWaiting",
            f"the router has not confirmed it sends {self.name} nothing more "
            f"({reply.describe()}); asking again",
        )

    def _on_load(self, load: Load, now: float) -> DrainStep:
        if load.router_legs == 0 and load.worker_in_flight == 0:
            return self._to(DrainPhase.REMOVING)
        if now >= self.deadline:
            return self._to(
                DrainPhase.REMOVING,
                f"Warning DrainTimedOut: {self.name} still busy ({_busy(load)}); "
                "stopping it anyway",
            )
        return self._stay("DrainWaiting", f"{self.name} is still busy ({_busy(load)})")

    def _on_remove(self, reply: Reply, now: float) -> DrainStep:
        if reply.status in (200, 404):
            return self._to(DrainPhase.STOPPED)
        if reply.status == 409:
            if now >= self.deadline:
                return self._to(
                    DrainPhase.STOPPED,
                    f"Warning DrainTimedOut: the router still has legs on {self.name}; "
                    "stopping it anyway",
                )
            return self._to(
                DrainPhase.WAITING,
                f"Normal DrainWaiting: the router still has legs on {self.name} (HTTP 409); "
                "waiting for them",
            )
        return self._stay(
            "DrainWaiting",
            f"the router did not remove {self.name} ({reply.describe()}); asking again",
        )

    # ---------------------------------------------------------------- helpers
    def _to(self, phase: DrainPhase, line: str | None = None) -> DrainStep:
        self.phase = phase
        self._last_reason = None
        return DrainStep(phase, line)

    def _stay(self, reason: str, why: str) -> DrainStep:
        # Said once per reason in a row: a drain polled every fraction of a
        # second would otherwise repeat itself.
        line = f"Normal {reason}: {why}"
        if line == self._last_reason:
            return DrainStep(self.phase)
        self._last_reason = line
        return DrainStep(self.phase, line)


def _busy(load: Load) -> str:
    parts = []
    if load.router_legs is None or load.worker_in_flight is None:
        parts.append(f"not known: {load.unknown_why or 'no answer'}")
    if load.router_legs:
        parts.append(f"{load.router_legs} legs at the router")
    if load.worker_in_flight:
        parts.append(f"{load.worker_in_flight} requests in flight")
    return "; ".join(parts) or "not idle"
