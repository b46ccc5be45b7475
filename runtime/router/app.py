"""The router's HTTP front door: `create_router_app(config) -> FastAPI`.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (stream and not),
``/v1/models``, ``/generate`` (SGLang passthrough), ``/health``, ``/metrics``,
and, guarded by the cluster token, ``POST /admin/hold_worker`` and
``POST /admin/admit_worker`` ``{"url": worker URL, "reason"?: str}``: a
supervisor that saw a worker die keeps it out of the pool until it has
restarted it (local mode; a probe cannot readmit a held worker);
``POST /admin/add_worker`` ``{"url", "role"}`` and ``POST
/admin/remove_worker`` ``{"url"}``: local-mode autoscaling adds a started
instance (it serves after its first good probe) and removes a drained one
(409 while legs are still in flight on it).
Handlers only read the body, validate, plan and hand the request to a
`Relay`; every error leaves as OpenAI-style JSON (or an SSE error event once
a stream has started).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdcluster.runtime import stage_trace
from pdcluster.runtime.http.auth import bearer_headers, check_bearer
from pdcluster.runtime.http.limits import BadLength, BodyTooLarge, read_limited
from pdcluster.runtime.http.middleware import HttpMiddleware
from pdcluster.runtime.router.bodies import ClientRequest, Endpoint, parse_json_object
from pdcluster.runtime.router.config import RouterConfig
from pdcluster.runtime.router.discovery import static_targets
from pdcluster.runtime.router.errors import (
    CLIENT_CLOSED_REQUEST,
    NoHealthyWorkerError,
    RouterError,
    error_body,
)
from pdcluster.runtime.router.health import HealthChecker
from pdcluster.runtime.router.kube_watch import KubernetesDiscovery
from pdcluster.runtime.router.leg_client import leg_session
from pdcluster.runtime.router.leg_plan import LegFlow, LegPlan, LegPlanner
from pdcluster.runtime.router.metrics import RouterMetrics
from pdcluster.runtime.router.off_loop import PromptReader, read_request
from pdcluster.runtime.router.policies import make_policy
from pdcluster.runtime.router.prefix_feed import PrefixFollower
from pdcluster.runtime.router.prefix_index import PrefixIndex
from pdcluster.runtime.router.prompt_ids import RouterTokenizer
from pdcluster.runtime.router.relay import Relay, RelayContext
from pdcluster.runtime.router.request_record import RequestRecord
from pdcluster.runtime.router.rooms import RandomSource, RidMinter
from pdcluster.runtime.router.streaming import (
    DISCONNECT_SCOPE_KEY,
    ClientDisconnected,
    ClientRelay,
    RelayStreamResponse,
    run_until_disconnect,
)
from pdcluster.runtime.router.vllm_relay import VllmRelay
from pdcluster.runtime.router.workers import Worker, WorkerPool, WorkerTarget, normalize_url
from pdcluster.runtime.spec import Role

log = logging.getLogger(__name__)

ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/generate",
        "/health",
        "/metrics",
        "/admin/hold_worker",
        "/admin/admit_worker",
        "/admin/add_worker",
        "/admin/remove_worker",
    }
)


class _MetricsMiddleware(HttpMiddleware):
    """Request count and latency of the routes FastAPI serves (the inference
    routes count their own, `RouterApp.serve_inference`)."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = 500
        start = time.perf_counter()

        async def send_and_see(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            if scope.get(DISCONNECT_SCOPE_KEY):
                status = CLIENT_CLOSED_REQUEST
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)


def _error_response(err: RouterError) -> JSONResponse:
    headers = {"x-request-id": err.rid} if err.rid else {}
    if err.retry_after is not None:
        headers["retry-after"] = err.retry_after
    return JSONResponse(err.body(), status_code=err.status, headers=headers or None)


async def _read_body(request: Request, limit: int) -> bytes:
    try:
        return await read_limited(request.stream(), request.headers.get("content-length"), limit)
    except BadLength as err:
        raise RouterError(400, str(err), reason="bad_length") from None
    except BodyTooLarge:
        raise RouterError(
            413, f"request body is over the {limit}-byte limit", reason="body_too_large"
        ) from None


class RouterState:
    """Everything one router app owns; created by `create_router_app`."""

    def __init__(self, config: RouterConfig, rng: RandomSource) -> None:
        self.config = config
        self.pool = WorkerPool(failure_threshold=config.health_failure_threshold)
        # Page keys each worker has cached, for cache_aware (`prefix_index.py`).
        self.prefix_index = PrefixIndex()
        roles = (Role.prefill, Role.decode) if config.is_disaggregated else (Role.colocated,)
        self.metrics = RouterMetrics(
            self.pool.all,
            self._indexed_pages if config.cache_aware_roles else None,
            roles=roles,
            cluster=config.cluster_name,
            ttft_slo_s=config.ttft_slo_s,
        )
        self.follower: PrefixFollower | None = None
        # Request tracing (`telemetry/tracing.py`); None: off.
        self.tracing: Any = None
        if config.tracing.enabled:
            from pdcluster.runtime.telemetry.tracing import start_tracing

            self.tracing = start_tracing(
                config.tracing,
                "pdcluster-router",
                {"pdcluster.cluster": config.cluster_name, "pdcluster.role": "router"},
            )
        self.leg_planner = LegPlanner(
            pool=self.pool,
            disaggregated=config.is_disaggregated,
            prefill_policy=self._policy(config.prefill_policy),
            decode_policy=self._policy(config.decode_policy),
            colocated_policy=self._policy(config.colocated_policy),
            rids=RidMinter(rng),
            rooms_source=rng,
            engine=config.engine,
            connector=config.kv_connector,
        )
        # cache_aware: the prompt, read and keyed off the loop (`off_loop.py`).
        self.prompts = (
            PromptReader(self.prefix_index, _load_tokenizer(config.tokenizer))
            if config.cache_aware_roles
            else None
        )
        self._api_keys = tuple(k.encode() for k in config.api_keys)
        self.started_at = int(time.time())
        self.ctx: RelayContext | None = None
        self.checker: HealthChecker | None = None
        self._discovery: KubernetesDiscovery | None = None
        # Set when a worker turns healthy or unhealthy: a waiting request re-plans.
        self._pool_changed = asyncio.Event()

    def _policy(self, name: str) -> Any:
        cfg = self.config
        return make_policy(
            name, cfg.policy_seed, index=self.prefix_index, max_load_gap=cfg.max_load_gap
        )

    def _indexed_pages(self, url: str) -> int | None:
        replica = self.prefix_index.replica(url)
        return None if replica is None else len(replica.keys)

    def _follow_workers(self) -> None:
        if self.follower is not None:
            self.follower.sync()

    # ------------------------------------------------------------ lifecycle
    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        cfg = self.config
        # trust_env=False: a proxy variable must never divert worker traffic.
        # Every call to a worker carries the cluster token (their data plane is guarded).
        headers = bearer_headers(cfg.worker_token)
        legs = leg_session(
            max_connections=cfg.max_connections,
            connect_timeout_s=cfg.connect_timeout_s,
            headers=headers,
        )
        control = httpx.AsyncClient(timeout=cfg.abort_timeout_s, trust_env=False, headers=headers)
        self.ctx = RelayContext(
            config=cfg, pool=self.pool, legs=legs, control=control, metrics=self.metrics
        )
        self.checker = HealthChecker(
            self.pool,
            control,
            interval_s=cfg.health_check_interval_s,
            timeout_s=cfg.health_check_timeout_s,
            on_transition=self._on_transition,
            reads_server_info=cfg.reads_server_info,
            reads_side_ports=cfg.uses_side_ports,
        )
        if cfg.kubernetes is None:
            self.pool.sync(
                static_targets(
                    cfg.prefill_urls, cfg.decode_urls, cfg.colocated_urls, cfg.side_ports
                )
            )
            await self.checker.probe_all()
        else:
            self._discovery = KubernetesDiscovery(
                cfg.kubernetes, self.apply_targets, asyncio.get_running_loop()
            )
            self._discovery.start()
        roles = cfg.cache_aware_roles
        if roles:
            self.follower = PrefixFollower(
                self.prefix_index,
                control,
                lambda: [w for w in self.pool.all() if w.role in roles],
                timeout_s=cfg.health_check_timeout_s,
            )
            self._follow_workers()
        health_loop = asyncio.create_task(self.checker.run())
        try:
            yield
        finally:
            health_loop.cancel()
            if self.follower is not None:
                await self.follower.close()
            if self._discovery is not None:
                self._discovery.stop()
            pending = list(self.ctx.tasks)
            for task in pending:
                task.cancel()
            await asyncio.gather(health_loop, *pending, return_exceptions=True)
            await legs.close()
            await control.aclose()
            if self.tracing is not None:
                self.tracing.shutdown()

    def apply_targets(self, targets: list[WorkerTarget]) -> None:
        """Discovery's view of the workers; new ones are probed at once."""
        try:
            change = self.pool.sync(targets)
        except ValueError as err:
            log.error("discovery produced an inconsistent worker set: %s", err)
            return
        for worker in change.removed:
            log.info("worker %s (%s) removed by discovery", worker.url, worker.role)
            self._prefill_lost(worker, "removed by discovery")
        self._follow_workers()
        if self.ctx is not None and self.checker is not None:
            for worker in change.added:
                self.ctx.spawn(self.checker.probe(worker))

    def _on_transition(self, worker: Worker, healthy: bool) -> None:
        to = "healthy" if healthy else "unhealthy"
        self.metrics.health_transitions.labels(worker.role.value, to).inc()
        self._pool_changed.set()
        self._follow_workers()
        if not healthy:
            self._prefill_lost(worker, worker.last_error or "unhealthy")

    def _prefill_lost(self, worker: Worker, reason: str) -> None:
        """Requests still waiting on this prefill's KV start again elsewhere (vLLM)."""
        if worker.role is not Role.prefill or self.ctx is None:
            return
        told = self.ctx.prefills.lost(worker, reason)
        if told:
            log.warning(
                "prefill %s lost (%s): %d request(s) moved off it", worker.url, reason, told
            )

    def _relay_for(self, plan: LegPlan, record: RequestRecord) -> ClientRelay:
        assert self.ctx is not None, "router app used outside its lifespan"
        if plan.flow is LegFlow.kv_params and plan.prefill is not None:
            return VllmRelay(self.ctx, plan, self.leg_planner.repick_prefill, record)
        return Relay(self.ctx, plan, record)

    async def _plan(self, client_request: ClientRequest) -> LegPlan:
        """Plan the legs; with no healthy worker but a new one still on its first
        probe (a rollout just swapped pods), wait up to the probe timeout for it."""
        assert self.ctx is not None
        prompt = None if self.prompts is None else await self.prompts.read(client_request)
        deadline = time.monotonic() + self.config.health_check_timeout_s
        while True:
            try:
                return self.leg_planner.plan(client_request, self.ctx.rooms_in_use, prompt)
            except NoHealthyWorkerError:
                left = deadline - time.monotonic()
                if left <= 0 or not self.pool.has_unprobed():
                    raise
            self._pool_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pool_changed.wait(), min(left, 0.1))

    # ------------------------------------------------------------- requests
    def check_auth(self, request: Request) -> None:
        if not self._api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip().encode()
        if scheme.lower() != "bearer" or not any(
            hmac.compare_digest(presented, key) for key in self._api_keys
        ):
            raise RouterError(
                401,
                "missing or invalid API key; send `Authorization: Bearer <key>`",
                code="invalid_api_key",
                reason="unauthorized",
            )

    async def relay(self, request: Request, endpoint: Endpoint) -> Response:
        received_ns = time.monotonic_ns()
        self.check_auth(request)
        try:
            raw = await _read_body(request, self.config.max_body_bytes)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        record = RequestRecord.arriving(self.tracing, request.headers, endpoint.value)
        try:
            client_request = await read_request(
                endpoint, raw, disaggregated=self.config.is_disaggregated
            )
            model = client_request.model
            if model is not None and model not in self.config.model_names:
                raise RouterError(
                    404,
                    f"model {model!r} does not exist; this router serves "
                    f"{self.config.model_name!r}",
                    code="model_not_found",
                    param="model",
                    reason="unknown_model",
                )
            assert self.ctx is not None, "router app used outside its lifespan"
            plan = await self._plan(client_request)
        except RouterError as err:
            record.set_outcome(err.reason)
            record.planned(err.reason)
            record.finish(self.metrics)
            raise
        record.planned()
        relay = self._relay_for(plan, record)
        stage_trace.mark(relay.plan.room, "router.recv", received_ns)
        stage_trace.mark(relay.plan.room, "router.planned")
        relay.start()
        handed_off = False

        def client_left() -> None:
            relay.abandon("client_disconnect")

        try:
            await run_until_disconnect(request.receive, relay.open(), client_left)
            if relay.plan.stream:
                handed_off = True
                stream: Response = RelayStreamResponse(relay)
                return stream
            body = await run_until_disconnect(request.receive, relay.read_body(), client_left)
            return Response(
                content=body,
                status_code=relay.main_status,
                media_type="application/json",
                headers={"x-request-id": relay.rid},
            )
        except ClientDisconnected:
            request.scope[DISCONNECT_SCOPE_KEY] = True
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except RouterError as err:
            err.rid = relay.rid
            raise
        finally:
            if not handed_off:
                await relay.aclose()

    async def _admin_body(self, request: Request) -> dict[str, Any] | None:
        """The JSON body of an admin call once its token is checked (None: client left)."""
        if not self.config.worker_token:
            raise RouterError(403, "the router has no cluster token: its admin API is off")
        denied = check_bearer(request.headers.get("authorization"), self.config.worker_token)
        if denied is not None:
            raise RouterError(denied.status, denied.message, reason="unauthorized")
        try:
            return parse_json_object(await _read_body(request, 4096))
        except ClientDisconnect:
            return None

    async def add_worker(self, request: Request) -> JSONResponse:
        """`/admin/add_worker {url, role}`: a new instance; probed at once."""
        body = await self._admin_body(request)
        if body is None:
            return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
        roles = (Role.prefill, Role.decode) if self.config.is_disaggregated else (Role.colocated,)
        names = [r.value for r in roles]
        url, role = body.get("url"), body.get("role")
        if not isinstance(url, str) or role not in names:
            raise RouterError(422, f"body must be {{url: str, role: one of {names}}}")
        try:
            worker = self.pool.add(url, Role(role))
        except ValueError as err:
            raise RouterError(409 if "in the pool as" in str(err) else 422, str(err)) from None
        assert self.ctx is not None and self.checker is not None
        log.info("worker %s (%s) added by its supervisor", worker.url, worker.role)
        self.ctx.spawn(self.checker.probe(worker))
        return JSONResponse(worker.describe())

    def _pool_worker(self, url: str) -> Worker:
        """The pool's worker at an admin body's `url`: 422 if it is not a URL, 404 if unknown."""
        try:
            worker = self.pool.get(normalize_url(url))
        except ValueError as err:
            raise RouterError(422, str(err)) from None
        if worker is None:
            raise RouterError(404, f"no worker {url} in the pool")
        return worker

    async def remove_worker(self, request: Request) -> JSONResponse:
        """`/admin/remove_worker {url}`: a drained instance leaves the pool."""
        body = await self._admin_body(request)
        if body is None:
            return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
        url = body.get("url")
        if not isinstance(url, str):
            raise RouterError(422, "body must be {url: str}")
        worker = self._pool_worker(url)
        try:
            self.pool.remove(worker)
        except ValueError as err:
            raise RouterError(409, str(err)) from None
        if worker.healthy:
            worker.healthy = False
            self._on_transition(worker, False)
        log.info("worker %s (%s) removed by its supervisor", worker.url, worker.role)
        return JSONResponse(worker.describe())

    async def hold(self, request: Request, *, held: bool) -> JSONResponse:
        """`/admin/hold_worker` (held) and `/admin/admit_worker`."""
        body = await self._admin_body(request)
        if body is None:
            return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
        url, reason = body.get("url"), body.get("reason", "held out by its supervisor")
        if not isinstance(url, str) or not isinstance(reason, str) or len(reason) > 256:
            raise RouterError(422, "body must be {url: str, reason?: str}")
        worker = self._pool_worker(url)
        assert self.ctx is not None and self.checker is not None
        if held:
            if self.pool.hold_out(worker, reason):
                log.warning("worker %s (%s) held out: %s", worker.url, worker.role, reason)
                self._on_transition(worker, False)
        else:
            self.pool.let_in(worker)
            log.info("worker %s (%s) admitted again", worker.url, worker.role)
            self.ctx.spawn(self.checker.probe(worker))
        return JSONResponse(worker.describe())

    def models(self) -> dict[str, Any]:
        created = self.started_at
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "pdcluster"}
                for name in self.config.model_names
            ],
        }

    def health(self) -> tuple[bool, dict[str, Any]]:
        roles = (Role.prefill, Role.decode) if self.config.is_disaggregated else (Role.colocated,)
        missing = [role.value for role in roles if not self.pool.healthy(role)]
        body = {
            "status": "ok" if not missing else "unavailable",
            "missing_roles": missing,
            "workers": [w.describe() for w in self.pool.all()],
        }
        return not missing, body


def _load_tokenizer(source: str | None) -> RouterTokenizer | None:
    """The model's tokenizer, for cache_aware's text prompts (None: ids only)."""
    if source is None:
        return None
    # The one engine module the router reads: plain Python, no torch.
    from pdcluster.runtime.engine.tokenizer import load_tokenizer

    try:
        return load_tokenizer(source)
    except Exception as err:  # a missing or unreadable tokenizer must not stop the router
        log.warning("cache_aware: no tokenizer from %s (%s); text prompts go by load", source, err)
        return None


# The inference routes, served without FastAPI (see `RouterApp`).
INFERENCE_ROUTES = {
    "/v1/completions": Endpoint.completions,
    "/v1/chat/completions": Endpoint.chat,
    "/generate": Endpoint.generate,
}


class RouterApp(FastAPI):
    """FastAPI for the admin, health, models and metrics routes; the three
    inference routes (POST) are served as plain ASGI before FastAPI's stack.

    Every inference request would otherwise pass seven ASGI layers (error,
    metrics, exception, exit-stack middlewares, routing, the endpoint wrapper
    and its dependency solver), and every SSE event of its stream four `send`
    wrappers: most of the router's CPU per short streamed request on one
    event loop (docs/benchmarks.md, fifth round). The answers are the same:
    `RouterError` as the same JSON, anything else as a JSON 500.
    """

    router_state: RouterState

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = INFERENCE_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await super().__call__(scope, receive, send)
            return
        await self.serve_inference(scope, receive, send, endpoint)

    async def serve_inference(
        self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint
    ) -> None:
        state = self.router_state
        start = time.perf_counter()
        status = 500
        try:
            try:
                if scope["method"] == "POST":
                    response = await state.relay(Request(scope, receive), endpoint)
                else:
                    response = JSONResponse(
                        error_body("Method Not Allowed", 405),
                        status_code=405,
                        headers={"allow": "POST"},
                    )
            except RouterError as err:
                response = _error_response(err)
            except Exception:
                log.exception("%s failed", scope["path"])
                response = JSONResponse(error_body("internal router error", 500), status_code=500)
            status = response.status_code
            await response(scope, receive, send)
        finally:
            if scope.get(DISCONNECT_SCOPE_KEY):
                status = CLIENT_CLOSED_REQUEST
            state.metrics.requests.labels(scope["path"], str(status)).inc()
            state.metrics.latency.labels(scope["path"]).observe(time.perf_counter() - start)


def create_router_app(config: RouterConfig, *, rng: RandomSource | None = None) -> RouterApp:
    """Build the router; ``rng`` (default: the OS source) mints rids and rooms."""
    state = RouterState(config, rng if rng is not None else secrets.SystemRandom())
    app = RouterApp(
        title="PDCluster router",
        lifespan=state.lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.router_state = state
    app.state.router = state
    app.add_middleware(_MetricsMiddleware, metrics=state.metrics)

    @app.exception_handler(RouterError)
    async def on_router_error(_: Request, exc: RouterError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), exc.status_code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        state.check_auth(request)
        return JSONResponse(state.models())

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = state.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.post("/admin/hold_worker")
    async def hold_worker(request: Request) -> JSONResponse:
        return await state.hold(request, held=True)

    @app.post("/admin/admit_worker")
    async def admit_worker(request: Request) -> JSONResponse:
        return await state.hold(request, held=False)

    @app.post("/admin/add_worker")
    async def add_worker(request: Request) -> JSONResponse:
        return await state.add_worker(request)

    @app.post("/admin/remove_worker")
    async def remove_worker(request: Request) -> JSONResponse:
        return await state.remove_worker(request)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
