"""Wire messages of the PD control plane (ZMQ frames between decode and prefill ranks).

A frame is `MAGIC (3 bytes) + PROTOCOL_VERSION (1 byte) + msgpack body`; the
body is one of the tagged msgspec Structs below (field `type` names it).
Never pickle: a frame from a peer is untrusted input.

Decode rank → prefill rank:
- `KVLayoutRegister` once per peer, before any room traffic (carries the
  cluster token and the decode rank's KV layout and compatibility fields);
- `TransferMeta` per room: destination page indices, generation, how many
  decode ranks this prefill rank must hear from for the room, and the
  `PromptId` of decode's prompt (prefill fails the room before any write
  when its own prompt differs: `prompt_digest`); since version 3 also the
  leading pages decode already holds (`reuse`, `prefix_reuse`), which
  prefill must not write;
- `Bootstrap` per room under the `prefill_complete` policy (endpoint first,
  pages later);
- `Abort(room, generation, rid)` once per notified prefill rank.

The room is the pairing key (docs/design.md §3). The `rid` of `TransferMeta`,
`Bootstrap` and `Abort` is the rid the *caller* gave the decode leg, or None
when it gave none: a rid a worker made up itself is local to that worker and
never leaves it. A prefill rank checks a rid↔room binding only when both
legs carry a caller rid (`prefill_claims.rid_conflict`). Version 2 made the
field optional with this meaning; version 1 sent the decode worker's own rid
whoever minted it, and a v1 frame is rejected (`unsupported_version`) rather
than read with the wrong meaning.

Prefill rank → decode rank:
- `LayoutAck` answering a registration (accepted, or why not) — also sent,
  rejected, for a claim from an endpoint that is not registered, so decode
  registers again instead of waiting on a silent drop;
- `Ready` under `prefill_complete`: "the KV is computed", once per destination;
- `Status` with the prefill rank's KVPoll for a room; the Success status is
  the last message of a transfer and carries the first sampled token (every
  prefill rank should carry it; decode takes the first one it sees) and the
  optional checksum of the pages that rank wrote;
- `AbortAck(room, rank, generation)` once the rank's writes into the room's
  pages have drained.
KV payload bytes never ride inside these messages (tcp payload frames are
the transfer engine's own format).

`decode(data)` raises only `ProtocolError(reason)`; reasons are the
`REJECT_*` constants, counted in a `ProtocolStats` when one is passed.
Frames over `MAX_FRAME_BYTES` (1 MiB: room for ~200k page indices) are
rejected before parsing.

Pure module.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Annotated, Final, Literal

import msgspec

from pdcluster.runtime.engine.sampling import MAX_LOGPROBS, TokenLogprobs
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.prefix_reuse import ReusedPrefix
from pdcluster.runtime.pd.prompt_digest import PromptId
from pdcluster.runtime.spec import pages_for

# 2: TransferMeta carries decode's PromptId, and the rid of TransferMeta,
# Bootstrap and Abort is the caller's or None. A version-1 peer would read
# both differently, so mixed versions are refused at the frame header.
# 3: TransferMeta may carry `reuse` (decode holds the leading pages; prefill
# must not write them). A version-2 prefill would ignore it and overwrite
# pages other sequences read, so a version-2 frame is refused too.
# 4: KVLayoutRegister may carry the decode rank's `incarnation`. A version-3
# prefill refuses the unknown field (and the layout with it): refused at the
# frame header instead, where the version names the cause.
# 5: CompatInfo publishes the model's KV geometry (layers, KV heads, head
# size) and `kv_layout` may name any axis order (vLLM's pages), so a peer
# that cannot parse those fields is refused at the header, not mid-handshake.
PROTOCOL_VERSION: Final = 5
MAGIC: Final = b"PDC"
HEADER: Final = MAGIC + bytes([PROTOCOL_VERSION])
HEADER_LEN: Final = len(HEADER)
MAX_FRAME_BYTES: Final = 1 << 20

REJECT_OVERSIZED: Final = "oversized"
REJECT_TRUNCATED: Final = "truncated"
REJECT_BAD_MAGIC: Final = "bad_magic"
REJECT_VERSION: Final = "unsupported_version"
REJECT_MALFORMED: Final = "malformed"
REJECT_UNKNOWN_TYPE: Final = "unknown_type"
REJECT_INVALID_FIELD: Final = "invalid_field"

MAX_ROOM: Final = (1 << 63) - 1
# Page indices per TransferMeta: at <= 5 bytes each this stays under the frame limit.
MAX_PAGES_PER_ROOM: Final = 1 << 17


def room_size_problem(num_tokens: int, page_size: int) -> str | None:
    """Why a prompt of `num_tokens` cannot travel as one PD room (more pages than
    a TransferMeta names), or None: refused up front, before any room exists."""
    pages = pages_for(num_tokens, page_size)
    if pages <= MAX_PAGES_PER_ROOM:
        return None
    return (
        f"prompt_too_long: a {num_tokens}-token prompt takes {pages} pages of {page_size} "
        f"tokens; a PD request moves at most {MAX_PAGES_PER_ROOM} pages "
        f"({MAX_PAGES_PER_ROOM * page_size} tokens)"
    )


Room = Annotated[int, msgspec.Meta(ge=0, le=MAX_ROOM)]
Generation = Annotated[int, msgspec.Meta(ge=0, le=MAX_ROOM)]
PageIndex = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Count = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
Rid = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Endpoint = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Reason = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Token = Annotated[str, msgspec.Meta(max_length=512)]
Path = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
LayerOrHead = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
# Alternatives a request's logprobs may list per position (engine/sampling.py).
MAX_TOP_LOGPROBS: Final = MAX_LOGPROBS
Checksum = Annotated[int, msgspec.Meta(ge=0, le=MAX_ROOM)]  # 63-bit digest
Incarnation = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class ProtocolError(ValueError):
    """A frame that is not a valid control message of this protocol version."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    pass


# Version of `NixlRegion`, checked on its own: the NIXL fields may change
# without the rest of the protocol changing.
NIXL_REGION_VERSION: Final = 1
MAX_NIXL_METADATA_BYTES: Final = 64 * 1024


class NixlRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a prefill rank needs to WRITE into a decode rank's pool with NIXL.

    `agent_metadata` is the NIXL agent's own serialized form
    (`get_agent_metadata`, handed to `add_remote_agent`), never a pickle;
    the pool is one registered region `[base_address, base_address + nbytes)`
    laid out as the registration's layout fields say.
    """

    version: Annotated[int, msgspec.Meta(ge=1, le=255)]
    agent_name: Endpoint
    agent_metadata: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_NIXL_METADATA_BYTES)]
    mem_type: Literal["DRAM", "VRAM"]
    device_id: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    base_address: Annotated[int, msgspec.Meta(ge=1, le=MAX_ROOM)]  # < 2**63
    nbytes: Annotated[int, msgspec.Meta(ge=1, lt=1 << 48)]

    def __post_init__(self) -> None:
        if self.version != NIXL_REGION_VERSION:
            raise ValueError(
                f"nixl region version {self.version}, this rank reads {NIXL_REGION_VERSION}"
            )
        if self.base_address + self.nbytes > MAX_ROOM:
            raise ValueError("nixl region ends past the 63-bit address space")


class KVLayoutRegister(_Msg, tag="layout", frozen=True):
    token: Token
    decode_rank: RankCoord
    decode_endpoint: Endpoint
    compat: CompatInfo
    num_pages: Annotated[int, msgspec.Meta(ge=1, le=1 << 31)]
    layer_start: LayerOrHead
    layer_end: LayerOrHead
    head_start: LayerOrHead
    head_end: LayerOrHead
    # Same-node shared KV pool (`shm` transport); None for tcp.
    shm_pool_path: Path | None = None
    # The pool registered with this rank's NIXL agent (`nixl` transport).
    nixl: NixlRegion | None = None
    # Version 4: which start of the decode rank's pod (its uid; None in local
    # mode): an operator report about a predecessor at the same address then
    # fails none of this one's rooms (`incarnations`).
    incarnation: Incarnation | None = None

    def __post_init__(self) -> None:
        if self.layer_end <= self.layer_start:
            raise ValueError(f"empty layer range [{self.layer_start}, {self.layer_end})")
        if self.head_end <= self.head_start:
            raise ValueError(f"empty head range [{self.head_start}, {self.head_end})")


class LayoutAck(_Msg, tag="layout_ack", frozen=True):
    rank: RankCoord  # the prefill rank answering
    endpoint: Endpoint  # its control endpoint (rank coords alone repeat across instances)
    accepted: bool
    reason: Reason | None = None


class _RoomMsg(_Msg, frozen=True):
    """A message about one room; `generation` tells its successive decode legs apart."""

    room: Room
    generation: Generation


class _DecodeRoomMsg(_RoomMsg, frozen=True):
    """A decode rank's message about one of its rooms."""

    rid: Rid | None  # the caller's rid of the decode leg; None: the caller sent none
    decode_rank: RankCoord
    decode_endpoint: Endpoint


class TransferMeta(_DecodeRoomMsg, tag="meta", frozen=True):
    # The decode rank's whole page table for the prompt; each prefill rank
    # writes the part its topology slice covers.
    dst_pages: Annotated[list[PageIndex], msgspec.Meta(min_length=1, max_length=MAX_PAGES_PER_ROOM)]
    # Distinct decode ranks this prefill rank must hear from for the room.
    num_destinations: Count
    # Decode's prompt (length + digest of its token ids). Our decode always
    # sends it; a frame without it is compared with nothing.
    prompt: PromptId | None = None
    # Version 3: decode already holds the first `reuse.num_pages` pages of
    # `dst_pages` (its prefix cache); prefill writes only the tokens after
    # them (`prefix_reuse`). None: write the whole prompt.
    reuse: ReusedPrefix | None = None

    def __post_init__(self) -> None:
        if self.reuse is not None and self.reuse.num_pages >= len(self.dst_pages):
            raise ValueError(
                f"reuse of {self.reuse.num_pages} pages leaves none of the "
                f"{len(self.dst_pages)} destination pages to write"
            )


class Bootstrap(_DecodeRoomMsg, tag="bootstrap", frozen=True):
    num_destinations: Count


class Abort(_RoomMsg, tag="abort", frozen=True):
    # As in TransferMeta. A caller rid must match the room's; without one the
    # room, the sender's binding and its generation decide (`abort_matches`).
    rid: Rid | None
    reason: Reason
    decode_rank: RankCoord
    decode_endpoint: Endpoint


class Ready(_RoomMsg, tag="ready", frozen=True):
    rank: RankCoord


class FirstLogprobs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The first token's log-probabilities, computed where prefill sampled it
    (only for a request that asked for logprobs)."""

    logprob: float
    top: Annotated[
        tuple[tuple[TokenId, float], ...], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)
    ] = ()

    @classmethod
    def of(cls, logprobs: TokenLogprobs | None) -> FirstLogprobs | None:
        return None if logprobs is None else cls(logprobs.logprob, tuple(logprobs.top))

    def to_engine(self) -> TokenLogprobs:
        return TokenLogprobs(self.logprob, tuple(self.top))


class Status(_RoomMsg, tag="status", frozen=True):
    rank: RankCoord
    state: KVPoll
    reason: Reason | None = None
    first_token: TokenId | None = None
    checksum: Checksum | None = None
    # With Success, when the request asked for logprobs. Optional: a peer that
    # does not know the field sends none, and one that does not read it skips it.
    first_logprobs: FirstLogprobs | None = None


class AbortAck(_Msg, tag="abort_ack", frozen=True):
    room: Room
    rank: RankCoord
    generation: Generation


Message = (
    KVLayoutRegister | LayoutAck | TransferMeta | Bootstrap | Abort | Ready | Status | AbortAck
)
DecodeToPrefill = KVLayoutRegister | TransferMeta | Bootstrap | Abort
PrefillToDecode = LayoutAck | Ready | Status | AbortAck

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


class ProtocolStats:
    """Rejected frames by reason; one per socket or process, read by metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rejects: Counter[str] = Counter()

    def count(self, reason: str) -> None:
        with self._lock:
            self._rejects[reason] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._rejects)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._rejects.values())


def encode(msg: Message) -> bytes:
    """One frame. Raises ProtocolError(oversized) instead of emitting a frame peers reject."""
    body = _encoder.encode(msg)
    if len(body) + HEADER_LEN > MAX_FRAME_BYTES:
        raise ProtocolError(
            REJECT_OVERSIZED, f"{type(msg).__name__} encodes to {len(body) + HEADER_LEN} bytes"
        )
    return HEADER + body


def is_control_frame(data: bytes | bytearray | memoryview) -> bool:
    """Whether `data` starts like a control frame (any version)."""
    return bytes(data[: len(MAGIC)]) == MAGIC


def decode(data: bytes | bytearray | memoryview, stats: ProtocolStats | None = None) -> Message:
    """Parse one frame; raise ProtocolError (and count it) on anything invalid."""
    try:
        return _decode(data)
    except ProtocolError as err:
        if stats is not None:
            stats.count(err.reason)
        raise


def _decode(data: bytes | bytearray | memoryview) -> Message:
    size = len(data)
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(REJECT_OVERSIZED, f"{size} bytes > limit {MAX_FRAME_BYTES}")
    if size <= HEADER_LEN:
        raise ProtocolError(REJECT_TRUNCATED, f"{size} bytes, header alone is {HEADER_LEN}")
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ProtocolError(REJECT_BAD_MAGIC, "not a PD control frame")
    version = view[len(MAGIC)]
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            REJECT_VERSION, f"frame version {version}, this side speaks {PROTOCOL_VERSION}"
        )
    try:
        return _decoder.decode(view[HEADER_LEN:])
    except msgspec.ValidationError as err:
        text = str(err)
        if text.endswith("`$.type`") or "Object missing required field `type`" in text:
            raise ProtocolError(REJECT_UNKNOWN_TYPE, text) from None
        raise ProtocolError(REJECT_INVALID_FIELD, text) from None
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as err:
        raise ProtocolError(REJECT_MALFORMED, str(err)) from None
