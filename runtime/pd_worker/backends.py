"""HTTP backends of the prefill and decode roles, plus their admin and bootstrap servers.

A PD worker receives the same body as its peer leg, with `bootstrap_host`,
`bootstrap_port` and `bootstrap_room`. The prefill leg answers once every
rank's KV reached decode (or with an error); the decode leg streams tokens
once the KV arrived. A request without bootstrap fields is refused with 400:
a PD worker cannot serve it alone. So is one whose `data_parallel_rank`
is not `room % dp` (dp: the prefill instances' dp size, from the manifest),
on both legs and before anything is reserved: the legs would otherwise meet
in different prefill dp groups and only time out.

Admin API (admin_routes.py): `fail_peer`, `prefill_peers` (decode), `rooms`
(this rank's view) and `failures` — the whole instance's counts (every rank
of every dp group; rooms counted once), for the operator's Events:
`{"failures": {"room_failed:<reason>": rooms}, "stats": {...}, "ranks":
{"<coord>": {...}}, "missing": [...]}` (counts.py); `?scope=group` answers
for this dp group only (how the front reads the other groups).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from pdcluster.runtime import stage_trace
from pdcluster.runtime.http.auth import bearer_headers
from pdcluster.runtime.http.limits import server_config
from pdcluster.runtime.pd.early_start import EarlyStartBudget, early_start_limit
from pdcluster.runtime.pd.known_peers import KnownPeers, PeerSetError
from pdcluster.runtime.pd.messages import room_size_problem
from pdcluster.runtime.pd.readiness import ReadinessFacts, compute_not_ready
from pdcluster.runtime.pd.room_queue import QueueFull
from pdcluster.runtime.pd.topology import DpRankConflict, prefill_dp_group, shape_of
from pdcluster.runtime.pd_worker.admin_body import FailPeerRequest
from pdcluster.runtime.pd_worker.admin_routes import admin_routes, prefill_peers_route
from pdcluster.runtime.pd_worker.coordinator import (
    DecodeCoordinator,
    Leg,
    PrefillCoordinator,
    RoomConflict,
)
from pdcluster.runtime.pd_worker.counts import InstanceCounts
from pdcluster.runtime.pd_worker.group import GroupFailPeer
from pdcluster.runtime.serving.backend import check_capacity, engine_request, page_counts
from pdcluster.runtime.serving.engine_service import EngineService, EngineStalled, TokenEvent
from pdcluster.runtime.serving.request import BadRequest, PreparedRequest
from pdcluster.runtime.spec import AllocationPolicy, Role

log = logging.getLogger("pdcluster.pd")

# Seconds a client refused for a full prefill queue should wait before retrying.
RETRY_AFTER_S = 1
# Fault injection for tests only: the bootstrap server starts listening this
# many seconds after the worker (a slow rank 0; the ranks must keep retrying).
BOOTSTRAP_DELAY_ENV = "PDCLUSTER_TEST_BOOTSTRAP_DELAY_S"
# Connections the front keeps to the other dp groups' leaders, all of them
# together: the router's pool size, since every relayed request holds one.
RELAY_MAX_CONNECTIONS = 1024


class _LateServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, delay_s: float) -> None:
        super().__init__(config)
        self.delay_s = delay_s

    async def serve(self, sockets: Any = None) -> None:
        await asyncio.sleep(self.delay_s)
        await super().serve(sockets)


class _PDBackend:
    role: Role

    def __init__(self, service: EngineService, agent: Any, coordinator: Any, info: dict[str, Any]):
        self.service = service
        self.agent = agent
        self.coordinator = coordinator
        self.info = info
        # http://host:port of the leaders of dp groups 1..dp-1 (the front relays to them).
        self.dp_urls: tuple[str, ...] = tuple(info.pop("dp_urls", ()))
        # Sent on relays to the other dp groups' leaders (their data plane is guarded).
        self.headers: dict[str, str] = bearer_headers(info.pop("token", ""))
        self._forwarded: dict[str, str] = {}
        self._relay_client: httpx.AsyncClient | None = None  # made on the serving loop
        self.counts: InstanceCounts | None = None  # set by build_pd_backend
        # dp size of the prefill instances (both roles): a room's prefill group is room % it.
        self.prefill_dp_size: int = int(info.pop("prefill_dp_size", 1))
        # The front of a prefill instance: its bootstrap server's registry.
        self.registry: Any = None
        # The front of a dp>1 instance is healthy only once every dp group serves.
        self._groups_ready = threading.Event()
        if self.dp_urls and info["dp_rank"] == 0:
            threading.Thread(target=self._wait_groups, name="dp-ready", daemon=True).start()
        else:
            self._groups_ready.set()

    def _wait_groups(self) -> None:
        pending = list(self.dp_urls)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                for base in list(pending):
                    try:
                        if client.get(f"{base}/health").status_code == 200:
                            pending.remove(base)
                    except httpx.HTTPError:
                        pass
                time.sleep(0.2)
        self._groups_ready.set()

    def check(self, req: PreparedRequest) -> None:
        if req.bootstrap.bootstrap_room is None:
            raise BadRequest(
                f"a {self.role} worker needs bootstrap_host, bootstrap_port and bootstrap_room "
                "(send requests through a PD router)"
            )
        try:
            prefill_dp_group(
                req.bootstrap.bootstrap_room,
                self.prefill_dp_size,
                req.bootstrap.data_parallel_rank,
            )
        except DpRankConflict as err:
            raise BadRequest(str(err)) from None
        too_large = room_size_problem(len(req.prompt_ids), self.agent.ctx.page_size)
        if too_large is not None:
            raise BadRequest(too_large)
        check_capacity(self.service.engine, req)
        engine_request(req)

    def target_dp(self, req: PreparedRequest) -> int:
        room = req.bootstrap.bootstrap_room or 0
        return room % int(self.info["dp_size"])

    async def events(self, req: PreparedRequest) -> AsyncIterator[TokenEvent]:
        target = self.target_dp(req)
        if target != self.info["dp_rank"]:
            async for event in self._forward(target, req):
                yield event
            return
        room = req.bootstrap.bootstrap_room
        stage_trace.mark(room, f"{self.role}.http")
        out = self.service.track(req.rid, len(req.prompt_ids), req.stop_strings)
        try:
            await self.service.call(lambda: self.open(req))
        except RoomConflict as err:
            self.service.untrack(req.rid)
            raise BadRequest(str(err), status=409) from None
        except (QueueFull, EngineStalled) as err:
            self.service.untrack(req.rid)
            yield TokenEvent([], "", True, _reason_of(err), error=str(err), status=503)
            return
        except BaseException:
            self.service.untrack(req.rid)
            raise
        stage_trace.mark(room, f"{self.role}.opened")
        marked = False
        async for event in self.service.events(req.rid, out):
            if not marked and (event.token_ids or event.finished):
                marked = True
                stage_trace.mark(room, f"{self.role}.first_event")
            yield event

    def open(self, req: PreparedRequest) -> None:
        raise NotImplementedError

    def _relay(self) -> httpx.AsyncClient:
        """One keep-alive pool for every relay (a client per request paid a new
        connection per request). trust_env=False: a proxy variable must never
        divert worker traffic."""
        if self._relay_client is None:
            limits = httpx.Limits(
                max_connections=RELAY_MAX_CONNECTIONS,
                max_keepalive_connections=RELAY_MAX_CONNECTIONS,
            )
            self._relay_client = httpx.AsyncClient(
                timeout=None, limits=limits, trust_env=False, headers=self.headers
            )
        return self._relay_client

    async def _forward(self, target: int, req: PreparedRequest) -> AsyncIterator[TokenEvent]:
        """Relay a request to the leader of dp group `target` (its own engine)."""
        url = self.dp_urls[target - 1]
        self._forwarded[req.rid] = url
        body = {
            "input_ids": req.prompt_ids,
            "rid": req.rid,
            "rid_is_local": req.rid_is_local,
            "stream": True,
            "sampling_params": {
                "temperature": req.sampling["temperature"],
                "top_p": req.sampling["top_p"],
                "top_k": req.sampling["top_k"],
                "max_new_tokens": req.sampling["max_tokens"],
                "seed": req.sampling["seed"],
                "ignore_eos": req.sampling["ignore_eos"],
                "stop_token_ids": req.sampling["stop_token_ids"],
                "stop": req.stop_strings or None,
                "presence_penalty": req.sampling.get("presence_penalty", 0.0),
                "frequency_penalty": req.sampling.get("frequency_penalty", 0.0),
                "repetition_penalty": req.sampling.get("repetition_penalty", 1.0),
            },
        }
        num_logprobs = req.sampling.get("logprobs")
        if num_logprobs is not None:
            body["return_logprob"] = True
            body["top_logprobs_num"] = num_logprobs
        b = req.bootstrap
        for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank"):
            if getattr(b, name) is not None:
                body[name] = getattr(b, name)
        text, n_ids = "", 0
        ended = False
        # The group's leader records the request's spans under the caller's trace.
        trace = {"traceparent": req.traceparent} if req.traceparent else None
        req.stamps = None
        try:
            async with self._relay().stream(
                "POST", url + "/generate", json=body, headers=trace
            ) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")
                    yield TokenEvent([], "", True, "error", error=detail, status=resp.status_code)
                    return
                lines = resp.aiter_lines()
                async for line in lines:
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        err = data["error"]
                        yield TokenEvent(
                            [],
                            "",
                            True,
                            "error",
                            error=err.get("message"),
                            status=int(err.get("code", 502)),
                        )
                        return
                    ids, full = data["output_ids"], data["text"]
                    fin = (data["meta_info"].get("finish_reason") or {}).get("type")
                    if fin is not None:
                        # Read to the end ("[DONE]") before the last event: only a
                        # response read whole gives its connection back to the pool.
                        async for _ in lines:
                            pass
                        ended = True
                    lps = relayed_logprobs(data["meta_info"], n_ids, len(ids))
                    yield TokenEvent(
                        ids[n_ids:], full[len(text) :], fin is not None, fin, logprobs=lps
                    )
                    text, n_ids = full, len(ids)
                    if ended:
                        return
            if not ended:
                msg = f"dp group {target}: stream ended without a finish"
                yield TokenEvent([], "", True, "error", error=msg, status=502)
        except httpx.HTTPError as err:
            yield TokenEvent([], "", True, "error", error=f"dp group {target}: {err}", status=502)
        finally:
            self._forwarded.pop(req.rid, None)

    def abort(self, rid: str) -> None:
        url = self._forwarded.get(rid)
        if url is not None:

            def relay() -> None:
                try:
                    httpx.post(
                        url + "/abort_request", json={"rid": rid}, headers=self.headers, timeout=2
                    )
                except httpx.HTTPError:
                    pass

            threading.Thread(target=relay, name="abort-relay", daemon=True).start()
            return
        self.service.abort(rid)

    def abort_all(self) -> None:
        self.service.abort_all()

    def server_info(self) -> dict[str, Any]:
        return {
            **self.info,
            **page_counts(self.service.engine),
            "num_rooms": len(self.coordinator.rooms),
            "endpoint": self.agent.address,
            **self._pd_stats(),
            "kv_receive_stats": dict(getattr(getattr(self.agent, "receiver", None), "stats", {})),
            "kv_transport": self.agent.transport_report(),
        }

    def _pd_stats(self) -> dict[str, Any]:
        if self.counts is None:
            return {"pd_stats": self.agent.counts()}
        view = self.counts.instance_view_blocking()
        # Summed over every rank of the instance; room_failed:* counts rooms.
        return {
            "pd_stats": view.stats,
            "pd_stats_by_rank": view.ranks,
            "pd_stats_missing": view.missing,
        }

    def not_ready_reason(self) -> str | None:
        """Why /health answers 503 (readiness.py), None when the worker may take requests."""
        registry = self.registry
        return compute_not_ready(
            ReadinessFacts(
                engine_alive=self.service.is_alive,
                engine_stalled=self.service.is_stalled,
                groups_ready=self._groups_ready.is_set(),
                registered=getattr(self.agent, "registered", None),
                registration_error=getattr(self.agent, "registration_error", None),
                num_registered=None if registry is None else registry.num_registered,
                num_expected=None if registry is None else registry.num_expected,
            )
        )

    def is_healthy(self) -> bool:
        return self.not_ready_reason() is None

    def is_live(self) -> bool:
        """The liveness probe: False only when the engine is gone or hung (restart it)."""
        return self.service.is_alive and not self.service.is_stalled


def _reason_of(err: Exception) -> str:
    return "engine_stalled" if isinstance(err, EngineStalled) else QueueFull.reason


class PrefillBackend(_PDBackend):
    role = Role.prefill

    def check(self, req: PreparedRequest) -> None:
        super().check(req)
        # Another dp group's leader answers for its own queue.
        if self.target_dp(req) == self.info["dp_rank"] and self.coordinator.is_full():
            raise BadRequest(
                f"{QueueFull.reason}: every room slot is taken and the queue is full; retry later",
                status=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def open(self, req: PreparedRequest) -> None:
        self.coordinator.open(_leg_of(req))


class DecodeBackend(_PDBackend):
    role = Role.decode

    def server_info(self) -> dict[str, Any]:
        # Prefills this group's leader refuses new rooms for (declared dead, not back yet).
        return {**super().server_info(), "peers_down": self.agent.peers_down()}

    # The prefill bootstrap servers this worker may contact (known_peers.py).
    known = KnownPeers()

    def is_healthy(self) -> bool:
        # Not ready before it knows whom it may fetch KV from.
        return self.known.is_published and super().is_healthy()

    def check(self, req: PreparedRequest) -> None:
        b = req.bootstrap
        if b.bootstrap_host is None or b.bootstrap_port is None or b.bootstrap_room is None:
            raise BadRequest("decode needs bootstrap_host, bootstrap_port and bootstrap_room")
        # Before anything else: the address is where decode would send the token.
        try:
            self.known.check(b.bootstrap_host, b.bootstrap_port)
        except PeerSetError as err:
            raise BadRequest(str(err), status=400 if self.known.is_published else 503) from None
        super().check(req)

    def open(self, req: PreparedRequest) -> None:
        b = req.bootstrap
        assert b.bootstrap_host is not None and b.bootstrap_port is not None
        assert b.bootstrap_room is not None
        peer = self.known.check(b.bootstrap_host, b.bootstrap_port)
        self.coordinator.open(_leg_of(req), peer, b.data_parallel_rank)


def _leg_of(req: PreparedRequest) -> Leg:
    """The coordinator's view of a checked request (`check` made sure it has a room)."""
    assert req.bootstrap.bootstrap_room is not None
    sampling = engine_request(req).sampling
    return Leg(
        req.bootstrap.bootstrap_room,
        req.rid,
        req.prompt_ids,
        sampling,
        req.rid_is_local,
        stamps=req.stamps,
    )


class _AgentAdmin:
    """The admin routes' target on our own workers: the dp group's leader agent."""

    def __init__(self, agent: Any, counts: InstanceCounts) -> None:
        self.agent = agent
        self.counts = counts

    def fail_peer(self, call: FailPeerRequest) -> None:
        self.agent.broadcast(GroupFailPeer(call.peer, call.reason, call.gone, call.incarnation))

    def room_views(self, now: float) -> list[dict[str, Any]]:
        views: list[dict[str, Any]] = self.agent.room_views(now)
        return views

    async def failures(self, scope: str | None) -> dict[str, Any]:
        if scope == "group":
            return self.counts.group_view().to_json()
        return (await self.counts.instance_view()).to_json()


def _early_start_budget(
    policy: AllocationPolicy, service: EngineService
) -> EarlyStartBudget | None:
    """Under `early`, how much prompt this prefill group computes unpaired (`pd/early_start.py`)."""
    if policy is not AllocationPolicy.early:
        return None
    engine = service.engine
    cfg = engine.scheduler.config
    pool_tokens = engine.num_total_pages * cfg.page_size
    return EarlyStartBudget(early_start_limit(pool_tokens, cfg.max_prompt_tokens))


def build_pd_backend(
    settings: Any, service: EngineService, agent: Any, metrics: Any, dp_rank: int
) -> tuple[Any, Callable[[FastAPI], None], list[uvicorn.Server]]:
    spec = settings.manifest.spec
    topo = settings.role_spec.topology
    group_size = topo.cp * topo.tp * topo.pp
    info: dict[str, Any] = {
        "dp_size": topo.dp,
        "dp_rank": dp_rank,
        # Only the front (dp group 0) reaches the other groups' leaders.
        "dp_urls": settings.dp_urls if dp_rank == 0 else (),
        "prefill_dp_size": spec.prefill.topology.dp if spec.prefill is not None else 1,
        "token": settings.token,
    }
    servers: list[uvicorn.Server] = []
    backend: _PDBackend
    if settings.role is Role.prefill:
        coord: Any = PrefillCoordinator(
            agent,
            service,
            group_size,
            metrics,
            max_rooms=spec.transfer.max_rooms,
            queue_limit=spec.transfer.room_queue_limit,
            early_start=_early_start_budget(spec.transfer.allocation_policy, service),
        )
        backend = PrefillBackend(service, agent, coord, info)
        info["bootstrap_port"] = settings.bootstrap_port
        if dp_rank == 0:
            from pdcluster.runtime.pd_worker.bootstrap_server import create_bootstrap_app

            app = create_bootstrap_app(shape_of(topo), settings.token or None)
            backend.registry = app.state.registry
            config = server_config(app, settings.host, settings.bootstrap_port)
            delay_s = float(os.environ.get(BOOTSTRAP_DELAY_ENV) or 0)
            servers.append(_LateServer(config, delay_s) if delay_s > 0 else uvicorn.Server(config))
    else:
        coord = DecodeCoordinator(agent, service, group_size, metrics, spec)
        backend = DecodeBackend(service, agent, coord, info)
        if settings.prefill_peers is not None:  # local mode: the launcher's list
            backend.known = KnownPeers(frozenset(settings.prefill_peers))

    # Only the front (dp group 0) relays admin calls to the other groups.
    relay_urls = backend.dp_urls if dp_rank == 0 else ()
    counts = InstanceCounts(agent, coord, settings.token, relay_urls)
    backend.counts = counts
    routes = admin_routes(_AgentAdmin(agent, counts), settings.token, relay_urls)
    if isinstance(backend, DecodeBackend):
        admin, peers_route = routes, prefill_peers_route(backend, settings.token, relay_urls)

        def routes(app: FastAPI) -> None:
            admin(app)
            peers_route(app)

    return backend, routes, servers


def relayed_logprobs(meta: dict[str, Any], start: int, end: int) -> list[Any]:
    """The engine logprobs of output tokens [start, end) from a `/generate`
    answer's meta_info (empty when it carries none)."""
    from pdcluster.runtime.engine.sampling import TokenLogprobs

    chosen = meta.get("output_token_logprobs")
    if not chosen:
        return []
    tops = meta.get("output_top_logprobs") or [[] for _ in chosen]
    out: list[Any] = []
    for (value, _, _), top in zip(chosen[start:end], tops[start:end], strict=True):
        alternatives = tuple((int(t), float(v)) for v, t, _ in top)
        out.append(None if value is None else TokenLogprobs(float(value), alternatives))
    return out
