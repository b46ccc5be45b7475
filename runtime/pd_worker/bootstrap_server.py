"""HTTP bootstrap server of one prefill instance (hosted by its rank 0).

`create_bootstrap_app(expected_topology, token)` returns a FastAPI app over a
`BootstrapRegistry`:

| route | auth | answers |
| --- | --- | --- |
| `PUT /route` | token | register a rank (`RankRegistration` JSON); 400 naming the field |
| `GET /route?dp=-1&cp=-1&tp=-1&pp=-1` | token | `InstanceInfo`, or 503 `{registered, expected}` |
| `GET /route?dp=..&cp=..&tp=..&pp=..` | token | `{rank, endpoint}`; 404 unknown; 400 bad params |
| `POST /register_dp_rank` | token | `{room, dp_rank}` → room's dp group (expires) |
| `POST /query_dp_ranks` | token | `{rooms: [...]}` → `{dp_ranks: {"room": dp}}` |
| `GET /health` | open | `{status, registered, expected, start}` |

Auth is `Authorization: Bearer <token>`: missing → 401, wrong → 403, and
nothing changes. Bodies over `MAX_BODY_BYTES` → 413 (checked while reading,
so a body without Content-Length cannot grow memory). Every error body is
`{"error": message, "field": name-or-null}`.

`start` is this process's start id, random per app (one app per process):
a decode holding the instance lost (a definitive report) uses it again at
once when a probe finds another start answering at the same address — a
restart, never the old process still answering (peer_liveness.py).

All routes are `async` and the registry is only touched from the event
loop, so requests are serialized without a lock.

`BootstrapServer` runs the app with uvicorn on a background thread (rank 0
hosts it next to its own work; tests use it on 127.0.0.1 with port 0).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdcluster.runtime.http.background import BackgroundServer
from pdcluster.runtime.http.limits import BodyTooLarge, read_limited
from pdcluster.runtime.pd.bootstrap_registry import (
    BootstrapRegistry,
    NotReady,
    RankRegistration,
    RegistryError,
)
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.messages import MAX_ROOM
from pdcluster.runtime.pd.topology import shape_of

MAX_BODY_BYTES = 64 * 1024
_T = TypeVar("_T")
MAX_QUERY_ROOMS = 4096

Room = Annotated[int, msgspec.Meta(ge=0, le=MAX_ROOM)]


class DpRankEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    room: Room
    dp_rank: Annotated[int, msgspec.Meta(ge=0)]


class DpRankQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rooms: Annotated[list[Room], msgspec.Meta(max_length=MAX_QUERY_ROOMS)]


class _HttpError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(obj), status_code=status, media_type="application/json", headers=headers
    )


def _error(err: _HttpError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return _json({"error": err.message, "field": err.field}, err.status, headers)


def _authorize(request: Request, token: str | None) -> None:
    if token is None:
        return
    header = request.headers.get("authorization")
    if not header:
        raise _HttpError(401, "missing Authorization: Bearer <cluster token>")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        raise _HttpError(403, "wrong cluster token")


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        declared = None  # the HTTP parser refuses a malformed length before this
    try:
        return await read_limited(request.stream(), declared, MAX_BODY_BYTES)
    except BodyTooLarge:
        raise _HttpError(413, f"body exceeds {MAX_BODY_BYTES} bytes") from None


def _parse(body: bytes, kind: type[_T]) -> _T:
    if not body:
        raise _HttpError(400, "missing JSON body")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as err:
        text = str(err)
        field = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        if field is None and "missing required field `" in text:
            field = text.split("missing required field `", 1)[1].split("`", 1)[0]
        raise _HttpError(400, f"invalid body: {text}", field) from None
    except msgspec.DecodeError as err:
        raise _HttpError(400, f"body is not valid JSON: {err}") from None


def _query_coords(request: Request) -> tuple[int, int, int, int]:
    values = []
    for name in ("dp", "cp", "tp", "pp"):
        raw = request.query_params.get(name)
        if raw is None:
            raise _HttpError(400, f"missing query parameter {name}", name)
        try:
            value = int(raw)
        except ValueError:
            raise _HttpError(
                400, f"query parameter {name}={raw!r} is not an integer", name
            ) from None
        if value < -1 or value >= 1 << 20:
            raise _HttpError(400, f"query parameter {name}={value} out of range", name)
        values.append(value)
    return values[0], values[1], values[2], values[3]


def create_bootstrap_app(
    expected_topology: Any,
    token: str | None,
    *,
    dp_entry_ttl_s: float = 300.0,
    clock: Callable[[], float] = time.monotonic,
    start_id: str | None = None,
) -> FastAPI:
    """The bootstrap app for an instance of `expected_topology` (anything with dp/cp/tp/pp).

    `token=None` disables auth (only for trusted test setups). `start_id`:
    what `/health` names this start by (default: a fresh random id).
    """
    start = start_id or secrets.token_hex(8)
    shape = (
        expected_topology
        if isinstance(expected_topology, InstanceShape)
        else shape_of(expected_topology)
    )
    registry = BootstrapRegistry(shape, dp_entry_ttl_s=dp_entry_ttl_s)
    app = FastAPI(title="pdcluster bootstrap", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry = registry

    def guarded(
        handler: Callable[[Request], Any], *, auth: bool = True
    ) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    _authorize(request, token)
                result: Response = await handler(request)
                return result
            except _HttpError as err:
                return _error(err)
            except NotReady as err:
                body = {"error": str(err), "registered": err.registered, "expected": err.expected}
                return _json(body, 503)
            except RegistryError as err:
                return _error(_HttpError(err.status, str(err), err.field))

        return endpoint

    async def put_route(request: Request) -> Response:
        reg = _parse(await _read_body(request), RankRegistration)
        is_new = registry.register(reg)
        body = {
            "new": is_new,
            "registered": registry.num_registered,
            "expected": registry.num_expected,
        }
        return _json(body)

    async def get_route(request: Request) -> Response:
        dp, cp, tp, pp = _query_coords(request)
        coords = (dp, cp, tp, pp)
        if all(v == -1 for v in coords):
            return _json(registry.instance_info())
        if any(v == -1 for v in coords):
            raise _HttpError(400, "use -1 for all of dp, cp, tp, pp (instance) or for none (rank)")
        return _json(registry.rank_address(RankCoord(dp=dp, cp=cp, tp=tp, pp=pp)))

    async def register_dp_rank(request: Request) -> Response:
        entry = _parse(await _read_body(request), DpRankEntry)
        registry.register_dp_rank(entry.room, entry.dp_rank, clock())
        return _json({"ok": True})

    async def query_dp_ranks(request: Request) -> Response:
        query = _parse(await _read_body(request), DpRankQuery)
        found = registry.query_dp_ranks(query.rooms, clock())
        return _json({"dp_ranks": {str(room): dp for room, dp in found.items()}})

    async def health(request: Request) -> Response:
        body = {
            "status": "ok",
            "registered": registry.num_registered,
            "expected": registry.num_expected,
            "start": start,
        }
        return _json(body)

    app.add_api_route("/route", guarded(put_route), methods=["PUT"])
    app.add_api_route("/route", guarded(get_route), methods=["GET"])
    app.add_api_route("/register_dp_rank", guarded(register_dp_rank), methods=["POST"])
    app.add_api_route("/query_dp_ranks", guarded(query_dp_ranks), methods=["POST"])
    app.add_api_route("/health", guarded(health, auth=False), methods=["GET"])
    return app


class BootstrapServer(BackgroundServer):
    """Serve an app with uvicorn on a background thread; `port=0` picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(app, host, port, name="bootstrap-server")

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
