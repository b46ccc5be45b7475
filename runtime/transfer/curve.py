"""CURVE encryption and authentication of the ranks' ZMQ endpoints.

With `spec.auth.zmqCurve`, every rank's ROUTER is a CURVE server and every
DEALER a CURVE client, all with one key pair derived from the cluster token
(the Secret the operator creates). A peer without the token cannot compute
the server's public key, so its handshake fails and libzmq drops the
connection before a single frame reaches the rank; between ranks, control
messages and KV bytes are encrypted.

The derivation is deterministic so every rank of every instance agrees on
the keys without distributing them; changing the token changes them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

_DOMAIN = b"pdcluster zmq curve v1\0"


@dataclass(frozen=True)
class CurveKeys:
    public: bytes = b""  # Z85, 40 bytes
    secret: bytes = b""  # Z85, 40 bytes

    def __repr__(self) -> str:
        return f"CurveKeys(public={self.public!r}, secret=<hidden>)"


def cluster_keys(token: str) -> CurveKeys:
    """The key pair every endpoint of the cluster uses; raises if CURVE cannot run."""
    if not token:
        raise ValueError("zmqCurve needs the cluster token (PDCLUSTER_TOKEN) to derive its keys")
    if not zmq.has("curve"):
        raise RuntimeError("zmqCurve is on but this libzmq was built without CURVE support")
    # Any 32 bytes are a valid Curve25519 secret key (libsodium clamps them).
    secret = z85.encode(hashlib.sha256(_DOMAIN + token.encode()).digest())
    return CurveKeys(public=zmq.curve_public(secret), secret=secret)


def make_server(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Before bind: only clients that know the server key get through the handshake."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Before connect."""
    sock.curve_serverkey = keys.public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
