"""Messages between the ranks of one dp group of a PD instance.

Every rank owns its room table and its transfer endpoint; only the group's
leader (cp = tp = pp = 0) sees HTTP requests and drives the engine. The
leader tells its followers about rooms (`GroupOpen`, `GroupPages`,
`GroupFail`), and each rank reports what its table concluded
(`GroupReport`), so the leader acts only on the agreement of all ranks:
prefill computes once every rank opened the room (under `early`, within
the early-start budget, else once every rank knows its destinations), decode decodes
once every rank received its KV, and pages are freed once every rank let go.
Followers also push their counters (`GroupStats`) so the leader can answer
for the whole group.

These travel on the ranks' control endpoints next to the PD protocol; a
distinct magic keeps the two apart. No frame over `MAX_GROUP_BYTES` is ever
sent (`encode_group` refuses it: a follower would drop it, and the room
wait out its deadline there). A prefill room's page keys grow with its
prompt, so an opening goes out as `wire_messages`: the `GroupOpen` with up
to `PAGE_KEYS_PER_MESSAGE` keys, then the rest in `GroupPageKeys` chunks,
in order on the same connection; a follower's `OpenAssembly` hands the room
on once it holds every key (chunks out of order, or for a room it is not
assembling, fail that room on the rank). The leader applies the whole
opening to itself.

Pure module: msgspec structs only.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from pdcluster.runtime.pd.messages import FirstLogprobs
from pdcluster.runtime.pd.prefix_reuse import ReusedPrefix
from pdcluster.runtime.pd.prompt_digest import PromptId
from pdcluster.runtime.pd.room_common import RoomLeg

GROUP_MAGIC: Final = b"PDG\x01"
MAX_GROUP_BYTES: Final = 1 << 20
# Page keys per message: 18 bytes each in msgpack (a 16-byte key and its
# header), so 32k of them take 576 KiB and leave the rest of the limit free.
PAGE_KEYS_PER_MESSAGE: Final = 1 << 15
# Chunks after a GroupOpen: enough for a room's most pages (`MAX_PAGES_PER_ROOM`).
MAX_KEY_CHUNKS: Final = 64
# Rooms a follower assembles at once (each waits for chunks already on the wire).
MAX_ASSEMBLING_ROOMS: Final = 64

Room = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class GroupOpen(msgspec.Struct, tag="open", frozen=True, forbid_unknown_fields=True):
    """A request for `room` arrived at the leader (prefill or decode leg)."""

    room: Room
    rid: str
    num_tokens: int
    # Decode only: the prefill instance's bootstrap address and dp group.
    peer: str = ""
    prefill_dp: int | None = None
    # The leg's prompt (length + digest): decode sends it in TransferMeta,
    # prefill compares it with decode's before any write.
    prompt: PromptId | None = None
    # The worker minted `rid` (the caller sent none): it never leaves this instance.
    rid_is_local: bool = False
    # Prefill only: the reuse-chain keys of the prompt's full pages, which
    # every rank checks decode's `TransferMeta.reuse` against (`prefix_reuse`).
    page_keys: list[bytes] | None = None
    # On the wire: this many `GroupPageKeys` follow with the rest of the keys.
    key_chunks: Annotated[int, msgspec.Meta(ge=0, le=MAX_KEY_CHUNKS)] = 0

    def leg(self) -> RoomLeg:
        """The leg as the rank's room table takes it (raises RoomError if malformed)."""
        return RoomLeg(
            self.room,
            self.rid,
            self.num_tokens,
            self.prompt,
            self.rid_is_local,
            tuple(self.page_keys or ()),
        )


class GroupPageKeys(msgspec.Struct, tag="page_keys", frozen=True, forbid_unknown_fields=True):
    """Chunk `index` (from 0) of the page keys a room's `GroupOpen` left out."""

    room: Room
    index: Annotated[int, msgspec.Meta(ge=0, lt=MAX_KEY_CHUNKS)]
    keys: Annotated[list[bytes], msgspec.Meta(max_length=PAGE_KEYS_PER_MESSAGE)]


class GroupPages(msgspec.Struct, tag="pages", frozen=True, forbid_unknown_fields=True):
    """Decode: the leader reserved these pages (same indices on every rank).

    `reuse`: the first `reuse.num_pages` of them are cached pages the leader
    referenced for the room; every rank tells its sources not to write them.
    """

    room: Room
    pages: list[int]
    reuse: ReusedPrefix | None = None


class GroupFail(msgspec.Struct, tag="fail", frozen=True, forbid_unknown_fields=True):
    """Fail (abort) the room on this rank with a reason."""

    room: Room
    reason: str


class GroupFailPeer(msgspec.Struct, tag="fail_peer", frozen=True, forbid_unknown_fields=True):
    """Fail every room tied to a peer (a lost pod, reported by the operator).

    `gone`: the peer's processes can no longer run (pod deleted, exited). False
    when it may merely hang (NotReady): a decode rank on a one-sided transport
    then keeps the failed rooms' pages until the peer acks or is declared gone.
    `incarnation`: which start of the peer (a pod uid); None: whatever serves there.
    """

    peer: str
    reason: str
    gone: bool = True
    incarnation: str | None = None


ReportKind = Literal["start", "paired", "ready", "complete", "failed", "released", "succeeded"]


class GroupReport(msgspec.Struct, tag="report", frozen=True, forbid_unknown_fields=True):
    """A rank's table concluded something about a room.

    start: (prefill) the room is open on this rank: it may compute.
    paired: (prefill, early) every destination of this rank is known: its KV may leave.
    ready: (decode, prefill_complete) every source of this rank has its KV computed.
    complete: (decode) every source of this rank sent Success.
    failed: the room failed on this rank (first reason).
    released: the room's pages on this rank may be reused.
    succeeded: (prefill) every destination of this rank got its KV; `sent_tokens`
      prompt tokens of it travelled (decode held the others: prefix reuse).
    """

    room: Room
    rank: int  # rank index inside the group
    kind: ReportKind
    reason: str | None = None
    first_token: int | None = None
    sent_tokens: int | None = None
    first_logprobs: FirstLogprobs | None = None  # with first_token, when asked for


MAX_COUNTERS: Final = 1024


class GroupStats(msgspec.Struct, tag="stats", frozen=True, forbid_unknown_fields=True):
    """A follower's counters (cumulative), pushed to its leader on change and periodically.

    The leader sums them into the instance's `/admin/failures` and `pd_stats`.
    """

    rank: int  # rank index inside the group
    name: str  # its coordinates, for the per-rank breakdown
    counts: Annotated[
        dict[str, Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_COUNTERS)
    ]


GroupMessage = (
    GroupOpen | GroupPageKeys | GroupPages | GroupFail | GroupFailPeer | GroupReport | GroupStats
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GroupMessage)


class GroupProtocolError(ValueError):
    pass


# ------------------------------------------------------------ endpoints at start-up
# Each rank's control endpoint, exchanged once over the group's gloo world as
# fixed-size frames (a 2-byte length, msgpack, zero padding): typed and
# bounded, never a pickle, so nothing a peer sends there is executed.
ENDPOINT_FRAME_BYTES: Final = 320


class RankEndpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    endpoint: Annotated[str, msgspec.Meta(min_length=7, max_length=256, pattern=r"^tcp://")]


_endpoint_decoder = msgspec.msgpack.Decoder(RankEndpoint)


def pack_endpoint(rank: int, endpoint: str) -> bytes:
    """Rank `rank`'s frame of `ENDPOINT_FRAME_BYTES`; GroupProtocolError if it cannot be one."""
    try:
        data = _encoder.encode(msgspec.convert({"rank": rank, "endpoint": endpoint}, RankEndpoint))
    except msgspec.ValidationError as err:
        raise GroupProtocolError(f"bad_endpoint: {err}") from None
    if len(data) + 2 > ENDPOINT_FRAME_BYTES:
        raise GroupProtocolError(f"bad_endpoint: {endpoint!r:.80} is too long")
    return (len(data).to_bytes(2, "little") + data).ljust(ENDPOINT_FRAME_BYTES, b"\0")


def unpack_endpoints(frames: list[bytes]) -> list[str]:
    """Every rank's endpoint, in rank order, from the frames gathered in rank order;
    GroupProtocolError naming the rank whose frame is not its own well-formed one."""
    out: list[str] = []
    for rank, frame in enumerate(frames):
        size = int.from_bytes(frame[:2], "little")
        if len(frame) != ENDPOINT_FRAME_BYTES or size > ENDPOINT_FRAME_BYTES - 2:
            raise GroupProtocolError(f"bad_endpoint: rank {rank}'s frame is malformed")
        try:
            msg = _endpoint_decoder.decode(frame[2 : 2 + size])
        except msgspec.DecodeError as err:
            raise GroupProtocolError(f"bad_endpoint: rank {rank}: {err}") from None
        if msg.rank != rank:
            raise GroupProtocolError(f"bad_endpoint: rank {rank} sent rank {msg.rank}'s frame")
        out.append(msg.endpoint)
    return out


def is_group_frame(data: bytes) -> bool:
    return data[: len(GROUP_MAGIC)] == GROUP_MAGIC


def encode_group(msg: GroupMessage) -> bytes:
    """The frame of `msg`; GroupProtocolError("oversized") past `MAX_GROUP_BYTES`."""
    data = GROUP_MAGIC + _encoder.encode(msg)
    if len(data) > MAX_GROUP_BYTES:
        raise GroupProtocolError(
            f"oversized: a {type(msg).__name__} of {len(data)} bytes is over {MAX_GROUP_BYTES}"
        )
    return data


def wire_messages(msg: GroupMessage) -> list[GroupMessage]:
    """What the followers are sent for `msg`, in order: itself, or a room's
    opening with its page keys past the first `PAGE_KEYS_PER_MESSAGE` in chunks."""
    keys = msg.page_keys if isinstance(msg, GroupOpen) else None
    if keys is None or len(keys) <= PAGE_KEYS_PER_MESSAGE:
        return [msg]
    assert isinstance(msg, GroupOpen)
    n = PAGE_KEYS_PER_MESSAGE
    rest = [keys[i : i + n] for i in range(n, len(keys), n)]
    head = msgspec.structs.replace(msg, page_keys=keys[:n], key_chunks=len(rest))
    chunks = [GroupPageKeys(room=msg.room, index=i, keys=part) for i, part in enumerate(rest)]
    return [head, *chunks]


class OpenAssembly:
    """A follower's openings whose page keys are still arriving in chunks.

    `take` returns the opening to act on once complete (at once for one that
    came whole), else None; GroupProtocolError when a chunk does not continue
    the room it names (that room is given up: it fails on this rank).
    """

    def __init__(self, max_pending: int = MAX_ASSEMBLING_ROOMS) -> None:
        self.max_pending = max_pending
        # room -> (its opening, its keys so far, chunks received)
        self._pending: dict[int, tuple[GroupOpen, list[bytes], int]] = {}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take(self, msg: GroupOpen | GroupPageKeys) -> GroupOpen | None:
        if isinstance(msg, GroupOpen):
            if msg.key_chunks == 0:
                return msg
            if len(self._pending) >= self.max_pending:
                raise GroupProtocolError(
                    f"page_keys_too_many_rooms: {len(self._pending)} openings are assembling"
                )
            self._pending[msg.room] = (msg, list(msg.page_keys or ()), 0)
            return None
        entry = self._pending.get(msg.room)
        if entry is None:
            raise GroupProtocolError(f"page_keys_unknown_room: room {msg.room} is not opening")
        head, keys, received = entry
        if msg.index != received:
            del self._pending[msg.room]
            raise GroupProtocolError(
                f"page_keys_out_of_order: room {msg.room} got chunk {msg.index}, "
                f"expected {received}"
            )
        keys.extend(msg.keys)
        if received + 1 < head.key_chunks:
            self._pending[msg.room] = (head, keys, received + 1)
            return None
        del self._pending[msg.room]
        return msgspec.structs.replace(head, page_keys=keys, key_chunks=0)

    def forget(self, room: int) -> None:
        """The room failed (or concluded) meanwhile: its keys are not wanted."""
        self._pending.pop(room, None)


def decode_group(data: bytes) -> GroupMessage:
    if len(data) > MAX_GROUP_BYTES:
        raise GroupProtocolError("oversized")
    if not is_group_frame(data):
        raise GroupProtocolError("bad_magic")
    try:
        msg: GroupMessage = _decoder.decode(data[len(GROUP_MAGIC) :])
    except msgspec.DecodeError as err:
        raise GroupProtocolError(f"malformed: {err}") from None
    return msg
