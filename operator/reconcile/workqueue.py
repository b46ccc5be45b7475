"""A coalescing, delaying work queue for reconcile keys (asyncio).

Every trigger — the PDCluster changed, a child changed, a back-off ended,
the periodic resync — adds the cluster's key; the queue turns a burst of
triggers into one reconcile. Guarantees:
- a key is never processed by two workers at once; a key added while it is
  being processed runs once more afterwards (nothing is lost);
- a key added with a delay runs at the earliest of its pending due times;
- the handler returns the delay until the key wants to run again (None:
  only when triggered); a handler that raises is retried with per-key
  exponential back-off, reset by the next success; the exponent is capped
  (`MAX_BACKOFF_EXPONENT`), so a key failing forever keeps retrying at the
  maximum delay;
- one key's failure never stops the queue: whatever a run raises, the
  worker logs it and takes the next key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

log = logging.getLogger(__name__)
# 2**30 times any sensible first delay is past every maximum; larger exponents
# would only risk an overflow.
MAX_BACKOFF_EXPONENT = 30


def retry_delay(failures: int, first_s: float, max_s: float) -> float:
    """Delay before retry number `failures` (1: the first): doubles, capped at `max_s`."""
    exponent = min(max(failures, 1) - 1, MAX_BACKOFF_EXPONENT)
    return float(min(first_s * 2**exponent, max_s))


@dataclass(eq=False)
class WorkQueue(Generic[K]):
    handler: Callable[[K], Awaitable[float | None]]
    num_workers: int = 4
    # First retry after a failed run; doubles per failure up to the max.
    retry_delay_s: float = 1.0
    max_retry_delay_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _due: dict[K, float] = field(default_factory=dict, init=False, repr=False)
    _running: set[K] = field(default_factory=set, init=False, repr=False)
    _rerun: set[K] = field(default_factory=set, init=False, repr=False)
    _failures: dict[K, int] = field(default_factory=dict, init=False, repr=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, init=False, repr=False)
    _idle: asyncio.Condition = field(default_factory=asyncio.Condition, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError("num_workers must be >= 1")

    def add(self, key: K, delay_s: float = 0.0) -> None:
        due = self.clock() + max(0.0, delay_s)
        if key in self._running and delay_s <= 0:
            self._rerun.add(key)
            return
        current = self._due.get(key)
        if current is None or due < current:
            self._due[key] = due
            self._wake.set()

    def forget(self, key: K) -> None:
        """Drop pending runs and back-off of `key` (its object was deleted)."""
        self._due.pop(key, None)
        self._rerun.discard(key)
        self._failures.pop(key, None)

    def __len__(self) -> int:
        return len(self._due)

    def is_pending(self, key: K) -> bool:
        return key in self._due or key in self._rerun

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.num_workers)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def wait_idle(self, timeout_s: float) -> None:
        """Wait until nothing is due now and nothing runs (tests, shutdown)."""

        def idle() -> bool:
            now = self.clock()
            return not self._running and all(d > now for d in self._due.values())

        async with self._idle:
            await asyncio.wait_for(self._idle.wait_for(idle), timeout_s)

    def _take(self) -> tuple[K | None, float | None]:
        """The next due key not running, or the time until the earliest due."""
        now = self.clock()
        best: tuple[float, K] | None = None
        for key, due in self._due.items():
            if key in self._running:
                continue
            if best is None or due < best[0]:
                best = (due, key)
        if best is None:
            return None, None
        if best[0] <= now:
            del self._due[best[1]]
            return best[1], None
        return None, best[0] - now

    async def _worker(self) -> None:
        while True:
            key, wait = self._take()
            if key is None:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass
                continue
            self._running.add(key)
            try:
                await self._run(key)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in the retry path must not end the worker
                log.exception("work queue: run of %s failed; retrying it later", key)
                self.add(key, self.max_retry_delay_s)
            finally:
                self._running.discard(key)
                if key in self._rerun:
                    self._rerun.discard(key)
                    self.add(key)
                self._wake.set()
                async with self._idle:
                    self._idle.notify_all()

    async def _run(self, key: K) -> None:
        try:
            again = await self.handler(key)
        except asyncio.CancelledError:
            raise
        except Exception:
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
            delay = retry_delay(failures, self.retry_delay_s, self.max_retry_delay_s)
            log.exception(
                "reconcile of %s failed (%d in a row); retrying in %.1fs", key, failures, delay
            )
            self.add(key, delay)
            return
        self._failures.pop(key, None)
        if again is not None:
            self.add(key, again)
