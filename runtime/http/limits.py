"""Input limits shared by every HTTP server of the runtime (worker, bootstrap, router).

- `read_limited`: a request body is counted while it streams in, so a
  chunked body (no Content-Length) cannot grow memory past the limit.
- `server_config`: uvicorn settings that bound what one client can hold:
  connections served at once and idle keep-alive time; and, through
  `ReadDeadlineProtocol`, the size of a header block (431 past it) and the
  time a client may take to send one whole request (headers and body). A
  client that dribbles bytes (slowloris) is disconnected when that time is
  up, and the others are served meanwhile.

The protocol is uvicorn's httptools one (a C parser): with h11, parsing and
framing cost every server ~2x the CPU per streamed request (`bench/router.py`,
"CPU ms/req"), and on a small box that CPU comes out of the engines'.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvicorn

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
    """uvicorn's httptools protocol (turning HTTP/2 prior knowledge away with a
    GOAWAY), plus a deadline for reading each request and a header-size limit.

    The deadline runs from the connection's start, or the end of the last
    response, until the next request has been read whole; it does not run
    while a request that was read is being answered, however long that takes.
    """

    read_timeout_s = DEFAULT_LIMITS.request_read_timeout_s
    max_header_bytes = DEFAULT_LIMITS.max_header_bytes
    _deadline: asyncio.TimerHandle | None = None
    _unanswered = 0  # requests read whole whose response is not complete yet
    _in_head = True  # the bytes arriving now belong to a header block
    _head_bytes = 0  # bytes of that header block so far
    _head_restarted = False

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self._unanswered == 0 and not self.transport.is_closing():
            self.logger.warning("closing a connection that did not send its request in time")
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # httptools buffers a header that is still incomplete, with no limit
        # of its own: count the bytes of an unfinished header block here. A
        # chunk that finishes one request and starts the next (pipelining)
        # restarts the count at the next chunk, so the limit is exact to
        # within one read.
        if self._in_head:
            self._head_bytes += len(data)
        self._head_restarted = False
        super().data_received(data)
        if self._head_restarted:
            self._head_bytes = 0
        if (
            self._in_head
            and self._head_bytes > self.max_header_bytes
            and not self.transport.is_closing()
        ):
            self.logger.warning("closing a connection whose header block is over the limit")
            self.transport.write(_header_too_large(self.max_header_bytes))
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        answered_early = self.cycle is not None and self.cycle.response_complete
        super().on_message_complete()
        self._in_head, self._head_restarted = True, True
        if answered_early:  # the response went before the body was read: wait for the next
            self._arm()
        else:
            self._unanswered += 1
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._unanswered = max(0, self._unanswered - 1)
        if self._unanswered == 0 and not self.transport.is_closing():
            self._arm()


def _header_too_large(limit: int) -> bytes:
    body = f"request header block is over the {limit}-byte limit".encode()
    return (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: text/plain; charset=utf-8\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
    )


def protocol_with(limits: ServerLimits) -> type[ReadDeadlineProtocol]:
    base = ReadDeadlineProtocol
    if (limits.request_read_timeout_s, limits.max_header_bytes) == (
        base.read_timeout_s,
        base.max_header_bytes,
    ):
        return base
    return type(
        "ReadDeadlineProtocol",
        (base,),
        {
            "read_timeout_s": limits.request_read_timeout_s,
            "max_header_bytes": limits.max_header_bytes,
        },
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
        timeout_keep_alive=int(max(1, limits.keep_alive_s)),
        **kw,
    )
