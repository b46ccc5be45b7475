"""The HTTP client the router's worker legs ride on: aiohttp, one pooled session.

Why not httpx, which the router's health checks, aborts and admin calls use:
a streamed POST round trip to a worker costs about 1.5 ms more router CPU
through httpx than through aiohttp (`bench/http_client.py`, both clients
against one uvicorn app in one run), and a PD request pays it twice on the
router's single event loop, the decode leg queued behind the prefill one.
Those two legs are the only calls on the path of every token.

What this module fixes so the relay reads the same as before:
- the session: one connection pool of `max_connections` (waiting for a free
  connection has no limit, as before), a socket connect timeout, no proxy
  from the environment, no response decompression, the cluster token on
  every call;
- idle connections are dropped by the router before a worker drops them
  (`KEEPALIVE_S`, half the workers' keep-alive). Otherwise a connection the
  worker has just closed, whose close this busy event loop has not read yet,
  is taken from the pool and the leg fails with "Server disconnected" (seen
  at 64 clients after an idle pause). httpx avoids it by polling the socket
  before reusing it; aiohttp trusts its own bookkeeping;
- `response_line_batches`: the body as text lines without their line ending,
  as SSE is read (no line-length limit: a long cumulative event is one
  line), in one list per chunk read: a relay waits once per chunk, not once
  per line (an event is two lines); `response_lines` one by one;
- `finish_response`: a stream relayed to its `[DONE]` is read to its end
  before its connection goes back to the pool (the terminator trails the
  last event), so it is reused instead of dropped;
- `leg_data`: a body over a MiB goes as a stream of chunks, which aiohttp
  writes a chunk per loop turn; one `bytes` write of it holds the loop
  (aiohttp warns so, with a ResourceWarning);
- `classify`: which aiohttp failure means "never reached the worker"
  (unreachable), "the connection broke" (the worker may still run the
  request), or "the answer was not HTTP we can read".
"""

from __future__ import annotations

import asyncio
import enum
import io
from collections.abc import AsyncIterator, Mapping

import aiohttp

from pdcluster.runtime.http.limits import DEFAULT_LIMITS

# Seconds an idle pooled connection is reused; the workers keep one for
# DEFAULT_LIMITS.keep_alive_s (uvicorn's keep-alive timeout).
KEEPALIVE_S = DEFAULT_LIMITS.keep_alive_s / 2
# aiohttp's own threshold for a `bytes` body it warns about.
LARGE_BODY_BYTES = 1 << 20
# What `finish_response` waits for after a stream's last event: the chunked
# terminator, which a worker sends at once.
FINISH_TIMEOUT_S = 1.0
FINISH_MAX_BYTES = 64 * 1024


def leg_session(
    *,
    max_connections: int,
    connect_timeout_s: float,
    headers: Mapping[str, str],
    keepalive_s: float = KEEPALIVE_S,
) -> aiohttp.ClientSession:
    """The pooled session both legs of every request use; call inside the running loop."""
    connector = aiohttp.TCPConnector(
        limit=max_connections, limit_per_host=0, keepalive_timeout=keepalive_s
    )
    timeout = aiohttp.ClientTimeout(
        total=None, connect=None, sock_connect=connect_timeout_s, sock_read=None
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        headers=dict(headers),
        trust_env=False,  # a proxy variable must never divert worker traffic
        auto_decompress=False,  # workers never compress; forward what they send
    )


def leg_data(content: bytes) -> bytes | io.BytesIO:
    """What a leg's POST sends: the bytes, or a stream of them when large (one per leg)."""
    return io.BytesIO(content) if len(content) > LARGE_BODY_BYTES else content


async def response_line_batches(resp: aiohttp.ClientResponse) -> AsyncIterator[list[str]]:
    """The body's lines as text, without ``\\n`` / ``\\r\\n``, a list for each
    chunk that completed at least one; a last unterminated line too."""
    pending = b""
    async for chunk in resp.content.iter_any():
        pending += chunk
        if b"\n" not in chunk:
            continue
        *complete, pending = pending.split(b"\n")
        yield [raw.removesuffix(b"\r").decode("utf-8", "replace") for raw in complete]
    if pending:
        yield [pending.removesuffix(b"\r").decode("utf-8", "replace")]


async def response_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """`response_line_batches`, one line at a time."""
    async for batch in response_line_batches(resp):
        for line in batch:
            yield line


def close_response(resp: aiohttp.ClientResponse) -> None:
    """Give the connection back: to the pool when the body was read to its end,
    closed otherwise (a half-read stream must not be reused)."""
    if resp.content.at_eof():
        resp.release()
    else:
        resp.close()


async def finish_response(
    resp: aiohttp.ClientResponse,
    timeout_s: float = FINISH_TIMEOUT_S,
    max_bytes: int = FINISH_MAX_BYTES,
) -> None:
    """Read the rest of a body whose last event came, then give the connection back.

    A worker writes the chunked body's terminator right after `[DONE]`, often in
    a segment of its own: a relay that stops at `[DONE]` finds the body not yet
    at its end, and `close_response` would drop the connection (and the next
    leg to that worker would pay for a new one). What follows `[DONE]` is read
    and dropped, for at most `timeout_s` and `max_bytes`; past either, the
    connection is closed as a half-read one.
    """
    try:
        async with asyncio.timeout(timeout_s):
            left = max_bytes
            while left > 0 and not resp.content.at_eof():
                chunk = await resp.content.readany()
                if not chunk:
                    break
                left -= len(chunk)
    except (TimeoutError, aiohttp.ClientError):
        pass
    close_response(resp)


class LegFailure(enum.Enum):
    unreachable = "unreachable"  # nothing was sent: the worker never saw the request
    connection_lost = "connection_lost"  # sent, then the connection broke
    bad_response = "bad_response"  # an answer that is not readable HTTP


def classify(err: aiohttp.ClientError) -> LegFailure:
    # ConnectionTimeoutError (sock_connect) and ClientConnectorError (refused,
    # DNS, unreachable host) are raised before a byte of the request is sent.
    if isinstance(err, aiohttp.ConnectionTimeoutError | aiohttp.ClientConnectorError):
        return LegFailure.unreachable
    if isinstance(
        err,
        aiohttp.ServerDisconnectedError
        | aiohttp.ClientOSError
        | aiohttp.ClientPayloadError
        | aiohttp.ServerTimeoutError,
    ):
        return LegFailure.connection_lost
    return LegFailure.bad_response
