"""Restart back-off for crashing containers (kubelet's CrashLoopBackOff, shorter).

The n-th consecutive crash waits base * 2**(n-1) seconds, capped at max_s. A
container that ran at least reset_after_s before it exited starts the count
again, so a container that crashes once a day restarts at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.runtime.backoff import ExponentialBackoff


@dataclass(frozen=True)
class BackoffPolicy(ExponentialBackoff):
    """Seconds. Defaults are kubelet's shape at a tenth of its scale, for tests."""

    base_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reset_after_s < 0:
            raise ValueError(f"reset_after_s must be >= 0, got {self.reset_after_s}")


def compute_restart_delay(policy: BackoffPolicy, num_consecutive_crashes: int) -> float:
    """Seconds to wait before restarting after the given number of consecutive crashes."""
    if num_consecutive_crashes < 1:
        raise ValueError(f"num_consecutive_crashes must be >= 1, got {num_consecutive_crashes}")
    return policy.delay(num_consecutive_crashes)


def count_consecutive_crashes(policy: BackoffPolicy, previous: int, ran_for_s: float) -> int:
    """The crash count after one more exit of a container that ran ran_for_s seconds."""
    if previous < 0 or ran_for_s < 0:
        raise ValueError("crash count and run time must be >= 0")
    return 1 if ran_for_s >= policy.reset_after_s else previous + 1


def should_restart(restart_policy: str, exit_code: int) -> bool:
    """Whether a container that exited with exit_code runs again under restart_policy."""
    if restart_policy == "Always":
        return True
    if restart_policy == "OnFailure":
        return exit_code != 0
    if restart_policy == "Never":
        return False
    raise ValueError(f"unknown restartPolicy {restart_policy!r}")
