"""Fault injection for the fault suite: an engine whose n-th step hangs.

`pdcluster worker` wraps its engine with `hang_at_step` when the
environment variable `PDCLUSTER_TEST_HANG_STEP` (`worker_main.HANG_ENV`)
names its role, so a test can make a real worker's engine thread stall.
"""

from __future__ import annotations

from typing import Any


class _HangingEngine:
    """An engine whose `at_step`-th step first blocks `hang_s` seconds (fault injection)."""

    def __init__(self, engine: Any, at_step: int, hang_s: float) -> None:
        self._engine = engine
        self._at_step = at_step
        self._hang_s = hang_s
        self._steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self) -> Any:
        import time

        self._steps += 1
        if self._steps == self._at_step:
            time.sleep(self._hang_s)
        return self._engine.step()


def hang_at_step(engine: Any, role: str, spec: str) -> Any:
    """`spec` is "<role>:<step>:<seconds>"; wraps `engine` when the role matches."""
    try:
        want, step, seconds = spec.split(":")
        at_step, hang_s = int(step), float(seconds)
    except ValueError:
        raise ValueError(f"hang spec must be '<role>:<step>:<seconds>', got {spec!r}") from None
    if want != role:
        return engine
    return _HangingEngine(engine, at_step, hang_s)
