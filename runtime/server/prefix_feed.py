"""The worker's prefix-cache feed: what routers read to follow its cached keys.

``GET /prefix_cache/snapshot`` → the key set now, with the epoch, the seq of
the last event in it, the key salt, page size and tokenizer fingerprint
(`prefix_events.Snapshot.to_wire`).

``GET /prefix_cache/events?epoch=E&after=N&wait=S`` → the events numbered
above N (`EventBatch.to_wire`), waiting up to S seconds (at most
``MAX_WAIT_S``) for one when there is none yet; ``410`` with
``{"reason": "snapshot_needed"}`` when they cannot be given (another epoch,
events dropped from the bounded buffer): the router takes a snapshot.

Both need the cluster token (`http/auth.py`: ``/prefix_cache/*`` is always
guarded). The engine thread records events (`PrefixFeed.record`, a
`prefix_cache` listener); the server's event loop reads them; one lock
serialises the two, and a waiting request is woken through the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdcluster.runtime.prefix_events import KeyEventLog, SnapshotNeeded
from pdcluster.runtime.prefix_keys import PageKey

log = logging.getLogger("pdcluster.worker.prefix_feed")

MAX_WAIT_S = 30.0
MAX_BATCH_EVENTS = 1024


class PrefixFeed:
    def __init__(self, events: KeyEventLog) -> None:
        self._log = events
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self.broken = ""  # why the feed stopped (a listener call it refused)

    # ---- the engine thread --------------------------------------------
    def record(self, stored: bool, keys: Sequence[PageKey]) -> None:
        """The prefix cache's listener: never raises into the engine."""
        with self._lock:
            if self.broken:
                return
            try:
                self._log.record(stored, keys)
            except ValueError as err:
                # The copy no longer matches the cache: stop serving it, so no
                # router routes by a wrong key set.
                self.broken = str(err)
                log.error("prefix-cache feed stopped: %s", err)
            loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(self._wake)

    # ---- the event loop -----------------------------------------------
    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _bind(self) -> asyncio.Event:
        with self._lock:
            self._loop = asyncio.get_running_loop()
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def snapshot_wire(self) -> dict[str, object]:
        with self._lock:
            return self._log.snapshot().to_wire()

    async def events_wire(self, epoch: str, after: int, wait_s: float) -> dict[str, object]:
        """Raises SnapshotNeeded (→ 410)."""
        changed = self._bind()
        with self._lock:
            batch = self._log.events_after(epoch, after, MAX_BATCH_EVENTS)
        if batch.events or wait_s <= 0:
            return batch.to_wire()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), wait_s)
        with self._lock:
            return self._log.events_after(epoch, after, MAX_BATCH_EVENTS).to_wire()


def _gone(message: str) -> JSONResponse:
    return JSONResponse({"reason": "snapshot_needed", "message": message}, 410)


def add_prefix_feed_routes(app: FastAPI, feed: PrefixFeed) -> None:
    async def snapshot(request: Request) -> JSONResponse:
        if feed.broken:
            return JSONResponse({"reason": "feed_stopped", "message": feed.broken}, 503)
        return JSONResponse(feed.snapshot_wire())

    async def events(request: Request) -> JSONResponse:
        if feed.broken:
            return JSONResponse({"reason": "feed_stopped", "message": feed.broken}, 503)
        q = request.query_params
        epoch = q.get("epoch", "")
        try:
            after = int(q.get("after", ""))
            wait_s = float(q.get("wait", "0"))
        except ValueError:
            return JSONResponse(
                {"reason": "bad_request", "message": "after must be an integer, wait a number"},
                400,
            )
        if not 0 <= wait_s <= MAX_WAIT_S:
            return JSONResponse(
                {"reason": "bad_request", "message": f"wait must be in [0, {MAX_WAIT_S}]"}, 400
            )
        try:
            return JSONResponse(await feed.events_wire(epoch, after, wait_s))
        except SnapshotNeeded as err:
            return _gone(str(err))

    app.add_api_route("/prefix_cache/snapshot", snapshot, methods=["GET"])
    app.add_api_route("/prefix_cache/events", events, methods=["GET"])
