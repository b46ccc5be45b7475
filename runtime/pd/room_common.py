"""Vocabulary shared by the prefill and decode room tables.

- Errors raised by *local* calls (the worker's own code calling a table):
  every one leaves the table exactly as it was, and `reason` is a short
  machine-readable code (metric label) while the message explains.
  Untrusted *peer* input never raises: it becomes a `Dropped` action or a
  Failed status.
- `RoomView`: one row of the admin API's room listing.
- Peer matching for `fail_peer`: the heartbeat knows a prefill instance by
  its bootstrap address `host:port`, the operator knows a pod by its IP, a
  room knows its peers' ZMQ endpoints `tcp://host:port`. `peer_matches`
  accepts any of those forms (`peer_address.py` names them).

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.runtime.pd.messages import MAX_ROOM
from pdcluster.runtime.pd.peer_address import PeerRef


class RoomError(ValueError):
    """A local call the table refused; nothing changed."""

    reason = "room_error"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class UnknownRoom(RoomError):
    reason = "unknown_room"


class RoomRejected(RoomError):
    """A room cannot be created or joined (duplicate, conflict, closed, full)."""

    reason = "room_rejected"


class RoomStateError(RoomError):
    """The call is not valid in the room's current state."""

    reason = "bad_state"


@dataclass(frozen=True, slots=True)
class RoomView:
    room: int
    rid: str | None
    state: str  # KVPoll name
    age_s: float
    peers: tuple[str, ...]
    reason: str | None
    generation: int | None = None
    detail: str = ""


def check_room(room: object) -> int:
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise RoomError(f"room must be an int in [0, 2^63), got {room!r}", "bad_room")
    return room


def check_rid(rid: object) -> str:
    if not isinstance(rid, str) or not 0 < len(rid) <= 256:
        raise RoomError(
            f"rid must be a non-empty string of at most 256 chars, got {rid!r}", "bad_rid"
        )
    return rid


def check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise RoomError(f"{name} must be an int in [{low}, {high}), got {value!r}", f"bad_{name}")
    return value


def clip_reason(reason: str) -> str:
    """Reasons travel in messages limited to 1024 chars; never empty."""
    return reason[:1024] if reason else "failed"


def host_of(address: str) -> str:
    """'tcp://10.0.0.5:7000' → '10.0.0.5'; '10.0.0.5:8998' → '10.0.0.5'; '[::1]:80' → '::1'."""
    rest = address.split("://", 1)[1] if "://" in address else address
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    if rest.count(":") == 1:
        return rest.rsplit(":", 1)[0]
    return rest


def peer_matches(peer: PeerRef, *addresses: str) -> bool:
    """True if `peer` names any of `addresses`: exactly, or as a bare host."""
    if not peer:
        return False
    bare_host = host_of(peer) == peer.split("://", 1)[-1]
    for address in addresses:
        if address == peer:
            return True
        if bare_host and host_of(address) == host_of(peer):
            return True
    return False
