"""Periodic worker probes: the I/O half of the worker pool.

A probe of a worker without server info first reads ``/get_server_info``
(bootstrap port, dp size, and a role check), then ``/health``; the pool
decides what the result means. vLLM workers have no ``/get_server_info``:
with ``reads_server_info`` off their ``/health`` alone decides. Probes of
one round run concurrently and a round ends before the next starts, so a
worker never has two probes in flight.

A prefill probe also reads the live decodes' ``peers_down`` (one
``/get_server_info`` per decode per round): a prefill that a decode still
holds down for a loss the operator reported stays out of the pool even
though it answers. This closes the window where a prefill pod declared lost
by the operator's fast path is Ready again before the decode's heartbeat
has seen it answer: a request routed to it then would fail at the decode
with ``prefill_pod_lost``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field

import httpx

from pdcluster.runtime.router.workers import (
    ServerInfo,
    Worker,
    WorkerPool,
    held_down_by,
    parse_peers_down,
    parse_server_info,
)
from pdcluster.runtime.spec import Role

PeersDown = Mapping[str, Mapping[str, str]]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class HealthChecker:
    pool: WorkerPool
    client: httpx.AsyncClient
    _: KW_ONLY
    interval_s: float
    timeout_s: float
    on_transition: Callable[[Worker, bool], None] | None = None
    # False for workers without /get_server_info (vLLM): /health alone decides,
    # and no decode reports `peers_down`.
    reads_server_info: bool = True
    # Set to end the sleep under way (a new interval is in force).
    _wake: asyncio.Event | None = field(default=None, init=False, repr=False)
    # vLLM with our connector: a prefill's bootstrap port is its side port, and
    # a decode reports `peers_down` there.
    reads_side_ports: bool = False

    def _info_url(self, worker: Worker) -> str | None:
        """Where a worker answers /get_server_info (None: nowhere)."""
        if self.reads_side_ports:
            return worker.side_url
        return worker.url if self.reads_server_info else None

    async def _fetch_info(self, worker: Worker) -> ServerInfo:
        if self.reads_side_ports:
            if worker.role is Role.prefill and worker.side_port is None:
                raise ValueError("vLLM prefill with our connector names no side port")
            return ServerInfo(bootstrap_port=worker.side_port, dp_size=1)
        if not self.reads_server_info:
            return ServerInfo(bootstrap_port=None, dp_size=1)
        resp = await self.client.get(f"{worker.url}/get_server_info", timeout=self.timeout_s)
        if resp.status_code != 200:
            raise ValueError(f"/get_server_info answered HTTP {resp.status_code}")
        try:
            payload = resp.json()
        except ValueError:
            raise ValueError("/get_server_info did not answer JSON") from None
        return parse_server_info(payload, worker.role)

    async def _fetch_peers_down(self, decode: Worker) -> dict[str, str]:
        base = self._info_url(decode)
        if base is None:
            return {}
        try:
            resp = await self.client.get(f"{base}/get_server_info", timeout=self.timeout_s)
            return parse_peers_down(resp.json()) if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}  # a decode that does not answer holds no verdict worth waiting for

    async def peers_down(self) -> dict[str, dict[str, str]]:
        """Each healthy decode's ``peers_down``, by decode URL."""
        if not (self.reads_server_info or self.reads_side_ports):
            return {}
        decodes = self.pool.healthy(Role.decode)
        found = await asyncio.gather(*(self._fetch_peers_down(d) for d in decodes))
        return {d.url: down for d, down in zip(decodes, found, strict=True) if down}

    async def probe(self, worker: Worker, peers_down: PeersDown | None = None) -> None:
        """Probe one worker; a prefill is checked against `peers_down` (None: read it now)."""
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
        if worker.role is Role.prefill:
            if peers_down is None:
                peers_down = await self.peers_down()
            if info is not None:
                self.pool.apply_info(worker, info)  # the bootstrap address decodes know it by
                info = None
            held = held_down_by(worker, peers_down)
            if held is not None:
                if self.pool.record_peer_down(worker, held):
                    log.warning("worker %s (prefill) left the pool: %s", worker.url, held)
                    self._notify(worker, False)
                return
        if self.pool.record_probe_success(worker, info):
            log.info("worker %s (%s) joined the pool", worker.url, worker.role)
            self._notify(worker, True)

    def _notify(self, worker: Worker, healthy: bool) -> None:
        if self.on_transition is not None:
            self.on_transition(worker, healthy)

    async def probe_all(self) -> None:
        workers = self.pool.all()
        if not workers:
            return
        has_prefill = any(w.role is Role.prefill for w in workers)
        down = await self.peers_down() if has_prefill else {}
        await asyncio.gather(*(self.probe(w, down) for w in workers))

    def set_interval(self, interval_s: float) -> None:
        """Probe every `interval_s` from now on: the sleep under way starts again with it."""
        self.interval_s = interval_s
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        self._wake = wake = asyncio.Event()
        while True:
            try:
                await asyncio.wait_for(wake.wait(), self.interval_s)
            except TimeoutError:
                await self.probe_all()
            else:
                wake.clear()
