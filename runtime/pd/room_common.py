"""Vocabulary shared by the prefill and decode room tables.

- Errors raised by *local* calls (the worker's own code calling a table):
  every one leaves the table exactly as it was, and `reason` is a short
  machine-readable code (metric label) while the message explains.
  Untrusted *peer* input never raises: it becomes a `Dropped` action or a
  Failed status.
- `RoomLeg`: one leg of a request as either table takes it (checked once).
- `RoomView`: one row of the admin API's room listing.
- `RoomTable`: what both tables share — the room map and its queries, the
  allocation policy check, the admin listing, deadlines armed from the
  phase tables (`room_phases`) and a type → handler dispatch of peer
  messages.
- Peer matching for `fail_peer`: the heartbeat knows a prefill instance by
  its bootstrap address `host:port`, the operator knows a pod by its IP, a
  room knows its peers' ZMQ endpoints `tcp://host:port`. `peer_matches`
  accepts any of those forms (`peer_address.py` names them).

Pure module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from pdcluster.runtime.engine.prefix_cache import KEY_BYTES
from pdcluster.runtime.pd.actions import Action, Dropped
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import MAX_ROOM, Message
from pdcluster.runtime.pd.peer_address import PeerRef
from pdcluster.runtime.pd.prompt_digest import PromptId
from pdcluster.runtime.pd.room_phases import Deadline
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.spec import AllocationPolicy


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
class RoomLeg:
    """One leg of request `rid` for `room`, as it arrives at a rank's room table.

    `num_tokens`: the prompt's length (0: not known; prefill needs it).
    `prompt`: the leg's PromptId (prefill compares it with every destination's;
    decode sends it in every TransferMeta of the room).
    `rid_is_local`: the worker minted `rid` (the caller sent none), so it names
    the request on this instance only: the messages to the other side carry no
    rid, it binds nothing, and the room alone pairs the legs.
    `page_keys` (prefill): the reuse-chain keys of the prompt's full pages,
    which decode's `TransferMeta.reuse` must match (`prefix_reuse`).

    Raises RoomError on a bad room, rid or length.
    """

    room: int
    rid: str
    num_tokens: int = 0
    prompt: PromptId | None = None
    rid_is_local: bool = False
    page_keys: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        check_room(self.room)
        check_rid(self.rid)
        check_int("num_tokens", self.num_tokens, 0, 1 << 31)
        for key in self.page_keys:
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise RoomError(f"a page key is {KEY_BYTES} bytes, got {key!r}", "bad_page_keys")


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


def check_policy(policy: object) -> AllocationPolicy:
    """The compatibility field `allocation_policy` as the spec enum; ValueError otherwise."""
    names = tuple(p.value for p in AllocationPolicy)
    if not isinstance(policy, str) or policy not in names:
        raise ValueError(f"allocation_policy must be one of {names}, got {policy!r}")
    return AllocationPolicy(policy)


def deadline_seconds(settings: RoomSettings, deadline: Deadline, num_tokens: int) -> float:
    """How long a phase with `deadline` may last; the waits are extended per prompt token."""
    setting = deadline[0]
    if setting == "waiting_s":
        return settings.waiting_budget_s(num_tokens)
    if setting == "prefill_wait_s":
        return settings.prefill_wait_budget_s(num_tokens)
    seconds: float = getattr(settings, setting)
    return seconds


class _Record(Protocol):
    room: int
    created_at: float
    deadline: float | None
    reason: str | None

    @property
    def rid(self) -> str | None: ...

    @property
    def state(self) -> KVPoll: ...


R = TypeVar("R", bound=_Record)
# (table, message of the mapped type, now) → actions.
Handler = Callable[[Any, Any, float], list[Action]]


class RoomTable(Generic[R]):
    """The room map one rank keeps, and what reading and timing it takes on both sides."""

    # "room N <where>": the UnknownRoom message of `_live`.
    unknown_room: ClassVar[str] = "is not in this table"
    # Peer message type → the table's handler; anything else was sent the wrong way.
    handlers: ClassVar[Mapping[type, Handler]] = {}

    def __init__(self, policy: object, settings: RoomSettings | None) -> None:
        self.policy = check_policy(policy)
        self.settings = settings or RoomSettings()
        self._rooms: dict[int, R] = {}

    def __contains__(self, room: object) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def state(self, room: int) -> KVPoll | None:
        r = self._rooms.get(room)
        return None if r is None else r.state

    def failure_reason(self, room: int) -> str | None:
        r = self._rooms.get(room)
        return None if r is None else r.reason

    def on_message(self, msg: Message, now: float, sender: str | None = None) -> list[Action]:
        """A decoded peer message. `sender`: the endpoint its connection proved
        (transfer/identity.py); None only for a trusted in-process caller. A
        table that binds a message to its sender overrides this."""
        handler = self.handlers.get(type(msg))
        if handler is None:
            return [Dropped(getattr(msg, "room", None), type(msg).__name__, "wrong_direction")]
        return handler(self, msg, now)

    def _live(self, room: int) -> R:
        r = self._rooms.get(room)
        if r is None:
            raise UnknownRoom(f"room {room} {self.unknown_room}")
        return r

    def _arm(self, r: R, deadline: Deadline | None, now: float, num_tokens: int) -> None:
        r.deadline = (
            None
            if deadline is None
            else now + deadline_seconds(self.settings, deadline, num_tokens)
        )

    def _view(
        self, r: R, now: float, peers: tuple[str, ...], detail: str, generation: int | None = None
    ) -> RoomView:
        return RoomView(
            room=r.room,
            rid=r.rid,
            state=r.state.name,
            age_s=max(0.0, now - r.created_at),
            peers=peers,
            reason=r.reason,
            generation=generation,
            detail=detail,
        )

    @staticmethod
    def _is_due(r: R, now: float) -> bool:
        return r.deadline is not None and now >= r.deadline
