"""Gang restart bookkeeping of one role: exponential back-off and an hourly budget.

The ledger lives in the PDCluster status (the operator keeps no memory of
its own, so a restarted operator continues where the last one stopped).

- Back-off: after the n-th consecutive restart of an instance, its pods are
  recreated no earlier than `backoffSeconds * 2**(n-1)` (capped at
  `maxBackoffSeconds`) after the teardown. The count resets once the
  instance is seen Ready.
- Budget: at most `budget` restarts per role in a fixed one-hour window
  that opens at the first restart after the previous window closed. With
  the budget spent, broken instances are left as they are (their failed
  pods stay for inspection) until the window closes.

Times are epoch seconds. Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pdcluster.operator.api import InstanceBackoff, RoleStatus, format_time, parse_time
from pdcluster.runtime.backoff import exponential_delay
from pdcluster.runtime.spec import RestartPolicySpec

BUDGET_WINDOW_S = 3600.0


@dataclass(frozen=True)
class Backoff:
    consecutive: int
    last_restart: float


@dataclass(frozen=True)
class RestartLedger:
    total: int = 0
    window_start: float | None = None
    in_window: int = 0
    backoff: Mapping[int, Backoff] = field(default_factory=dict)

    def window_open(self, now: float) -> bool:
        return self.window_start is not None and now < self.window_start + BUDGET_WINDOW_S

    def restarts_in_window(self, now: float) -> int:
        return self.in_window if self.window_open(now) else 0

    def can_restart(self, policy: RestartPolicySpec, now: float) -> bool:
        budget: int = policy.budget
        return self.restarts_in_window(now) < budget

    def budget_reopens_at(self, now: float) -> float | None:
        """When a spent budget refills; None when it is not spent."""
        if self.window_start is None or not self.window_open(now):
            return None
        return self.window_start + BUDGET_WINDOW_S

    def record(self, index: int, now: float) -> RestartLedger:
        """A teardown of instance `index` at `now` (the caller checked the budget)."""
        # Whole seconds: what the status can hold, so a re-read ledger plans alike.
        now = float(int(now))
        if self.window_open(now):
            window_start, in_window = self.window_start, self.in_window + 1
        else:
            window_start, in_window = now, 1
        prev = self.backoff.get(index)
        backoff = dict(self.backoff)
        backoff[index] = Backoff(
            consecutive=(prev.consecutive + 1) if prev else 1, last_restart=now
        )
        return RestartLedger(
            total=self.total + 1, window_start=window_start, in_window=in_window, backoff=backoff
        )

    def recreate_at(self, index: int, policy: RestartPolicySpec) -> float | None:
        """Earliest time instance `index` may be recreated; None: at once."""
        entry = self.backoff.get(index)
        if entry is None:
            return None
        return entry.last_restart + backoff_delay(policy, entry.consecutive)

    def mark_ready(self, index: int) -> RestartLedger:
        if index not in self.backoff:
            return self
        return replace(self, backoff={i: b for i, b in self.backoff.items() if i != index})

    def forget_from(self, index: int) -> RestartLedger:
        """Drop the entries of instances `index` and above (scaled away)."""
        if all(i < index for i in self.backoff):
            return self
        return replace(self, backoff={i: b for i, b in self.backoff.items() if i < index})


def backoff_delay(policy: RestartPolicySpec, consecutive: int) -> float:
    if consecutive < 1:
        return 0.0
    return exponential_delay(policy.backoff_seconds, policy.max_backoff_seconds, consecutive)


def ledger_from_status(status: RoleStatus | None) -> RestartLedger:
    """Read the ledger back; unreadable times count as absent."""
    if status is None:
        return RestartLedger()
    window_start: float | None = None
    if status.budget_window_start:
        try:
            window_start = parse_time(status.budget_window_start)
        except ValueError:
            window_start = None
    backoff: dict[int, Backoff] = {}
    for entry in status.backoff:
        try:
            backoff[entry.index] = Backoff(
                entry.consecutive_restarts, parse_time(entry.last_restart_time)
            )
        except ValueError:
            continue
    return RestartLedger(
        total=status.restarts,
        window_start=window_start,
        in_window=status.restarts_in_window if window_start is not None else 0,
        backoff=backoff,
    )


def ledger_status_fields(ledger: RestartLedger) -> dict[str, object]:
    """The RoleStatus fields that persist the ledger."""
    return {
        "restarts": ledger.total,
        "restarts_in_window": ledger.in_window,
        "budget_window_start": (
            format_time(ledger.window_start) if ledger.window_start is not None else None
        ),
        "backoff": [
            InstanceBackoff(
                index=i,
                consecutive_restarts=b.consecutive,
                last_restart_time=format_time(b.last_restart),
            )
            for i, b in sorted(ledger.backoff.items())
        ],
    }
