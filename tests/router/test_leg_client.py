"""The router's leg client against real sockets: lines as SSE reads them, and
which failure is which (never reached / connection broke / unreadable answer)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from pdcluster.runtime.router.leg_client import (
    LegFailure,
    classify,
    close_response,
    finish_response,
    leg_session,
    response_lines,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/generate"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def answer_with(*parts: bytes, close_early: bool = False) -> Handler:
    """A server that answers one request with `parts` written one by one (a
    chunked body); `close_early`: it hangs up before the terminating chunk."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in parts:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.01)
        if not close_early:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    return handler


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    legs = leg_session(max_connections=8, connect_timeout_s=2.0, headers={"x-test": "1"})
    async with legs:
        yield legs


async def lines_from(session: aiohttp.ClientSession, *parts: bytes) -> list[str]:
    server, url = await serve(answer_with(*parts))
    async with server:
        resp = await session.post(url, data=b"{}")
        lines = [line async for line in response_lines(resp)]
        close_response(resp)
        return lines


async def test_lines_lose_their_endings_across_chunk_boundaries(
    session: aiohttp.ClientSession,
) -> None:
    lines = await lines_from(session, b'data: {"a"', b": 1}\r\n\r\nda", b"ta: [DONE]\n\n", b"tail")
    assert lines == ['data: {"a": 1}', "", "data: [DONE]", "", "tail"]


async def test_a_line_longer_than_any_buffer_stays_one_line(
    session: aiohttp.ClientSession,
) -> None:
    long = b"data: " + b"x" * 300_000
    lines = await lines_from(session, long[:100_000], long[100_000:] + b"\n")
    assert lines == [long.decode()]


async def test_invalid_utf8_is_replaced_not_raised(session: aiohttp.ClientSession) -> None:
    assert await lines_from(session, b"data: \xff\xfe\n") == ["data: \ufffd\ufffd"]


async def test_the_session_sends_its_headers_and_the_body(session: aiohttp.ClientSession) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server, url = await serve(handler)
    async with server:
        resp = await session.post(url, data=b'{"rid": "r1"}', headers={"content-type": "a/b"})
        assert await resp.read() == b"ok"
        close_response(resp)
    request = seen[0].lower()
    assert b"x-test: 1" in request and b"content-type: a/b" in request
    assert request.endswith(b'{"rid": "r1"}')


async def test_a_closed_port_is_unreachable(session: aiohttp.ClientSession) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(aiohttp.ClientError) as info:
            await session.post(f"http://127.0.0.1:{port}/generate", data=b"{}")
    assert classify(info.value) is LegFailure.unreachable


async def test_a_server_hanging_up_mid_stream_is_a_lost_connection(
    session: aiohttp.ClientSession,
) -> None:
    server, url = await serve(answer_with(b"data: 1\n\n", close_early=True))
    async with server:
        resp = await session.post(url, data=b"{}")
        with pytest.raises(aiohttp.ClientError) as info:
            async for _ in response_lines(resp):
                pass
        close_response(resp)
    assert classify(info.value) is LegFailure.connection_lost


def answer_raw(reply: bytes) -> Handler:
    """A server that reads the request, writes `reply` (maybe nothing) and hangs up."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()
        writer.close()

    return handler


@pytest.mark.parametrize(
    ("reply", "failure"),
    [
        (b"", LegFailure.connection_lost),  # hung up before answering
        (b"SSH-2.0-OpenSSH\r\n\r\n", LegFailure.bad_response),  # not HTTP
    ],
    ids=["hang-up", "not-http"],
)
async def test_a_failed_answer_is_classified(
    session: aiohttp.ClientSession, reply: bytes, failure: LegFailure
) -> None:
    server, url = await serve(answer_raw(reply))
    async with server:
        with pytest.raises(aiohttp.ClientError) as info:
            await session.post(url, data=b"{}")
    assert classify(info.value) is failure


class KeepAliveServer:
    """Serves request after request on each connection and counts connections.
    `answer(body)` is what it writes back; `idle_s`: it closes a connection that
    waited that long for its next request, as uvicorn's keep-alive does."""

    def __init__(self, answer: Callable[[bytes], bytes], idle_s: float | None = None) -> None:
        self.answer = answer
        self.idle_s = idle_s
        self.connections = 0

    async def handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while True:
            try:
                body = await asyncio.wait_for(read_request(reader), self.idle_s)
            except (TimeoutError, asyncio.IncompleteReadError):
                break
            writer.write(self.answer(body))
            await writer.drain()
        writer.close()


def one_line_stream(body: bytes) -> bytes:
    """A chunked answer with one line; it ends only when the request said "whole"
    (else it stays open, as a token stream does)."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nline1\n\r\n"
    return head + (b"0\r\n\r\n" if body.endswith(b"whole") else b"")


async def test_a_half_read_stream_is_not_reused_a_whole_one_is(
    session: aiohttp.ClientSession,
) -> None:
    counting = KeepAliveServer(one_line_stream)
    server, url = await serve(counting.handler)
    async with server:
        resp = await session.post(url, data=b"whole")
        assert [line async for line in response_lines(resp)] == ["line1"]
        close_response(resp)
        resp = await session.post(url, data=b"whole")
        assert counting.connections == 1  # the whole body was read: the connection was reused
        await resp.read()
        close_response(resp)
        resp = await session.post(url, data=b"half")
        lines = response_lines(resp)
        assert await anext(lines) == "line1"
        close_response(resp)  # half read: the connection is closed, not pooled
        resp = await session.post(url, data=b"whole")
        await resp.read()
        close_response(resp)
    assert counting.connections == 2


async def test_an_idle_connection_is_dropped_before_the_worker_drops_it() -> None:
    """The worker closes an idle connection after 1 s; the router's event loop is
    busy (blocked) for 1.2 s, so that close is not read yet when the next leg
    goes out. A pool that reused the connection would fail that leg with
    "Server disconnected"; with the shorter keep-alive it opens a new one."""
    counting = KeepAliveServer(
        lambda _: b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", idle_s=1.0
    )
    server, url = await serve(counting.handler)
    legs = leg_session(max_connections=8, connect_timeout_s=2.0, headers={}, keepalive_s=0.5)
    async with server, legs:
        for _ in range(2):
            resp = await legs.post(url, data=b"{}")
            assert await resp.read() == b"ok"
            close_response(resp)
            time.sleep(1.2)  # noqa: ASYNC251 - a loop too busy to see the close
    assert counting.connections == 2


class TrailingTerminator(KeepAliveServer):
    """Streams `data: 1` and `data: [DONE]`, then the chunked terminator `delay_s`
    later in a write of its own (as a worker's last segment can come)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(lambda _: b"")
        self.delay_s = delay_s
        self.handlers: list[asyncio.Task[None]] = []

    async def stop(self) -> None:
        """End the handlers still writing (a delay past the test's end)."""
        for task in self.handlers:
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)

    async def handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.append(task)
        try:
            await self.serve_connection(reader, writer)
        finally:
            writer.close()

    async def serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                break
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for event in (b"data: 1\n\n", b"data: [DONE]\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(self.delay_s)
            writer.write(b"0\r\n\r\n")
            await writer.drain()


async def read_to_done(resp: aiohttp.ClientResponse) -> None:
    async for line in response_lines(resp):
        if line == "data: [DONE]":
            return
    raise AssertionError("no [DONE]")


@contextlib.asynccontextmanager
async def trailing_server(delay_s: float) -> AsyncIterator[tuple[TrailingTerminator, str]]:
    trailing = TrailingTerminator(delay_s)
    server, url = await serve(trailing.handler)
    async with server:
        yield trailing, url
        await trailing.stop()


async def test_a_stream_finished_after_its_done_is_reused(
    session: aiohttp.ClientSession,
) -> None:
    async with trailing_server(delay_s=0.05) as (trailing, url):
        for _ in range(3):
            resp = await session.post(url, data=b"{}")
            await read_to_done(resp)
            assert not resp.content.at_eof()  # the terminator is still on its way
            await finish_response(resp)
    assert trailing.connections == 1


async def test_a_stream_that_does_not_end_after_its_done_is_closed(
    session: aiohttp.ClientSession,
) -> None:
    async with trailing_server(delay_s=5.0) as (trailing, url):
        resp = await session.post(url, data=b"{}")
        await read_to_done(resp)
        started = time.monotonic()
        await finish_response(resp, timeout_s=0.1)
        assert time.monotonic() - started < 2.0
        resp = await session.post(url, data=b"{}")
        await read_to_done(resp)
        close_response(resp)
    assert trailing.connections == 2
