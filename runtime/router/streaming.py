"""Client-side I/O of a relayed request: disconnect watching and SSE output.

A client that goes away must cost the workers nothing, so the router
watches the ASGI ``receive`` channel for ``http.disconnect`` during every
wait — not only when it next writes, which for a quiet stream or a
non-streaming request could be minutes later (uvicorn drops writes to a
closed connection silently).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdcluster.runtime import stage_trace
from pdcluster.runtime.router.leg_plan import LegPlan

log = logging.getLogger(__name__)
# Set in the ASGI scope when the client left, so request metrics say 499.
DISCONNECT_SCOPE_KEY = "pdcluster.client_disconnected"
T = TypeVar("T")


class ClientRelay(Protocol):
    """What the front door drives of one request's legs, whatever the flow
    (relay.Relay: both legs at once; vllm_relay.VllmRelay: prefill, then decode)."""

    plan: LegPlan

    @property
    def rid(self) -> str: ...

    @property
    def main_status(self) -> int: ...

    def start(self) -> None: ...

    async def open(self) -> None: ...

    async def read_body(self) -> bytes: ...

    def events(self) -> AsyncIterator[bytes]: ...

    def abandon(self, reason: str) -> None: ...

    async def aclose(self) -> None: ...


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    # The body was read already, so the server has nothing but a disconnect
    # left to deliver on this channel.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(
    receive: Receive, aw: Awaitable[T], on_disconnect: Callable[[], None]
) -> T:
    """Await ``aw``; if the client leaves first, call ``on_disconnect`` at once,
    cancel ``aw`` and raise ClientDisconnected."""
    work = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    on_disconnect()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientDisconnected


class RelayStreamResponse(Response):
    """Streams a relay's events; aborts the legs the moment the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, relay: ClientRelay) -> None:
        # Not Response.__init__: a stream has no body to measure, and a
        # Content-Length of 0 would make the server refuse every event.
        self.status_code = 200
        self.background = None
        self.init_headers(
            {
                "cache-control": "no-cache",
                "x-accel-buffering": "no",
                "x-request-id": relay.rid,
            }
        )
        self.relay = relay
        self.client_disconnected = False

    async def _pump(self, send: Send) -> None:
        room = self.relay.plan.room
        async for chunk in self.relay.events():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if room is not None:
                stage_trace.mark(room, "router.first_event_sent")
                room = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(send))
            gone = asyncio.ensure_future(wait_for_disconnect(receive))
            try:
                await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not pump.done():
                    self.client_disconnected = True
                    self.relay.abandon("client_disconnect")
                    pump.cancel()
                gone.cancel()
                await asyncio.gather(pump, gone, return_exceptions=True)
            if pump.cancelled() or pump.exception() is not None:
                if not pump.cancelled():
                    log.warning("stream %s ended by %r", self.relay.rid, pump.exception())
                # A failed write means the client is gone too.
                self.client_disconnected = True
                self.relay.abandon("client_disconnect")
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if self.client_disconnected:
                scope[DISCONNECT_SCOPE_KEY] = True
            await self.relay.aclose()
