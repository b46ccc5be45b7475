"""What a multi-pod instance's leader answers on its HTTP port while its ranks gather.

The worker API starts only once every rank joined (torch.distributed and
the model need them all); until then this small server holds the port and
says which ranks are missing:

    GET /health, /get_server_info, /server_info
        503 {"status": "not_ready", "reason": "ranks_missing",
             "missing_ranks": [2, 3], "waiting_for": "ranks 2, 3 (pod 1)"}
    GET /health/live   200 (waiting on peers is no reason to restart)

It names ranks and pods only, never an address, so it needs no token.
Closed (and the port handed to the worker API) right after the rendezvous.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pdcluster.runtime.pod_layout import PodLayout
from pdcluster.runtime.pod_rendezvous import describe_missing


class StartingServer:
    def __init__(self, host: str, port: int, layout: PodLayout) -> None:
        self.layout = layout
        self._missing: list[int] = list(range(layout.num_ranks))
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/health/live":
                    self._send(200, {"status": "starting"})
                else:
                    self._send(503, server.body())

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass  # probes every fraction of a second: keep the log for the worker

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="starting-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

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
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
