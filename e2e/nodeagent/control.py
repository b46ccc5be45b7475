"""The agent's loopback control endpoint: fault hooks, logs and a pod listing.

GET  /healthz                                  200 once the nodes are registered
GET  /pods                                     what runs where (pids, addresses)
POST /pods/NS/NAME/signal?signal=KILL[&container=C]   KILL, TERM, STOP (freeze), CONT (thaw)
GET  /pods/NS/NAME/logs[?container=C][&previous=1]    the current (or previous) run's log
"""

from __future__ import annotations

import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from e2e.nodeagent.agent import NodeAgent

SIGNALS = {
    "KILL": signal.SIGKILL,
    "TERM": signal.SIGTERM,
    "STOP": signal.SIGSTOP,
    "CONT": signal.SIGCONT,
}


def make_handler(agent: NodeAgent) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # requests are not worth a log line each

        def _send(self, status: int, body: object, content_type: str = "application/json") -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self) -> tuple[list[str], dict[str, str]]:
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            return [p for p in parts.path.split("/") if p], query

        def do_GET(self) -> None:  # noqa: N802
            path, query = self._route()
            if path == ["healthz"]:
                ready = agent.ready.is_set()
                self._send(200 if ready else 503, "ok" if ready else "registering", "text/plain")
            elif path == ["pods"]:
                self._send(200, agent.describe())
            elif len(path) == 4 and path[0] == "pods" and path[3] == "logs":
                try:
                    worker = agent.find_worker(path[1], path[2])
                    text = worker.log_text(query.get("container"), query.get("previous") == "1")
                except (KeyError, OSError) as exc:
                    self._send(404, {"error": str(exc).strip("'\"")})
                    return
                self._send(200, text, "text/plain; charset=utf-8")
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            path, query = self._route()
            if not (len(path) == 4 and path[0] == "pods" and path[3] == "signal"):
                self._send(404, {"error": f"no route {self.path}"})
                return
            name = query.get("signal", "KILL").upper()
            if name not in SIGNALS:
                self._send(400, {"error": f"signal must be one of {sorted(SIGNALS)}, got {name!r}"})
                return
            try:
                worker = agent.find_worker(path[1], path[2])
                signalled = worker.signal_containers(query.get("container"), SIGNALS[name])
            except KeyError as exc:
                self._send(404, {"error": str(exc).strip("'\"")})
                return
            self._send(200, {"signalled": signalled})

    return Handler


def serve_control(agent: NodeAgent, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(agent))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="control", daemon=True).start()
    return server
