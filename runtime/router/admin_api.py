"""The router's admin API, for the supervisor of its workers (local mode).

Guarded by the cluster token (403 when the router has none):

- ``POST /admin/hold_worker`` and ``POST /admin/admit_worker``
  ``{"url": worker URL, "reason"?: str}``: a supervisor that saw a worker die
  keeps it out of the pool until it has restarted it (a probe cannot
  readmit a held worker);
- ``POST /admin/add_worker`` ``{"url", "role", "kv_events"?: {"publish",
  "replay"}}``: local-mode autoscaling adds a started instance (it serves
  after its first good probe); `kv_events` names the ports a vLLM worker
  publishes its prefix-cache events on (cache_aware);
- ``POST /admin/remove_worker`` ``{"url"}``: a drained instance leaves the
  pool (409 while legs are still in flight on it);
- ``GET /admin/settings``: the live settings in force (`live_settings.py`);
  ``PUT /admin/settings`` with new ones (the manifest's camelCase fields:
  ``{"policy": {...}, "healthCheckIntervalSeconds"}``, each defaulted when
  left out, as in the manifest): 400 naming the field on a bad value, 409
  for a change that needs a restart; either way nothing changes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from pdcluster.runtime.http.auth import check_bearer
from pdcluster.runtime.http.limits import BadLength, BodyTooLarge, read_limited
from pdcluster.runtime.router.bodies import parse_json_object
from pdcluster.runtime.router.errors import CLIENT_CLOSED_REQUEST, RouterError
from pdcluster.runtime.router.live_settings import LiveSettingsRefused, RouterLiveSettings
from pdcluster.runtime.router.workers import KVEventPorts, Worker, normalize_url
from pdcluster.runtime.spec import Role

if TYPE_CHECKING:
    from pdcluster.runtime.router.app import RouterState

log = logging.getLogger(__name__)

_MAX_ADMIN_BODY = 4096


async def read_body(request: Request, limit: int) -> bytes:
    """A request's body, at most `limit` bytes (400 or 413 as `RouterError`)."""
    try:
        return await read_limited(request.stream(), request.headers.get("content-length"), limit)
    except BadLength as err:
        raise RouterError(400, str(err), reason="bad_length") from None
    except BodyTooLarge:
        raise RouterError(
            413, f"request body is over the {limit}-byte limit", reason="body_too_large"
        ) from None


def _check_token(state: RouterState, request: Request) -> None:
    token = state.config.worker_token
    if not token:
        raise RouterError(403, "the router has no cluster token: its admin API is off")
    denied = check_bearer(request.headers.get("authorization"), token)
    if denied is not None:
        raise RouterError(denied.status, denied.message, reason="unauthorized")


async def _admin_body(state: RouterState, request: Request) -> dict[str, Any] | None:
    """The JSON body of an admin call once its token is checked (None: client left)."""
    _check_token(state, request)
    try:
        return parse_json_object(await read_body(request, _MAX_ADMIN_BODY))
    except ClientDisconnect:
        return None


def _kv_events(raw: object) -> KVEventPorts | None:
    if raw is None:
        return None
    publish = raw.get("publish") if isinstance(raw, dict) else None
    replay = raw.get("replay") if isinstance(raw, dict) else None
    if not isinstance(publish, int) or not isinstance(replay, int):
        raise RouterError(422, "kv_events must be {publish: port, replay: port}")
    try:
        return KVEventPorts(publish, replay)
    except ValueError as err:
        raise RouterError(422, str(err)) from None


async def add_worker(state: RouterState, request: Request) -> JSONResponse:
    """`/admin/add_worker {url, role, kv_events?}`: a new instance; probed at once."""
    body = await _admin_body(state, request)
    if body is None:
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
    disaggregated = state.config.is_disaggregated
    roles = (Role.prefill, Role.decode) if disaggregated else (Role.colocated,)
    names = [r.value for r in roles]
    url, role = body.get("url"), body.get("role")
    if not isinstance(url, str) or role not in names:
        raise RouterError(422, f"body must be {{url: str, role: one of {names}}}")
    kv_events = _kv_events(body.get("kv_events"))
    try:
        worker = state.pool.add(url, Role(role), kv_events=kv_events)
    except ValueError as err:
        raise RouterError(409 if "in the pool as" in str(err) else 422, str(err)) from None
    assert state.ctx is not None and state.checker is not None
    log.info("worker %s (%s) added by its supervisor", worker.url, worker.role)
    state.ctx.spawn(state.checker.probe(worker))
    return JSONResponse(worker.describe())


def _pool_worker(state: RouterState, url: str) -> Worker:
    """The pool's worker at an admin body's `url`: 422 if it is not a URL, 404 if unknown."""
    try:
        worker = state.pool.get(normalize_url(url))
    except ValueError as err:
        raise RouterError(422, str(err)) from None
    if worker is None:
        raise RouterError(404, f"no worker {url} in the pool")
    return worker


async def remove_worker(state: RouterState, request: Request) -> JSONResponse:
    """`/admin/remove_worker {url}`: a drained instance leaves the pool."""
    body = await _admin_body(state, request)
    if body is None:
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
    url = body.get("url")
    if not isinstance(url, str):
        raise RouterError(422, "body must be {url: str}")
    worker = _pool_worker(state, url)
    try:
        state.pool.remove(worker)
    except ValueError as err:
        raise RouterError(409, str(err)) from None
    if worker.healthy:
        worker.healthy = False
        state.on_transition(worker, False)
    log.info("worker %s (%s) removed by its supervisor", worker.url, worker.role)
    return JSONResponse(worker.describe())


async def hold(state: RouterState, request: Request, *, held: bool) -> JSONResponse:
    """`/admin/hold_worker` (held) and `/admin/admit_worker`."""
    body = await _admin_body(state, request)
    if body is None:
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
    url, reason = body.get("url"), body.get("reason", "held out by its supervisor")
    if not isinstance(url, str) or not isinstance(reason, str) or len(reason) > 256:
        raise RouterError(422, "body must be {url: str, reason?: str}")
    worker = _pool_worker(state, url)
    assert state.ctx is not None and state.checker is not None
    if held:
        if state.pool.hold_out(worker, reason):
            log.warning("worker %s (%s) held out: %s", worker.url, worker.role, reason)
            state.on_transition(worker, False)
    else:
        state.pool.let_in(worker)
        log.info("worker %s (%s) admitted again", worker.url, worker.role)
        state.ctx.spawn(state.checker.probe(worker))
    return JSONResponse(worker.describe())


def _validation_message(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return f"{where}: {first['msg']}"


async def put_settings(state: RouterState, request: Request) -> JSONResponse:
    """`PUT /admin/settings`: new live settings, all validated before any is applied."""
    body = await _admin_body(state, request)
    if body is None:
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
    try:
        live = RouterLiveSettings.model_validate(body)
    except ValidationError as err:
        raise RouterError(400, _validation_message(err), reason="bad_settings") from None
    try:
        state.apply_live_settings(live)
    except LiveSettingsRefused as err:
        raise RouterError(409, str(err), reason="needs_restart") from None
    log.info("live settings applied: %s", live.model_dump(mode="json", by_alias=True))
    return JSONResponse(
        RouterLiveSettings.from_config(state.config).model_dump(mode="json", by_alias=True)
    )


def add_admin_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/admin/settings")
    async def get_settings(request: Request) -> JSONResponse:
        _check_token(state, request)
        live = RouterLiveSettings.from_config(state.config)
        return JSONResponse(live.model_dump(mode="json", by_alias=True))

    @app.put("/admin/settings")
    async def settings(request: Request) -> JSONResponse:
        return await put_settings(state, request)

    @app.post("/admin/hold_worker")
    async def hold_worker(request: Request) -> JSONResponse:
        return await hold(state, request, held=True)

    @app.post("/admin/admit_worker")
    async def admit_worker(request: Request) -> JSONResponse:
        return await hold(state, request, held=False)

    @app.post("/admin/add_worker")
    async def add(request: Request) -> JSONResponse:
        return await add_worker(state, request)

    @app.post("/admin/remove_worker")
    async def remove(request: Request) -> JSONResponse:
        return await remove_worker(state, request)
