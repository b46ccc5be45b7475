"""Who sent a ZMQ frame: the connection it arrived on, proven, never a field.

Every DEALER picks a random routing id when it is created, and every frame
it sends carries its own endpoint address and a proof: an HMAC, keyed by
the cluster token, of that routing id and that address. A ROUTER sees the
routing id of the connection a frame arrived on (libzmq sets it, a peer
cannot change it mid-connection, and two live connections cannot share it),
so a frame whose proof does not match is refused: a peer without the token
cannot speak for another endpoint, and a proof copied from another
connection is worthless on its own.

The address a frame proves is the only sender the rank acts on: replies go
there (to the endpoint that proved it, through our DEALER to it), a message
naming another endpoint as its sender (`decode_endpoint`) is dropped, and a
refused frame is answered only on its own connection (ROUTER -> identity).

Without a token (a local cluster with auth off) the key is public and the
proof only keeps honest peers apart; on Kubernetes the Secret's token keys it.

Pure: no sockets, no clock.
"""

from __future__ import annotations

import hashlib
import hmac
import os

_DOMAIN = b"pdcluster zmq identity v1\0"
PROOF_BYTES = 16
ROUTING_ID_BYTES = 16
MAX_ROUTING_ID_BYTES = 255  # libzmq's own limit


def identity_key(token: str) -> bytes:
    """The proof key every endpoint of a cluster shares, derived from its token."""
    return hashlib.sha256(_DOMAIN + token.encode()).digest()


def new_routing_id() -> bytes:
    """A random DEALER routing id (libzmq reserves ids starting with a zero byte)."""
    return b"\x01" + os.urandom(ROUTING_ID_BYTES - 1)


def prove(key: bytes, routing_id: bytes, sender: bytes) -> bytes:
    """The proof a DEALER with `routing_id` attaches to frames sent as `sender`."""
    mac = hmac.new(key, b"%d:" % len(routing_id) + routing_id + sender, hashlib.sha256)
    return mac.digest()[:PROOF_BYTES]


def check_proof(key: bytes, routing_id: bytes, sender: bytes, proof: bytes) -> str | None:
    """None if `proof` binds `sender` to the connection `routing_id`, else why not."""
    if not routing_id or len(routing_id) > MAX_ROUTING_ID_BYTES:
        return "bad_identity"
    if len(proof) != PROOF_BYTES:
        return "bad_proof"
    if not hmac.compare_digest(prove(key, routing_id, sender), proof):
        return "bad_proof"
    return None


def claim_mismatch(sender: str, claimed: str | None) -> bool:
    """True when a message names an endpoint other than the one its connection proved.

    `claimed` is the message's own sender field (e.g. `decode_endpoint`);
    None when the message carries none.
    """
    return claimed is not None and claimed != sender


def kv_source_ok(sender: str, sources: frozenset[str] | None) -> bool:
    """A KV frame for a room is accepted only from an endpoint the room expects.

    `sources` is None when the room is not (or no longer) receiving: the
    receiver then drops the frame itself, by its own rules.
    """
    return sources is None or sender in sources


_LOOPBACK_BINDS = ("0.0.0.0", "*", "::", "127.0.0.1", "localhost")


def is_loopback(peer_ip: str | None) -> bool:
    """True for a connection from this host (127.0.0.0/8, ::1)."""
    if not peer_ip:
        return False
    ip = peer_ip.removeprefix("::ffff:")
    return ip.startswith("127.") or ip == "::1"


def _host(address: str) -> str:
    return address.removeprefix("tcp://").rpartition(":")[0]


def group_route(address: str, bind_host: str, own_address: str) -> str:
    """Where to dial a rank of this instance for group traffic.

    A rank advertising the same host as this one shares its pod (its network
    namespace), so when it listens on a wildcard or loopback host it is
    reached on 127.0.0.1: group commands never cross the pod network. Any
    other rank is dialled as advertised.
    """
    if not group_must_be_local(bind_host, own_address, [address]):
        return address
    port = address.rpartition(":")[2]
    return f"tcp://127.0.0.1:{port}"


def group_must_be_local(bind_host: str, own_address: str, peers: list[str]) -> bool:
    """Whether group frames between this rank and `peers` must travel over loopback."""
    if bind_host not in _LOOPBACK_BINDS:
        return False
    own = _host(own_address)
    return all(_host(peer) == own for peer in peers)
