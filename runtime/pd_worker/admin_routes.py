"""The admin API of a PD worker, for whatever engine serves it (ours, or vLLM with our connector).

Token-protected; the operator's and the local supervisor's fast path:
- `POST /admin/fail_peer {"peer": "host:port" | endpoint, "reason": str, "gone": bool,
  "incarnation": str}` —
  fail every room tied to that peer on every rank now; `gone: false` (the
  peer may be hung, not dead) keeps those rooms' pages on a one-sided
  transport until the peer acks or is reported gone (admin_body.py);
- `PUT /admin/prefill_peers {"peers": ["host:port", ...]}` (decode) — replace
  the set of prefill bootstrap servers this worker may contact
  (known_peers.py); the operator sends it whenever the prefill pods change;
- `GET /admin/rooms` — rooms with state, age and peers;
- `GET /admin/failures` — failure counts (`?scope=group`: this dp group only).

Each route relays a change to the other dp groups' leaders (`dp_urls`) when
the worker is an instance's front. What a route does to the rooms is the
`AdminTarget`'s: our workers broadcast to their dp group's ranks, the vLLM
connector hands it to its scheduler half for the next step.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdcluster.runtime.http.auth import bearer_headers, check_bearer
from pdcluster.runtime.pd.known_peers import KnownPeers, PeerSetError, parse_peers_body
from pdcluster.runtime.pd_worker.admin_body import (
    FailPeerBodyError,
    FailPeerRequest,
    parse_fail_peer,
)

log = logging.getLogger("pdcluster.pd")


class AdminTarget(Protocol):
    """What the admin routes act on."""

    def fail_peer(self, call: FailPeerRequest) -> None:
        """Fail every room tied to `call.peer` on every rank (any thread)."""

    def room_views(self, now: float) -> list[dict[str, Any]]:
        """The rooms, one dict each."""

    def failures(self, scope: str | None) -> Awaitable[dict[str, Any]]:
        """Failure counts (`scope="group"`: this dp group only)."""


class PeerSetHolder(Protocol):
    """Where a decode worker keeps the prefill peers it may contact."""

    known: KnownPeers


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status)


def admin_routes(
    target: AdminTarget, token: str, dp_urls: tuple[str, ...] = ()
) -> Callable[[FastAPI], None]:
    """`fail_peer`, `rooms` and `failures` on an app (see the module doc)."""

    def authorized(request: Request) -> JSONResponse | None:
        if not token:
            return None
        got = request.headers.get("authorization", "")
        if not got:
            return _error("missing token", 401)
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            return _error("wrong token", 403)
        return None

    def add(app: FastAPI) -> None:
        @app.post("/admin/fail_peer")
        async def fail_peer(request: Request) -> JSONResponse:
            denied = authorized(request)
            if denied is not None:
                return denied
            try:
                call = parse_fail_peer(await request.json())
            except FailPeerBodyError as err:
                return _error(err.message, err.status)
            except ValueError:  # not JSON at all
                return _error("body must be {peer, reason?, gone?}", 422)
            log.warning(
                "admin: fail_peer %s (%s, %s, incarnation %s)",
                call.peer,
                call.reason,
                "gone" if call.gone else "may resume",
                call.incarnation,
            )
            target.fail_peer(call)
            # Other dp groups have their own tables: relay to their leaders.
            headers = {"authorization": request.headers.get("authorization", "")}
            async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
                for base in dp_urls:
                    try:
                        await client.post(
                            f"{base}/admin/fail_peer", json=call.to_json(), headers=headers
                        )
                    except httpx.HTTPError as err:
                        log.warning("fail_peer relay to dp leader %s failed: %s", base, err)
            return JSONResponse(call.to_json())

        @app.get("/admin/rooms")
        async def rooms(request: Request) -> JSONResponse:
            denied = authorized(request)
            if denied is not None:
                return denied
            return JSONResponse({"rooms": target.room_views(time.monotonic())})

        @app.get("/admin/failures")
        async def failures(request: Request) -> JSONResponse:
            denied = authorized(request)
            if denied is not None:
                return denied
            return JSONResponse(await target.failures(request.query_params.get("scope")))

    return add


def prefill_peers_route(
    holder: PeerSetHolder, token: str, dp_urls: tuple[str, ...] = ()
) -> Callable[[FastAPI], None]:
    """`PUT /admin/prefill_peers {"peers": ["host:port", ...]}`: replace the known set."""

    def add(app: FastAPI) -> None:
        @app.put("/admin/prefill_peers")
        async def prefill_peers(request: Request) -> JSONResponse:
            if token:
                denied = check_bearer(request.headers.get("authorization"), token)
                if denied is not None:
                    return _error(denied.message, denied.status)
            try:
                peers = parse_peers_body(json.loads(await request.body()))
            except (PeerSetError, ValueError) as err:
                msg = str(err) if isinstance(err, PeerSetError) else "body is not JSON"
                return _error(msg, 400)
            if peers != holder.known.peers:
                log.info("admin: prefill peers now %s", ", ".join(sorted(peers)) or "(none)")
            holder.known = holder.known.replaced(peers)
            # Other dp groups check their own requests: relay to their leaders.
            async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
                for base in dp_urls:
                    try:
                        await client.put(
                            f"{base}/admin/prefill_peers",
                            json={"peers": sorted(peers)},
                            headers=bearer_headers(token),
                        )
                    except httpx.HTTPError as err:
                        log.warning("prefill_peers relay to dp leader %s failed: %s", base, err)
            return JSONResponse({"peers": sorted(peers)})

    return add
