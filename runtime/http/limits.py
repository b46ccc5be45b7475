"""Input limits shared by every HTTP server of the runtime (worker, bootstrap, router).

- `read_limited`: a request body is counted while it streams in, so a
  chunked body (no Content-Length) cannot grow memory past the limit.
- `server_config`: uvicorn settings that bound what one client can hold:
  connections served at once, the size of an incomplete header block, idle
  keep-alive time, and — through `ReadDeadlineProtocol` — the time a client
  may take to send one whole request (headers and body). A client that
  dribbles bytes (slowloris) is disconnected when that time is up, and the
  others are served meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdcluster.runtime.http.event_loop import DEFAULT_EVENT_LOOP, EventLoop
from pdcluster.runtime.http.h2_preface import Http1OnlyProtocol


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is over the {limit}-byte limit")
        self.limit = limit


class BadLength(ValueError):
    pass


async def read_limited(chunks: AsyncIterator[bytes], declared: str | None, limit: int) -> bytes:
    """The whole body, or BodyTooLarge as soon as more than `limit` bytes arrived."""
    if declared is not None:
        if not declared.isdigit():
            raise BadLength("invalid Content-Length header")
        if int(declared) > limit:
            raise BodyTooLarge(limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(chunk)
    return b"".join(parts)


@dataclass(frozen=True)
class ServerLimits:
    # Connections (and requests) served at once; more get 503.
    max_concurrency: int = 2048
    # Seconds from connection start (or the end of the previous response)
    # until the next request has been read completely.
    request_read_timeout_s: float = 15.0
    # Bytes of a header block still incomplete.
    max_header_bytes: int = 64 * 1024
    # Seconds an idle keep-alive connection is kept.
    keep_alive_s: float = 5.0


DEFAULT_LIMITS = ServerLimits()


class ReadDeadlineProtocol(Http1OnlyProtocol):
    """uvicorn's h11 protocol (turning HTTP/2 prior knowledge away with a GOAWAY),
    plus a deadline for reading each request."""

    read_timeout_s = DEFAULT_LIMITS.request_read_timeout_s
    _deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            self.logger.warning("closing a connection that did not send its request in time")
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is h11.DONE:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()


def protocol_with(limits: ServerLimits) -> type[H11Protocol]:
    if limits.request_read_timeout_s == ReadDeadlineProtocol.read_timeout_s:
        return ReadDeadlineProtocol
    return type(
        "ReadDeadlineProtocol",
        (ReadDeadlineProtocol,),
        {"read_timeout_s": limits.request_read_timeout_s},
    )


def server_config(
    app: Any,
    host: str,
    port: int,
    limits: ServerLimits = DEFAULT_LIMITS,
    loop: EventLoop = DEFAULT_EVENT_LOOP,
    **kw: Any,
) -> uvicorn.Config:
    """A uvicorn Config with this module's limits (and `log_level="warning"`).

    `loop` is the loop `uvicorn.Server.run` creates; never uvicorn's `auto`,
    which would switch loops by what happens to be installed.
    """
    kw.setdefault("log_level", "warning")
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=loop.value,
        http=protocol_with(limits),
        limit_concurrency=limits.max_concurrency,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_keep_alive=int(max(1, limits.keep_alive_s)),
        **kw,
    )
