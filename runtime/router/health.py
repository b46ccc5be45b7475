"""Periodic worker probes: the I/O half of the worker pool.

A probe of a worker without server info first reads ``/get_server_info``
(bootstrap port, dp size, and a role check), then ``/health``; the pool
decides what the result means. Probes of one round run concurrently and a
round ends before the next starts, so a worker never has two probes in
flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from pdcluster.runtime.router.workers import ServerInfo, Worker, WorkerPool, parse_server_info

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self,
        pool: WorkerPool,
        client: httpx.AsyncClient,
        *,
        interval_s: float,
        timeout_s: float,
        on_transition: Callable[[Worker, bool], None] | None = None,
    ) -> None:
        self.pool = pool
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._on_transition = on_transition

    async def _fetch_info(self, worker: Worker) -> ServerInfo:
        resp = await self.client.get(f"{worker.url}/get_server_info", timeout=self.timeout_s)
        if resp.status_code != 200:
            raise ValueError(f"/get_server_info answered HTTP {resp.status_code}")
        try:
            payload = resp.json()
        except ValueError:
            raise ValueError("/get_server_info did not answer JSON") from None
        return parse_server_info(payload, worker.role)

    async def probe(self, worker: Worker) -> None:
        try:
            info = None if worker.has_info else await self._fetch_info(worker)
            resp = await self.client.get(f"{worker.url}/health", timeout=self.timeout_s)
            if resp.status_code != 200:
                raise ValueError(f"/health answered HTTP {resp.status_code}")
        except (httpx.HTTPError, ValueError) as err:
            reason = str(err) or type(err).__name__
            if self.pool.record_probe_failure(worker, reason):
                log.warning("worker %s (%s) left the pool: %s", worker.url, worker.role, reason)
                self._notify(worker, False)
            return
        if self.pool.record_probe_success(worker, info):
            log.info("worker %s (%s) joined the pool", worker.url, worker.role)
            self._notify(worker, True)

    def _notify(self, worker: Worker, healthy: bool) -> None:
        if self._on_transition is not None:
            self._on_transition(worker, healthy)

    async def probe_all(self) -> None:
        workers = self.pool.all()
        if workers:
            await asyncio.gather(*(self.probe(w) for w in workers))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.probe_all()
