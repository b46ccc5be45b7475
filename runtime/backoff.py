"""Exponential back-off: the one formula every retry and restart delay uses.

The delay before retry `attempt` (1-based) is `base_s * factor**(attempt - 1)`,
at most `max_s` (`exponential_delay`; `ExponentialBackoff` holds the three
numbers as a policy). Callers: the bootstrap client's retries and a prefill
rank's registration (`pd_worker`, `pd/readiness.py`), the operator's
instance restarts (`operator/reconcile/restarts.py`), the e2e node agent's
container restarts.

Pure module.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from pdcluster.runtime.bounds import require_at_least


def exponential_delay(base_s: float, max_s: float, attempt: int, factor: float = 2.0) -> float:
    """Seconds to wait before retry `attempt` (1, 2, ...): base_s·factor^(attempt-1), ≤ max_s."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    require_at_least("back-off", base_s=(base_s, 0), max_s=(max_s, 0), factor=(factor, 1))
    try:
        delay = base_s * factor ** (attempt - 1)
    except OverflowError:  # far past any cap
        return max_s
    return min(delay, max_s)


def exponential_delays(base_s: float, max_s: float, factor: float = 2.0) -> Iterator[float]:
    """The delays before retry 1, 2, 3, ... without end (slice it for a bounded number)."""
    for attempt in itertools.count(1):
        yield exponential_delay(base_s, max_s, attempt, factor)


@dataclass(frozen=True)
class ExponentialBackoff:
    """Seconds: retry n waits base_s·factor^(n-1), at most `max_s`.

    The defaults are the bootstrap client's and a prefill rank's registration
    retries: 50 ms doubling up to 2 s.
    """

    base_s: float = 0.05
    factor: float = 2.0
    max_s: float = 2.0

    def __post_init__(self) -> None:
        if not (0 <= self.base_s <= self.max_s) or self.factor < 1:
            raise ValueError(
                f"{type(self).__name__} needs 0 <= base_s <= max_s and factor >= 1, got {self}"
            )

    def delay(self, attempt: int) -> float:
        """Seconds before retry `attempt` (1, 2, ...)."""
        return exponential_delay(self.base_s, self.max_s, attempt, self.factor)

    def delays(self) -> Iterator[float]:
        """The delays before retry 1, 2, 3, ... without end."""
        return exponential_delays(self.base_s, self.max_s, self.factor)
