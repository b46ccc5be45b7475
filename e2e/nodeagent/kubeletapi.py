"""The slice of the kubelet API that `kubectl logs` needs, served by the agent.

The apiserver reaches a node at its InternalIP and the port in
`status.daemonEndpoints.kubeletEndpoint`, over TLS it does not verify unless
told to. One server per node listens on that node's loopback address:

    GET /containerLogs/NS/POD/CONTAINER?previous=true&tailLines=N&follow=true
    GET /healthz
"""

from __future__ import annotations

import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from e2e.nodeagent.pod import PodWorker

FOLLOW_POLL_S = 0.2


class WorkerFinder(Protocol):
    def find_worker(self, namespace: str, name: str) -> PodWorker: ...


def tail_lines(data: bytes, num_lines: int) -> bytes:
    """The last num_lines lines of data (a trailing newline does not start a line)."""
    if num_lines <= 0:
        return b""
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-num_lines:])


def _handler(agent: WorkerFinder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def _error(self, status: int, message: str) -> None:
            data = message.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            parts = urlsplit(self.path)
            path = [p for p in parts.path.split("/") if p]
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            if path == ["healthz"]:
                self._error(200, "ok")
                return
            if len(path) != 4 or path[0] != "containerLogs":
                self._error(404, f"not served by the node agent: {parts.path}")
                return
            try:
                worker = agent.find_worker(path[1], path[2])
                log_path, is_live = worker.log_file(path[3], query.get("previous") == "true")
                data = log_path.read_bytes()
            except (KeyError, OSError) as exc:
                self._error(404, str(exc).strip("'\""))
                return
            if "tailLines" in query:
                data = tail_lines(data, int(query["tailLines"]))
            if "limitBytes" in query:
                data = data[: int(query["limitBytes"])]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()  # HTTP/1.0: the body ends when the connection closes
            self.wfile.write(data)
            if query.get("follow") == "true":
                try:
                    self._follow(log_path, len(log_path.read_bytes()), is_live)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped following

        def _follow(self, log_path: Path, offset: int, is_live: Any) -> None:
            with open(log_path, "rb") as handle:
                handle.seek(offset)
                while True:
                    live = is_live()  # read before the data, so the last bytes are not missed
                    chunk = handle.read()
                    if chunk:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    elif not live:
                        return
                    else:
                        time.sleep(FOLLOW_POLL_S)

    return Handler


def serve_kubelet_api(
    agent: WorkerFinder, addresses: list[str], port: int, cert: Path, key: Path
) -> list[ThreadingHTTPServer]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    servers = []
    for address in addresses:
        server = ThreadingHTTPServer((address, port), _handler(agent))
        server.daemon_threads = True
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(
            target=server.serve_forever, name=f"kubelet {address}", daemon=True
        ).start()
        servers.append(server)
    return servers
