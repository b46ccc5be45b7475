"""An HTTP/1.1 server protocol that turns away HTTP/2 prior-knowledge clients properly.

Our servers speak HTTP/1.1 only. A client that opens with the HTTP/2
connection preface (`PRI * HTTP/2.0…`, RFC 9113 §3.4: "prior knowledge",
e.g. a gRPC health probe) would get uvicorn's 400 and an "Invalid HTTP
request received." warning. This protocol answers such a preface the way
HTTP/2 expects instead: its own (empty) SETTINGS, then GOAWAY with error
HTTP_1_1_REQUIRED (0xd, RFC 9113 §7), and closes. Anything else — the
first bytes differ from the preface — is plain HTTP/1.1, handled by
uvicorn's httptools protocol unchanged.

Pass it as `uvicorn.Config(app, http=Http1OnlyProtocol, ...)`.
"""

from __future__ import annotations

import logging
import struct
from typing import Final

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("pdcluster.http")

H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_SETTINGS: Final = 0x4
FRAME_GOAWAY: Final = 0x7
HTTP_1_1_REQUIRED: Final = 0xD
GOAWAY_DEBUG: Final = b"this server speaks HTTP/1.1 only"


def h2_frame(kind: int, payload: bytes, flags: int = 0, stream: int = 0) -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def goaway_reply() -> bytes:
    """Server preface (empty SETTINGS) + GOAWAY(last stream 0, HTTP_1_1_REQUIRED)."""
    goaway = struct.pack(">II", 0, HTTP_1_1_REQUIRED) + GOAWAY_DEBUG
    return h2_frame(FRAME_SETTINGS, b"") + h2_frame(FRAME_GOAWAY, goaway)


class Http1OnlyProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus a GOAWAY for a connection opening with the h2 preface."""

    _head: bytes | None = b""  # first bytes while they could still be the preface; None: decided

    def data_received(self, data: bytes) -> None:
        if self._head is not None:
            head = self._head + data
            if H2_PREFACE.startswith(head[: len(H2_PREFACE)]):
                if len(head) < len(H2_PREFACE):
                    self._head = head  # a prefix so far: wait for the rest
                    return
                self._head = None
                log.debug("HTTP/2 preface from %s: answered GOAWAY (HTTP/1.1 only)", self.client)
                self.transport.write(goaway_reply())
                self.transport.close()
                return
            self._head = None
            data = head
        super().data_received(data)
