"""What a decode rank remembers about one room and each prefill rank feeding it.

A *source* is one prefill rank that sends part of the room's KV into this
decode rank's pages (see `topology`). The release rule lives here because it
is the one that protects memory: a failed room's pages may be reused only
once every source is *settled* — it never received our page indices, or it
confirmed that its writes drained (an `AbortAck` of the room's generation,
or a Success status, which prefill sends only after draining), or it was
declared dead.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll, Poll
from pdcluster.runtime.pd.messages import FirstLogprobs
from pdcluster.runtime.pd.prompt_digest import PromptId
from pdcluster.runtime.pd.room_phases import DECODE_STATE, DecodePhase


@dataclass(frozen=True)
class Source:
    """One prefill rank a decode rank receives from, as resolved from /route + topology."""

    prefill_rank: RankCoord
    endpoint: str  # the prefill rank's control endpoint
    num_destinations: int  # decode ranks that prefill rank serves for one room
    incarnation: str | None = None  # which start of its pod registered it (None: unknown)


@dataclass
class SourceState:
    source: Source
    poll: Poll | None = None  # None: not heard from yet
    ready: bool = False  # prefill_complete: Ready received
    may_write: bool = False  # our page indices were sent to it
    abort_sent: bool = False
    drained: bool = False  # AbortAck of our generation, or Success
    dead: bool = False
    first_token: int | None = None
    first_logprobs: FirstLogprobs | None = None
    checksum: int | None = None

    @property
    def settled(self) -> bool:
        """It can no longer write into this room's pages."""
        return not self.may_write or self.drained or self.dead

    @property
    def succeeded(self) -> bool:
        return self.poll is not None and self.poll.state is KVPoll.Success


@dataclass
class DecodeRoom:
    room: int
    rid: str
    generation: int
    peer: str  # bootstrap address of the prefill instance
    created_at: float
    deadline: float | None
    phase: DecodePhase = DecodePhase.ROUTING
    reason: str | None = None  # the first failure reason
    sources: dict[RankCoord, SourceState] | None = None  # None until resolved
    pages: tuple[int, ...] | None = None  # owned by the room from assign_pages on
    prompt: PromptId | None = None  # the decode leg's prompt, sent in TransferMeta
    rid_is_local: bool = False  # this worker minted `rid`: it never goes to prefill
    # Which start of the prefill instance the room resolved against (its leader
    # pod's uid, from /route); None until resolved or when the instance says none.
    incarnation: str | None = None

    @property
    def caller_rid(self) -> str | None:
        """The rid sent to prefill: the caller's, or None (a local rid is never compared)."""
        return None if self.rid_is_local else self.rid

    num_tokens: int = 0  # prompt length: sizes the waiting deadlines
    abort_due: float | None = None  # one-sided, failed: when unacked ABORTs go out again

    @property
    def state(self) -> KVPoll:
        return DECODE_STATE[self.phase]

    def all_settled(self) -> bool:
        return self.sources is None or all(s.settled for s in self.sources.values())

    def unsettled(self) -> list[SourceState]:
        return [] if self.sources is None else [s for s in self.sources.values() if not s.settled]
