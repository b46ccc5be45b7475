"""The worker's front check as plain ASGI (`runtime/http/guard.py`).

Driven with hand-made ASGI messages, so each case says exactly what the
client sent and what reached the app behind the guard. The worker API's own
answers (401/403/413 through a real server) are in test_worker_security.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdcluster.runtime.http.guard import GuardSettings, RequestGuard
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.server.worker_app import WorkerInfo, create_worker_app

TOKEN = "guard-token"


class Echo:
    """An ASGI app that records every message it received, then answers 200."""

    def __init__(self) -> None:
        self.calls = 0
        self.received: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += 1
        if scope["type"] == "lifespan":
            self.received.append(await receive())
            return
        while True:
            message = await receive()
            self.received.append(message)
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def http_scope(path: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http", "method": "POST", "path": path, "headers": raw, "query_string": b""}


def run(app: Any, scope: dict[str, Any], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call `app` once; `messages` are what the client sends, in order."""
    queue = list(messages)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)  # a client that sends nothing more
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 5))
    return sent


def chunk(body: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


def guard(app: Any, **settings: Any) -> tuple[RequestGuard, list[str]]:
    rejected: list[str] = []
    return RequestGuard(app, GuardSettings(**settings), rejected.append), rejected


def status_and_body(sent: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body)


def test_a_chunked_body_reaches_the_app_once_whole_then_the_disconnect_passes_through() -> None:
    echo = Echo()
    app, rejected = guard(echo, max_body_bytes=100)
    messages = [chunk(b'{"a":', True), chunk(b"1}", False), {"type": "http.disconnect"}]
    sent = run(app, http_scope("/generate"), messages)
    assert echo.received[0] == chunk(b'{"a":1}', False)
    assert sent[0]["status"] == 200 and rejected == []

    # The app asking again gets the client's next message, not the body twice.
    class TwoReads(Echo):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            self.received += [await receive(), await receive()]
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    twice = TwoReads()
    run(guard(twice)[0], http_scope("/generate"), messages)
    assert twice.received == [chunk(b'{"a":1}', False), {"type": "http.disconnect"}]


def test_a_chunked_body_over_the_limit_is_refused_before_the_app_runs() -> None:
    echo = Echo()
    app, rejected = guard(echo, max_body_bytes=10)
    sent = run(app, http_scope("/generate"), [chunk(b"x" * 8, True), chunk(b"x" * 8, True)])
    status, body = status_and_body(sent)
    assert (status, body["error"]["code"]) == (413, 413)
    assert "over 10 bytes" in body["error"]["message"]
    assert echo.calls == 0 and rejected == ["body_too_large"]


def test_a_malformed_content_length_is_a_400() -> None:
    echo = Echo()
    app, rejected = guard(echo)
    sent = run(app, http_scope("/generate", {"content-length": "12x"}), [chunk(b"{}", False)])
    assert status_and_body(sent)[0] == 400
    assert echo.calls == 0 and rejected == ["bad_request"]


def test_a_client_gone_before_its_body_ended_reaches_nothing_and_gets_no_answer() -> None:
    echo = Echo()
    app, rejected = guard(echo)
    sent = run(app, http_scope("/generate"), [chunk(b"{", True), {"type": "http.disconnect"}])
    assert sent == [] and echo.calls == 0 and rejected == []


def test_the_token_is_checked_on_guarded_paths_only_and_before_the_body_is_read() -> None:
    echo = Echo()
    app, rejected = guard(echo, token=TOKEN)
    # No body message at all: a refusal must not wait for one.
    sent = run(app, http_scope("/generate"), [])
    status, body = status_and_body(sent)
    assert (status, body["error"]["code"]) == (401, 401)
    assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    wrong = run(app, http_scope("/v1/completions", {"authorization": "Bearer nope"}), [])
    assert status_and_body(wrong)[0] == 403
    assert rejected == ["unauthorized", "unauthorized"] and echo.calls == 0
    right = run(
        app, http_scope("/generate", {"authorization": f"Bearer {TOKEN}"}), [chunk(b"", False)]
    )
    health = run(app, http_scope("/health"), [chunk(b"", False)])
    assert right[0]["status"] == health[0]["status"] == 200 and echo.calls == 2
    opened, _ = guard(echo, token=TOKEN, data_plane_open=True)
    assert run(opened, http_scope("/generate"), [chunk(b"", False)])[0]["status"] == 200
    assert status_and_body(run(opened, http_scope("/server_info"), []))[0] == 401


def test_lifespan_messages_pass_through_untouched() -> None:
    echo = Echo()
    run(guard(echo, token=TOKEN)[0], {"type": "lifespan"}, [{"type": "lifespan.startup"}])
    assert echo.received == [{"type": "lifespan.startup"}]


class _NoBackend:
    role = "null"


def test_a_worker_request_runs_in_the_servers_own_task() -> None:
    """No middleware task between the server and the handler (the per-request
    cost a `@app.middleware("http")` guard paid on every token stream)."""
    seen: dict[str, Any] = {}

    def routes(app: FastAPI) -> None:
        async def where(request: Request) -> JSONResponse:
            seen["task"] = asyncio.current_task()
            seen["body"] = await request.body()
            return JSONResponse({})

        app.add_api_route("/probe", where, methods=["POST"])

    app = create_worker_app(
        _NoBackend(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        WorkerInfo("tiny", "tiny", 10, 10, 10),
        WorkerMetrics("null"),
        extra_routes=routes,
    )

    sent: list[dict[str, Any]] = []

    async def main() -> None:
        seen["server_task"] = asyncio.current_task()
        queue = [chunk(b'{"x":1}', False)]

        async def receive() -> dict[str, Any]:
            if queue:
                return queue.pop(0)
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(http_scope("/probe"), receive, send)

    asyncio.run(asyncio.wait_for(main(), 5))
    assert sent[0]["status"] == 200
    assert seen["body"] == b'{"x":1}'
    assert seen["task"] is seen["server_task"]
