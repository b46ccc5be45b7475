"""Is the engine thread hung? Progress timestamps in, verdict out.

A hung engine (a step, a tick hook or a collective that never returns)
keeps the process and its HTTP server alive, so nothing but progress can
tell it apart from a busy one. The engine thread stamps `last_progress_at`
each time one loop iteration completes (a step finished, or it found no
work and went idle) and marks `busy_since` while it is inside an iteration
with work. The engine is *stalled* when it has work in hand or queued and
no iteration finished for `bound_s` seconds.

An idle engine is never stalled, however old its last step: nothing waits
on it. A single step longer than `bound_s` (a very long prefill chunk on a
slow device) reads as a stall, so the bound must exceed the slowest step.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

STALL_REASON = "engine_stalled"


@dataclass(frozen=True)
class Progress:
    last_progress_at: float  # monotonic seconds: last loop iteration that completed
    has_pending_work: bool  # inside a step, or commands/requests waiting for the thread


def stalled_for(progress: Progress, now: float, bound_s: float) -> float | None:
    """Seconds without progress when that makes a stall (> bound_s with work pending), else None."""
    if not bound_s > 0:
        raise ValueError(f"stall bound must be > 0 seconds, got {bound_s}")
    if not progress.has_pending_work:
        return None
    idle = now - progress.last_progress_at
    return idle if idle > bound_s else None


def is_stalled(progress: Progress, now: float, bound_s: float) -> bool:
    return stalled_for(progress, now, bound_s) is not None
