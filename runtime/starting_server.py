"""What a multi-pod instance's leader answers on its HTTP port while its ranks gather.

The worker API starts only once every rank joined (torch.distributed and
the model need them all); until then this small server holds the port and
says which ranks are missing:

    GET /health, /get_server_info, /server_info
        503 {"status": "not_ready", "reason": "ranks_missing",
             "missing_ranks": [2, 3], "waiting_for": "ranks 2, 3 (pod 1)"}
    GET /health/live   200 (waiting on peers is no reason to restart)

It names ranks and pods only, never an address, so it needs no token. It
listens on the pod network like the worker API, so it runs with the same
limits (runtime/http/limits.py): one event loop for every connection, a
read deadline, a header-size cap and a connection cap. A request body is
never read: no route takes one.
Closed (and the port handed to the worker API) right after the rendezvous.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from pdcluster.runtime.http.background import BackgroundServer
from pdcluster.runtime.http.limits import DEFAULT_LIMITS, ServerLimits
from pdcluster.runtime.pod_layout import PodLayout
from pdcluster.runtime.pod_rendezvous import describe_missing

Scope = dict[str, Any]


class StartingServer:
    def __init__(
        self, host: str, port: int, layout: PodLayout, limits: ServerLimits = DEFAULT_LIMITS
    ) -> None:
        self.layout = layout
        self._missing: list[int] = list(range(layout.num_ranks))
        self._lock = threading.Lock()
        self._server = BackgroundServer(self._app, host, port, limits, name="starting-http")
        self.config = self._server.config

    def start(self) -> None:
        self._server.start()

    def set_missing(self, missing: list[int]) -> None:
        with self._lock:
            self._missing = list(missing)

    def body(self) -> dict[str, Any]:
        with self._lock:
            missing = list(self._missing)
        return {
            "status": "not_ready",
            "reason": "ranks_missing" if missing else "starting",
            "missing_ranks": missing,
            "waiting_for": describe_missing(self.layout, missing),
            "num_pods": self.layout.num_pods,
        }

    def close(self) -> None:
        self._server.stop(5)

    async def _app(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; nothing else is served
        if scope["path"] == "/health/live":
            status, body = 200, {"status": "starting"}
        else:
            status, body = 503, self.body()
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
