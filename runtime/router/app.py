"""The router's HTTP front door: `create_router_app(config) -> FastAPI`.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (stream and not),
``/v1/models``, ``/generate`` (SGLang passthrough), ``/health``, ``/metrics``,
and the supervisor's ``/admin/*`` (`admin_api.py`).
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
from pdcluster.runtime.http.auth import bearer_headers
from pdcluster.runtime.http.middleware import HttpMiddleware
from pdcluster.runtime.router.admin_api import add_admin_routes, read_body
from pdcluster.runtime.router.bodies import ClientRequest, Endpoint
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
from pdcluster.runtime.router.live_settings import RouterLiveSettings, apply_live_settings
from pdcluster.runtime.router.metrics import RouterMetrics
from pdcluster.runtime.router.off_loop import read_request
from pdcluster.runtime.router.policies import make_policy
from pdcluster.runtime.router.prefix_routing import PrefixRouting
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
from pdcluster.runtime.router.workers import Worker, WorkerPool, WorkerTarget
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
        "/admin/settings",
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


class RouterState:
    """Everything one router app owns; created by `create_router_app`."""

    def __init__(self, config: RouterConfig, rng: RandomSource) -> None:
        self.config = config
        self.pool = WorkerPool(failure_threshold=config.health_failure_threshold)
        # cache_aware: the prefix index, its tokenizer and its follower.
        self.prefix = PrefixRouting(config)
        roles = (Role.prefill, Role.decode) if config.is_disaggregated else (Role.colocated,)
        self.metrics = RouterMetrics(
            self.pool.all,
            self.prefix.indexed_pages if config.cache_aware_roles else None,
            roles=roles,
            cluster=config.cluster_name,
            ttft_slo_s=config.ttft_slo_s,
        )
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
        self._api_keys = tuple(k.encode() for k in config.api_keys)
        self.started_at = int(time.time())
        self.ctx: RelayContext | None = None
        self.checker: HealthChecker | None = None
        self._discovery: KubernetesDiscovery | None = None
        # Set when a worker turns healthy or unhealthy: a waiting request re-plans.
        self._pool_changed = asyncio.Event()

    def apply_live_settings(self, live: RouterLiveSettings) -> None:
        """Put `live` in force; raises LiveSettingsRefused (nothing changed) if it needs a restart.

        The policies are swapped between two leg plans (the event loop runs
        one at a time); a plan under way keeps the workers it chose."""
        config = apply_live_settings(self.config, live)
        self.config = config
        planner = self.leg_planner
        planner.prefill_policy = self._policy(config.prefill_policy)
        planner.decode_policy = self._policy(config.decode_policy)
        planner.colocated_policy = self._policy(config.colocated_policy)
        if self.ctx is not None:
            self.ctx.config = config
        if self.checker is not None:
            self.checker.set_interval(config.health_check_interval_s)

    def _policy(self, name: str) -> Any:
        cfg = self.config
        return make_policy(
            name, cfg.policy_seed, index=self.prefix.index, max_load_gap=cfg.max_load_gap
        )

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
            on_transition=self.on_transition,
            reads_server_info=cfg.reads_server_info,
            reads_side_ports=cfg.uses_side_ports,
        )
        if cfg.kubernetes is None:
            self.pool.sync(
                static_targets(
                    cfg.prefill_urls,
                    cfg.decode_urls,
                    cfg.colocated_urls,
                    dict(cfg.kv_events),
                    cfg.side_ports,
                )
            )
            await self.checker.probe_all()
        else:
            self._discovery = KubernetesDiscovery(
                cfg.kubernetes, self.apply_targets, asyncio.get_running_loop()
            )
            self._discovery.start()
        self.prefix.start(self.pool.all, control, self.metrics)
        health_loop = asyncio.create_task(self.checker.run())
        try:
            yield
        finally:
            health_loop.cancel()
            await self.prefix.close()
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
        self.prefix.sync()
        if self.ctx is not None and self.checker is not None:
            for worker in change.added:
                self.ctx.spawn(self.checker.probe(worker))

    def on_transition(self, worker: Worker, healthy: bool) -> None:
        to = "healthy" if healthy else "unhealthy"
        self.metrics.health_transitions.labels(worker.role.value, to).inc()
        self._pool_changed.set()
        self.prefix.sync()
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
        prompt = await self.prefix.read_prompt(client_request)
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
            raw = await read_body(request, self.config.max_body_bytes)
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

    add_admin_routes(app, state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
