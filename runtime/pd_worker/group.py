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
distinct magic keeps the two apart. Pure module: msgspec structs only.
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
    """

    peer: str
    reason: str
    gone: bool = True


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


GroupMessage = GroupOpen | GroupPages | GroupFail | GroupFailPeer | GroupReport | GroupStats

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GroupMessage)


class GroupProtocolError(ValueError):
    pass


def is_group_frame(data: bytes) -> bool:
    return data[: len(GROUP_MAGIC)] == GROUP_MAGIC


def encode_group(msg: GroupMessage) -> bytes:
    return GROUP_MAGIC + _encoder.encode(msg)


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
