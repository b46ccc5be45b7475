"""The scheduler half of the connector: its room book, and the control plane on the side port.

One per vLLM engine, in its scheduler's process. It keeps the room book
(`scheduler_rooms.py`) behind a lock (the side port's thread reports peers
and reads views while vLLM's scheduler steps), and serves on the side port:

- prefill: the instance's bootstrap server (`/route`, `/register_dp_rank`,
  `/query_dp_ranks`): its ranks register, decodes look them up;
- both: `GET /health` (open: liveness, what decode heartbeats probe; a
  prefill's, the bootstrap app's, names this process's start id, so a
  decode takes a vLLM restarted at the same side port as a new start);
  `POST /admin/fail_peer`, `GET /admin/rooms`, `GET /admin/failures` (the
  operator's fast path, admin_routes.py); `GET /get_server_info` (peer
  verdicts as `peers_down`, refusals, the transport);
- decode: `PUT /admin/prefill_peers` (the prefill side ports it may contact);
  `PUT /admin/rank_peers_down` (a rank's peer verdicts whenever they change:
  vLLM steps only while it has requests, and an idle decode's verdicts must
  still reach the router, which holds a prefill out on them).

Every route but `/health` takes the cluster token, as on our own workers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdcluster.runtime.http.auth import check_bearer
from pdcluster.runtime.pd.coords import InstanceShape
from pdcluster.runtime.pd.instance_counts import build_group_view
from pdcluster.runtime.pd.known_peers import KnownPeers, parse_peer_list
from pdcluster.runtime.pd_worker.admin_body import FailPeerRequest
from pdcluster.runtime.pd_worker.admin_routes import admin_routes, prefill_peers_route
from pdcluster.runtime.pd_worker.bootstrap_server import BootstrapServer, create_bootstrap_app
from pdcluster.runtime.pd_worker.group import GroupFailPeer
from pdcluster.runtime.spec import Role
from pdcluster.runtime.vllm_connector.commands import RankNews, StepCommands
from pdcluster.runtime.vllm_connector.params import RoomParamsError, parse_room_params
from pdcluster.runtime.vllm_connector.scheduler_rooms import SchedulerRooms, parse_rank_verdicts
from pdcluster.runtime.vllm_connector.settings import ConnectorSettings

log = logging.getLogger("pdcluster.vllm")


class ConnectorScheduler:
    """The room book of one vLLM engine and its side port."""

    def __init__(
        self, settings: ConnectorSettings, role: Role, page_size: int, tp_size: int, token: str
    ) -> None:
        self.settings = settings
        self.role = role
        self.token = token
        self.book = SchedulerRooms(role, page_size)
        if settings.prefill_peers is not None:
            self.book.known = KnownPeers(parse_peer_list(settings.prefill_peers))
        self._lock = threading.Lock()
        self._step = 0
        self.server = BootstrapServer(self._app(tp_size), settings.host, settings.side_port)
        self.server.start()
        log.info("PDCluster connector (%s): side port %s", role, self.server.url)

    # ------------------------------------------------------------ vLLM's points
    def on_new_request(self, req_id: str, params: Any, prompt: Sequence[int]) -> None:
        error = None
        try:
            room = parse_room_params(params)
        except RoomParamsError as err:
            room, error = None, str(err)
            log.warning("request %s: %s", req_id, err)
        with self._lock:
            self.book.open(req_id, room, prompt, time.monotonic(), params_error=error)

    def matched_tokens(self, req_id: str, num_local: int) -> tuple[int, bool]:
        with self._lock:
            return self.book.matched_tokens(req_id, num_local)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        with self._lock:
            self.book.allocated(req_id, block_ids, num_external)

    def step_commands(
        self,
        scheduled: Iterable[tuple[str, Sequence[int], int]],
        preempted: Iterable[str],
    ) -> tuple[int, StepCommands]:
        """`build_connector_meta`: (step number, the commands every rank applies).

        `scheduled`: (request, its block ids, the prompt tokens computed once
        this step ran) for every request this step computes.
        """
        with self._lock:
            if self.role is Role.prefill:
                for req_id, block_ids, end in scheduled:
                    if req_id in self.book:
                        self.book.scheduled(req_id, block_ids, end)
            self.book.preempted(preempted)
            self._step += 1
            return self._step, self.book.take()

    def on_output(
        self, recving: Iterable[str], sending: Iterable[str], news: RankNews | None
    ) -> None:
        with self._lock:
            self.book.on_output(recving, sending, news, time.monotonic())

    def finished(self, req_id: str, *, aborted: bool) -> bool:
        with self._lock:
            return self.book.finished(req_id, aborted=aborted)

    def has_pending_work(self) -> bool:
        with self._lock:
            return self.book.has_commands

    def close(self) -> None:
        self.server.stop()

    # ------------------------------------------------------------ admin target
    def fail_peer(self, call: FailPeerRequest) -> None:
        with self._lock:
            self.book.fail_peer(GroupFailPeer(call.peer, call.reason, call.gone, call.incarnation))

    def room_views(self, now: float) -> list[dict[str, Any]]:
        with self._lock:
            return self.book.views(now)

    async def failures(self, scope: str | None) -> dict[str, Any]:
        with self._lock:
            view = build_group_view(
                "scheduler",
                {f"refused:{k}": v for k, v in self.book.refusals.items()},
                self.book.rank_counts,
                [],
                self.book.tally.counts(),
            )
        return view.to_json()

    @property
    def known(self) -> KnownPeers:
        return self.book.known

    @known.setter
    def known(self, peers: KnownPeers) -> None:
        with self._lock:
            self.book.known = peers

    # ------------------------------------------------------------ the side port
    def _app(self, tp_size: int) -> FastAPI:
        if self.role is Role.prefill:
            shape = InstanceShape(dp=1, cp=1, tp=tp_size, pp=1)
            app = create_bootstrap_app(shape, self.token or None)
        else:
            app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

            @app.get("/health")
            async def health() -> JSONResponse:
                return JSONResponse({"status": "ok", "role": str(self.role)})

            prefill_peers_route(self, self.token)(app)

            @app.put("/admin/rank_peers_down")
            async def rank_peers_down(request: Request) -> JSONResponse:
                if self.token:
                    denied = check_bearer(request.headers.get("authorization"), self.token)
                    if denied is not None:
                        return JSONResponse({"error": denied.message}, denied.status)
                try:
                    rank, verdicts = parse_rank_verdicts(await request.json())
                except ValueError as err:
                    return JSONResponse({"error": str(err)}, 400)
                with self._lock:
                    self.book.rank_peers_down(rank, verdicts)
                return JSONResponse({"rank": rank, "peers_down": verdicts})

        admin_routes(self, self.token)(app)

        @app.get("/get_server_info")
        async def server_info(request: Request) -> JSONResponse:
            if self.token:
                denied = check_bearer(request.headers.get("authorization"), self.token)
                if denied is not None:
                    return JSONResponse({"error": denied.message}, denied.status)
            with self._lock:
                body = {
                    "role": str(self.role),
                    "kv_connector": "pdcluster",
                    # As our workers report it (the operator's transport table);
                    # the ranks' UCX lanes stay in the worker processes.
                    "kv_transport": {"backend": str(self.settings.transfer.backend)},
                    "peers_down": dict(self.book.peers_down),
                    "rooms": len(self.book),
                    "refused": dict(self.book.refusals),
                    "pd_stats": {
                        "loaded_tokens": self.book.loaded_tokens,
                        "reused_tokens": self.book.reused_tokens,
                    },
                }
            return JSONResponse(body)

        return app
