"""An HTTP/2 prior-knowledge client gets a GOAWAY(HTTP_1_1_REQUIRED), not a 400 and a warning.

SGLang's router opens a connection to a decode worker with the HTTP/2
preface (a gRPC health probe) before it speaks HTTP/1.1 to it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from pdcluster.runtime.http.h2_preface import (
    FRAME_GOAWAY,
    FRAME_SETTINGS,
    H2_PREFACE,
    HTTP_1_1_REQUIRED,
    Http1OnlyProtocol,
)
from pdcluster.runtime.ports import free_port


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    port = free_port()
    # log_config=None: uvicorn's warnings reach the root logger (and caplog).
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_config=None, http=Http1OnlyProtocol
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=5)


def _read_frames(sock: socket.socket) -> list[tuple[int, bytes]]:
    """Every HTTP/2 frame the server sends until it closes the connection."""
    data = b""
    sock.settimeout(5)
    while chunk := sock.recv(4096):
        data += chunk
    frames = []
    while data:
        assert len(data) >= 9, f"truncated frame header {data!r}"
        length = int.from_bytes(data[:3], "big")
        kind = data[3]
        frames.append((kind, data[9 : 9 + length]))
        data = data[9 + length :]
    return frames


@pytest.mark.parametrize("pieces", [1, 24], ids=["whole", "byte_by_byte"])
def test_h2_preface_gets_goaway_http_1_1_required(
    server: str, pieces: int, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = server.split(":")
    caplog.set_level(logging.DEBUG)
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        step = len(H2_PREFACE) // pieces
        for i in range(0, len(H2_PREFACE), step):
            sock.sendall(H2_PREFACE[i : i + step])
            if pieces > 1:
                time.sleep(0.005)
        frames = _read_frames(sock)
    kinds = [kind for kind, _ in frames]
    assert kinds == [FRAME_SETTINGS, FRAME_GOAWAY]
    last_stream, code = struct.unpack(">II", frames[1][1][:8])
    assert (last_stream, code) == (0, HTTP_1_1_REQUIRED)
    assert "Invalid HTTP request" not in caplog.text
    # The server goes on serving HTTP/1.1.
    assert httpx.get(f"http://{server}/health", timeout=5).json() == {"ok": True}


def test_http1_request_split_after_its_first_byte_is_served(server: str) -> None:
    # "P" could start the preface; "POST"/"PUT" must still reach h11 whole.
    host, port = server.split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"G")
        time.sleep(0.02)
        sock.sendall(b"ET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        sock.settimeout(5)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"ok":true}')
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"P")
        time.sleep(0.02)
        sock.sendall(b"OST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 405")
