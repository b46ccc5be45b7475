"""Following the workers' prefix-cache feeds: the I/O half of `prefix_index.py`.

For every healthy worker of a role routed by `cache_aware` (prefill, decode
or colocated) with one dp group, one task. A worker with several dp groups
is not followed (routed by load): each group is an engine with its own
cache, the router talks to the first group's server only, and it hands the
groups requests in turn (`Worker.take_dp_rank`, the room names the group),
so no one key set is true for the worker; it publishes none.

1. ``GET /prefix_cache/snapshot`` → `PrefixIndex.reset`;
2. ``GET /prefix_cache/events?epoch&after=<seq>&wait`` in a loop (a long
   poll: the worker answers as soon as it has an event) → `PrefixIndex.apply`;
3. a ``410`` (the worker restarted or dropped events this router missed) or
   a batch with a gap → back to 1; a failed call → the worker's replica is
   dropped (it is routed by load meanwhile) and 1 again after a back-off.

A router that starts late, or reconnects, thus always begins from a snapshot,
and the sequence numbers make sure no event between snapshot and stream is
lost or applied twice. A worker that leaves the pool stops its task and its
replica is forgotten. Each router replica follows every worker on its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field

import httpx

from pdcluster.runtime.backoff import exponential_delay
from pdcluster.runtime.prefix_events import Apply, WireError, parse_batch, parse_snapshot
from pdcluster.runtime.router.prefix_index import PrefixIndex
from pdcluster.runtime.router.workers import Worker

log = logging.getLogger(__name__)

POLL_WAIT_S = 10.0  # how long one long poll may wait for an event at the worker


class _Restart(Exception):
    """Take a new snapshot."""


@dataclass(eq=False)
class PrefixFollower:
    index: PrefixIndex
    client: httpx.AsyncClient
    workers: Callable[[], Iterable[Worker]]  # the workers to follow, asked at each sync
    _: KW_ONLY
    timeout_s: float
    poll_wait_s: float = POLL_WAIT_S
    max_backoff_s: float = 10.0
    num_snapshots: int = field(default=0, init=False)  # snapshots taken (all workers, since start)
    _tasks: dict[str, tuple[Worker, asyncio.Task[None]]] = field(
        default_factory=dict, init=False, repr=False
    )

    def sync(self) -> None:
        """Follow exactly the eligible workers: start new tasks, stop stale ones."""
        wanted = {w.url: w for w in self.workers() if w.healthy and w.dp_size == 1}
        for url, (worker, task) in list(self._tasks.items()):
            if wanted.get(url) is not worker or task.done():
                task.cancel()
                del self._tasks[url]
                self.index.forget(url)
        for url, worker in wanted.items():
            if url not in self._tasks:
                self._tasks[url] = (worker, asyncio.create_task(self._follow(worker)))

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _follow(self, worker: Worker) -> None:
        attempt = 0
        while True:
            try:
                await self._snapshot(worker)
                attempt = 0
                while True:
                    await self._poll(worker)
            except _Restart as why:
                log.info("prefix feed of %s: new snapshot (%s)", worker.url, why)
                continue
            except (httpx.HTTPError, WireError, ValueError) as err:
                self.index.forget(worker.url)
                attempt += 1
                delay = exponential_delay(0.2, self.max_backoff_s, attempt)
                log.warning(
                    "prefix feed of %s failed (%s); retry in %.1f s",
                    worker.url,
                    str(err) or type(err).__name__,
                    delay,
                )
                await asyncio.sleep(delay)

    async def _snapshot(self, worker: Worker) -> None:
        resp = await self.client.get(f"{worker.url}/prefix_cache/snapshot", timeout=self.timeout_s)
        if resp.status_code != 200:
            raise ValueError(f"/prefix_cache/snapshot answered HTTP {resp.status_code}")
        self.index.reset(worker.url, parse_snapshot(resp.json()))
        self.num_snapshots += 1

    async def _poll(self, worker: Worker) -> None:
        replica = self.index.replica(worker.url)
        if replica is None:
            raise _Restart("no replica")
        wait = 0.0 if replica.is_behind else self.poll_wait_s
        resp = await self.client.get(
            f"{worker.url}/prefix_cache/events",
            params={"epoch": replica.epoch, "after": replica.seq, "wait": wait},
            timeout=self.timeout_s + wait,
        )
        if resp.status_code == 410:
            self.index.forget(worker.url)
            raise _Restart("the worker restarted or dropped events")
        if resp.status_code != 200:
            raise ValueError(f"/prefix_cache/events answered HTTP {resp.status_code}")
        result = self.index.apply(worker.url, parse_batch(resp.json()))
        if result is not Apply.applied:
            raise _Restart(result.value)
