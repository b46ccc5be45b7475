"""The worker's front check as plain ASGI: the cluster token, then the body limit.

`RequestGuard` wraps an ASGI app. For each HTTP request it
1. checks `Authorization: Bearer <token>` on the paths `auth.is_guarded`
   names (missing → 401 with `WWW-Authenticate: Bearer`, wrong → 403);
   an unauthenticated client gets no further than its headers;
2. reads the whole body, counted while it streams in (`read_limited`: a
   chunked body has no Content-Length to check) → 413 over the limit, 400
   for a malformed Content-Length;
3. hands the request on with a `receive` that replays the body once, then
   passes every later message (the client's disconnect) through.

Why not `@app.middleware("http")`: Starlette runs such a middleware in its
own task with a memory stream between it and the app, once per request,
on the path of every token stream. This guard is one coroutine frame.

A refusal is JSON `{"error": {"message", "type", "code"}}` and calls
`on_reject(reason)` with `unauthorized`, `body_too_large` or `bad_request`
(the metric label). A client that disconnects before its body is complete
gets no answer and reaches nothing behind the guard.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdcluster.runtime.http.auth import check_bearer, is_guarded
from pdcluster.runtime.http.limits import BadLength, BodyTooLarge, read_limited
from pdcluster.runtime.http.middleware import HttpMiddleware


@dataclass(frozen=True)
class GuardSettings:
    token: str = ""  # the cluster token; "" turns the token check off
    data_plane_open: bool = False  # `auth.workerApi: open`: /generate, /v1/* need no token
    max_body_bytes: int = 8 << 20


class _Disconnected(Exception):
    pass


def _error(message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return JSONResponse(body, status, headers=headers)


async def _body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


class RequestGuard(HttpMiddleware):
    def __init__(
        self, app: ASGIApp, settings: GuardSettings, on_reject: Callable[[str], None]
    ) -> None:
        super().__init__(app)
        self.settings = settings
        self.on_reject = on_reject

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        cfg = self.settings
        if cfg.token and is_guarded(scope["path"], data_plane_open=cfg.data_plane_open):
            denied = check_bearer(_header(scope, b"authorization"), cfg.token)
            if denied is not None:
                self.on_reject("unauthorized")
                headers = {"WWW-Authenticate": "Bearer"} if denied.status == 401 else None
                await _error(denied.message, denied.status, headers)(scope, receive, send)
                return
        try:
            body = await read_limited(
                _body_chunks(receive), _header(scope, b"content-length"), cfg.max_body_bytes
            )
        except _Disconnected:
            return
        except BodyTooLarge:
            self.on_reject("body_too_large")
            message = f"request body over {cfg.max_body_bytes} bytes"
            await _error(message, 413)(scope, receive, send)
            return
        except BadLength as err:
            self.on_reject("bad_request")
            await _error(str(err), 400)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
