"""The worker half's book: a rank's room reports turned into what vLLM asks each step.

A rank runs our own rank agent (`pd_worker/prefill_agent.py`,
`decode_agent.py`) on vLLM's KV cache; the agent reports what its room table
concluded (`GroupReport`: start, failed, complete, released, …), as it does
to our group leader. vLLM asks each rank, after every step, which requests
finished loading (decode) or sending (prefill) and which loads failed. The
rules, per rank:

decode
- `complete` (every source sent Success; no frame can land any more) →
  the request finished loading;
- `failed` then `released` (the pages may be reused: every source acked the
  ABORT, is gone, or never wrote) → finished loading, *and* failed; vLLM then
  applies `kv_load_failure_policy` (error to the client, or recompute);
- a refused room (`Refuse`) has nothing in flight: failed at once;
- a room that failed before vLLM gave it pages waits for them (the
  scheduler may have allocated them before it heard of the failure) and is
  reported failed when they come; if the request ends first it is dropped
  unreported: vLLM did not wait for it.

prefill
- the room's blocks may be freed once the rank `released` it (every write
  drained: Success acknowledged, or an abort's writes finished) *and* vLLM
  finished the request (it names requests in `finished_req_ids`); a room
  that failed before it opened on the rank (`failed` without `start`) held
  nothing.

Every request is reported once. Rooms failed here also go to the scheduler
(`RankNews.failed`), which fails them on the other ranks.

Pure module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pdcluster.runtime.pd_worker.group import GroupReport
from pdcluster.runtime.spec import Role
from pdcluster.runtime.vllm_connector.commands import RankNews


@dataclass
class _Room:
    req_id: str
    has_pages: bool = False  # decode: vLLM waits for this load
    started: bool = False  # prefill: the room opened on this rank
    failed: str | None = None
    released: bool = False
    done: bool = False  # reported to vLLM


@dataclass(frozen=True)
class Finished:
    """One step's answer to vLLM's `get_finished` (this rank's)."""

    sending: frozenset[str] = frozenset()
    recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()


@dataclass
class WorkerRooms:
    role: Role
    _rooms: dict[int, _Room] = field(default_factory=dict)
    _by_req: dict[str, int] = field(default_factory=dict)
    _vllm_finished: set[str] = field(default_factory=set)
    _sending: set[str] = field(default_factory=set)
    _recving: set[str] = field(default_factory=set)
    _failed_recving: set[str] = field(default_factory=set)
    _news_failed: dict[int, str] = field(default_factory=dict)
    _peers_down: dict[str, str] | None = None
    _peers_sent: dict[str, str] | None = None
    _counts: tuple[str, dict[str, int]] | None = None
    _counts_sent: dict[str, int] | None = None
    # Prefill: prompt tokens whose KV left this rank (rooms that succeeded).
    sent_tokens: int = 0

    # ------------------------------------------------------------ commands
    def opened(self, req_id: str, room: int) -> None:
        """The scheduler opened the room for this request (`GroupOpen`)."""
        self._rooms[room] = _Room(req_id)
        self._by_req[req_id] = room

    def pages(self, room: int) -> None:
        """Decode: vLLM allocated the room's blocks and waits for its load."""
        r = self._rooms.get(room)
        if r is not None:
            r.has_pages = True
            self._settle(room, r)

    def refused(self, req_id: str, room: int, reason: str) -> None:
        """Decode: the room never opened; vLLM waits on its blocks: fail the load now."""
        self._news_failed.setdefault(room, reason)
        self._recving.add(req_id)
        self._failed_recving.add(req_id)

    # ------------------------------------------------------------ reports
    def report(self, rep: GroupReport) -> None:
        """What this rank's room table concluded (the agent's report)."""
        r = self._rooms.get(rep.room)
        if r is None:
            return
        if rep.kind == "start":
            r.started = True
        elif rep.kind == "failed":
            if r.failed is None:
                r.failed = rep.reason or "failed"
                self._news_failed.setdefault(rep.room, r.failed)
            if self.role is Role.prefill and not r.started:
                r.released = True  # refused at open: nothing of it was ever held
        elif rep.kind == "complete" and self.role is Role.decode and r.failed is None:
            if r.has_pages and not r.done:
                r.done = True
                self._recving.add(r.req_id)
        elif rep.kind == "released":
            r.released = True
        elif rep.kind == "succeeded":
            self.sent_tokens += rep.sent_tokens or 0
        self._settle(rep.room, r)

    def vllm_finished(self, req_ids: Iterable[str]) -> None:
        """vLLM finished these requests (its `finished_req_ids` of a step)."""
        for req_id in req_ids:
            room = self._by_req.get(req_id)
            if room is not None:
                self._vllm_finished.add(req_id)
                self._settle(room, self._rooms[room])

    def peers_down(self, verdicts: Mapping[str, str]) -> None:
        """Decode: the rank's peer verdicts now (sent to the scheduler when they change)."""
        self._peers_down = dict(verdicts)

    def counters(self, rank: str, counts: Mapping[str, int]) -> None:
        """The rank's counters now (sent to the scheduler when they change)."""
        self._counts = (rank, dict(counts))

    # ------------------------------------------------------------ vLLM asks
    @property
    def has_finished(self) -> bool:
        """Some request's load or send ended since the last `take_finished`."""
        return bool(self._sending or self._recving or self._failed_recving)

    def take_finished(self) -> Finished:
        out = Finished(
            frozenset(self._sending), frozenset(self._recving), frozenset(self._failed_recving)
        )
        self._sending.clear()
        self._recving.clear()
        self._failed_recving.clear()
        return out

    def take_news(self) -> RankNews:
        peers = None
        if self._peers_down is not None and self._peers_down != self._peers_sent:
            peers = self._peers_sent = self._peers_down
        counts: dict[str, dict[str, int]] = {}
        if self._counts is not None and self._counts[1] != self._counts_sent:
            counts[self._counts[0]] = self._counts_sent = self._counts[1]
        news = RankNews(dict(self._news_failed), peers, counts)
        self._news_failed.clear()
        return news

    def holds(self, req_id: str) -> bool:
        return req_id in self._by_req

    def __len__(self) -> int:
        return len(self._rooms)

    # ------------------------------------------------------------ helpers
    def _settle(self, room: int, r: _Room) -> None:
        if self.role is Role.decode:
            if not r.done and r.failed is not None and r.released and r.has_pages:
                r.done = True
                self._recving.add(r.req_id)
                self._failed_recving.add(r.req_id)
            if (r.done and r.released) or (not r.has_pages and r.req_id in self._vllm_finished):
                self._forget(room, r)
            return
        if r.released and r.req_id in self._vllm_finished:
            self._sending.add(r.req_id)
            self._forget(room, r)

    def _forget(self, room: int, r: _Room) -> None:
        self._rooms.pop(room, None)
        self._vllm_finished.discard(r.req_id)
        if self._by_req.get(r.req_id) == room:
            del self._by_req[r.req_id]
