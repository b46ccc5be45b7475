"""Records of a prefill rank's room table, and which claims on a room are valid.

A *claim* is a decode rank's metadata or BOOTSTRAP for a room, or the
prefill leg opening it. The room is the pairing key. The first claim binds
the room to a destination count, each destination (decode rank) to one
endpoint and one generation; a later claim that disagrees with any of these
is refused — never merged — so a stale or foreign message cannot redirect a
room's KV.

Rids: the first claim carrying a *caller* rid (one the client or router
supplied, not one a worker made up) binds the room to it, and a later claim
with a different caller rid is refused (`rid_conflict`). A claim without one
(a PD router that sends no rid, so each worker mints its own) pairs by room
alone: a worker's own rid is local to it and never compared with the other
leg's. The prefill leg's own rid (`PrefillRoom.rid`) names the request in
this worker's engine only.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import Abort, FirstLogprobs, KVLayoutRegister, Status
from pdcluster.runtime.pd.prefix_reuse import ReusedPrefix
from pdcluster.runtime.pd.prompt_digest import PromptId
from pdcluster.runtime.pd.room_phases import PREFILL_STATE, PrefillPhase
from pdcluster.runtime.spec import pages_for


@dataclass(frozen=True)
class PrefillRankInfo:
    """Identity of the rank owning the table."""

    rank: RankCoord
    endpoint: str  # this rank's control endpoint, sent in LayoutAck
    compat: CompatInfo
    token: str | None  # cluster token; None disables the check (tests, trusted dev setups)


@dataclass(frozen=True)
class DestinationView:
    """One decode rank the transfer engine writes a room's KV into."""

    decode_rank: RankCoord
    endpoint: str
    generation: int
    pages: tuple[int, ...]
    layout: KVLayoutRegister  # token stripped
    # Leading pages decode already holds: nothing is written before
    # `prefix_reuse.first_sent_token(reuse, page_size)`.
    reuse: ReusedPrefix | None = None


@dataclass
class Dest:
    decode_rank: RankCoord
    endpoint: str
    generation: int
    pages: tuple[int, ...] | None  # None until metadata (BOOTSTRAP came first)
    prompt: PromptId | None = None  # decode's prompt, from its metadata
    reuse: ReusedPrefix | None = None  # leading pages decode holds, from its metadata
    ready_sent: bool = False
    aborted: bool = False
    dead: bool = False
    incarnation: str | None = None  # the decode rank's pod, as its layout said when it claimed


@dataclass
class PrefillRoom:
    room: int
    rid: str | None  # the prefill leg's rid in this worker's engine; None until opened
    caller_rid: str | None  # the caller rid bound to the room, if any claim carried one
    created_at: float
    deadline: float | None
    phase: PrefillPhase = PrefillPhase.UNOPENED
    reason: str | None = None  # the first failure reason
    expected: int | None = None  # destinations announced by decode
    num_tokens: int | None = None
    prompt: PromptId | None = None  # the prefill leg's prompt, set at open
    page_keys: tuple[bytes, ...] = ()  # reuse-chain keys of its full pages, set at open
    dests: dict[RankCoord, Dest] = field(default_factory=dict)
    first_token: int | None = None
    first_logprobs: FirstLogprobs | None = None
    checksum: int | None = None
    # Per decode rank: the checksum of the KV owed to it (each gets its own slice).
    checksums: dict[RankCoord, int] = field(default_factory=dict)
    inflight: int = 0
    acks: dict[str, int] = field(default_factory=dict)  # endpoint → generation owed an AbortAck

    @property
    def state(self) -> KVPoll:
        return PREFILL_STATE[self.phase]

    @property
    def has_all_destinations(self) -> bool:
        return (
            self.expected is not None
            and len(self.dests) == self.expected
            and all(d.pages is not None for d in self.dests.values())
        )

    def reachable(self) -> list[Dest]:
        return [d for d in self.dests.values() if not d.dead]

    def status(self, d: Dest, rank: RankCoord, state: KVPoll, reason: str | None) -> Status:
        """This rank's status for destination `d`; Success carries first token and checksum."""
        success = state is KVPoll.Success
        return Status(
            room=self.room,
            generation=d.generation,
            rank=rank,
            state=state,
            reason=reason,
            first_token=self.first_token if success else None,
            first_logprobs=self.first_logprobs if success else None,
            checksum=self.checksums.get(d.decode_rank, self.checksum) if success else None,
        )


def rid_conflict(r: PrefillRoom, caller_rid: str | None) -> str | None:
    """Why a claim with `caller_rid` (None: the caller sent no rid) cannot join `r`, or None.

    Only two caller rids are compared; a missing one pairs by room.
    """
    if r.caller_rid is None or caller_rid is None or caller_rid == r.caller_rid:
        return None
    return f"room_conflict: room {r.room} is bound to rid {r.caller_rid!r}, got {caller_rid!r}"


def claim_conflict(
    r: PrefillRoom, rid: str | None, expected: int, decode_rank: RankCoord, endpoint: str
) -> str | None:
    """Why a decode claim (its caller rid or None) cannot join room `r`, or None."""
    if r.state is KVPoll.Failed:
        return f"room_failed: {r.reason}"
    conflict = rid_conflict(r, rid)
    if conflict is not None:
        return conflict
    if r.expected is not None and expected != r.expected:
        return (
            f"room_conflict: room {r.room} expects {r.expected} destinations, "
            f"got a claim of {expected}"
        )
    d = r.dests.get(decode_rank)
    if d is not None and d.endpoint != endpoint:
        return (
            f"room_conflict: decode rank {decode_rank} of room {r.room} is bound to "
            f"{d.endpoint}, refusing a second endpoint {endpoint}"
        )
    if d is None and r.expected is not None and len(r.dests) >= r.expected:
        return f"room_conflict: room {r.room} already has all {r.expected} destinations"
    return None


def abort_matches(r: PrefillRoom, msg: Abort, trusted: bool) -> bool:
    """Whether decode's ABORT `msg` is for the request in room `r`.

    `trusted`: the sender is bound to the room or a registered decode rank.
    With two caller rids, they must be equal. Without (either leg's rid was
    local), the room pairs them, and the sender must be the room's bound
    destination of that generation — or, not bound yet, a registered rank the
    room still has a destination free for: an abort from a rank that cannot
    be one of the room's destinations is about another request.
    """
    if not trusted:
        return False
    if r.caller_rid is not None and msg.rid is not None:
        return msg.rid == r.caller_rid
    d = r.dests.get(msg.decode_rank)
    if d is not None:
        return d.endpoint == msg.decode_endpoint and d.generation == msg.generation
    return r.expected is None or len(r.dests) < r.expected


def page_problem(pages: list[int], num_pages: int) -> str | None:
    """Why a page list cannot be written into a decode pool of `num_pages`, or None."""
    if len(set(pages)) != len(pages):
        return "bad_pages: duplicate page indices"
    top = max(pages)
    if top >= num_pages:
        return f"bad_pages: page {top} outside the decode pool of {num_pages} pages"
    return None


def page_count_problem(r: PrefillRoom, page_size: int) -> str | None:
    """Why a destination's pages cannot hold the opened prompt, or None."""
    if r.num_tokens is None:
        return None
    need = pages_for(r.num_tokens, page_size)
    for d in r.dests.values():
        if d.pages is not None and len(d.pages) < need:
            return (
                f"bad_page_count: decode rank {d.decode_rank} sent {len(d.pages)} pages, "
                f"the prompt of {r.num_tokens} tokens needs {need}"
            )
    return None
