"""The base of our ASGI middlewares: they see HTTP requests only.

Other scopes (lifespan, websocket) pass to the wrapped app untouched, so a
middleware's `handle` may read `path`, headers and the body without asking.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class HttpMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request."""
        raise NotImplementedError
