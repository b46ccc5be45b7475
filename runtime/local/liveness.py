"""Local mode's liveness probe: what the kubelet's `livenessProbe` does for a pod.

A worker that still runs but no longer serves is no exit, so the
supervisor's exit path (`supervision.py`) never sees it: an engine that
hung (`/health/live` answers 503 `engine_stalled` once the engine's
`stallTimeoutSeconds` passed) or a process that stopped altogether
(SIGSTOP, a deadlock that holds the event loop) and answers nothing. So
the launcher probes the leader process of every running instance on
`/health/live` every `period_s`; a probe that errs, answers non-2xx, or
takes longer than `timeout_s` failed. After `failure_threshold` failures in
a row the launcher kills the process, and its exit goes the way of any
other loss: the gang is torn down, its peers are told, the restart budget
is charged and the instance is started again.

The defaults are the operator's pod `livenessProbe` (period 10 s, timeout
5 s, 3 failures: `operator/builders/workers.py`). Only leaders are
probed: they alone serve HTTP, as on Kubernetes.

Pure module: results in, a kill decision out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LivenessPolicy:
    period_s: float = 10.0
    timeout_s: float = 5.0
    failure_threshold: int = 3

    def __post_init__(self) -> None:
        if not self.period_s > 0 or not self.timeout_s > 0:
            raise ValueError(
                f"liveness period and timeout must be > 0, got {self.period_s}, {self.timeout_s}"
            )
        if self.failure_threshold < 1:
            raise ValueError(
                f"liveness failure_threshold must be >= 1, got {self.failure_threshold}"
            )

    def describe(self) -> str:
        """Why a process was killed, for `ps` and the supervisor's message."""
        return f"killed after {self.failure_threshold} failed liveness probes in a row"


class LivenessLedger:
    """Consecutive failed probes per process (of its current start)."""

    def __init__(self, policy: LivenessPolicy) -> None:
        self.policy = policy
        self._failures: dict[tuple[str, int], int] = {}

    def record(self, process: str, generation: int, ok: bool) -> bool:
        """One probe's result for start `generation` of `process`; True: kill it now.

        A success resets the count. The count is per start: a restarted
        process begins at zero, and the late result of a probe of an older
        start counts against that start only, never the new one.
        """
        key = (process, generation)
        if ok:
            self._failures.pop(key, None)
            return False
        failures = self._failures.get(key, 0) + 1
        if failures >= self.policy.failure_threshold:
            del self._failures[key]
            return True
        self._failures[key] = failures
        return False

    def forget(self, process: str) -> None:
        """`process` ended or was torn down: drop what its starts had counted."""
        for key in [k for k in self._failures if k[0] == process]:
            del self._failures[key]

    def failures(self, process: str, generation: int) -> int:
        return self._failures.get((process, generation), 0)
