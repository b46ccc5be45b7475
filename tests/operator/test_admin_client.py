"""The operator's client of the workers' admin API reads bounded answers only."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from pdcluster.operator.failover.admin_client import AdminClient

LIMIT = 64 * 1024


class Endless(httpx.AsyncByteStream):
    """A body that never ends (a worker streaming garbage); counts what was read."""

    def __init__(self) -> None:
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            self.sent += 4096
            yield b"x" * 4096


def client(handler) -> AdminClient:  # type: ignore[no-untyped-def]
    return AdminClient(2.0, max_response_bytes=LIMIT, transport=httpx.MockTransport(handler))


async def test_an_endless_failures_answer_is_cut_at_the_limit_and_counts_as_none() -> None:
    stream = Endless()
    admin = client(lambda request: httpx.Response(200, stream=stream))
    try:
        assert await admin.failures("http://10.0.0.1:8000", "tok") is None
    finally:
        await admin.aclose()
    assert LIMIT < stream.sent <= LIMIT + 2 * 4096  # stopped reading just past the limit


async def test_a_declared_oversized_answer_is_not_read_at_all() -> None:
    stream = Endless()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-length": str(10 * LIMIT)}, stream=stream)

    admin = client(handler)
    try:
        assert await admin.failures("http://10.0.0.1:8000", "tok") is None
    finally:
        await admin.aclose()
    assert stream.sent == 0


async def test_answers_under_the_limit_are_read_and_errors_are_capped() -> None:
    body = json.dumps({"failures": {"room_failed:timeout": 3}}).encode()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/failures":
            assert request.headers["authorization"] == "Bearer tok"
            return httpx.Response(200, content=body)
        return httpx.Response(500, stream=Endless())

    admin = client(handler)
    try:
        assert await admin.failures("http://w:8000", "tok") == {"timeout": 3}
        result = await admin.fail_peer("http://w:8000", "tok", "10.0.0.2:8998", "lost")
    finally:
        await admin.aclose()
    assert not result.ok and result.status == 500 and "bytes" in result.error
