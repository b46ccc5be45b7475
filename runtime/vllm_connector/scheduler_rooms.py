"""The connector's scheduler half: which vLLM request is which room, what the ranks do next.

This is our group leader's bookkeeping (`pd_worker/coordinator.py`) for an
engine we do not drive: vLLM decides when a request computes and where its
blocks are, and asks the connector at fixed points. Each point maps to a
step of our protocol:

- `on_new_request`: the room opens on every rank (`GroupOpen`; prefill's
  carries the prompt's reuse keys, decode's its prefill instance), or a
  decode room is refused (bad params, an unknown prefill);
- `get_num_new_matched_tokens`: prefill loads nothing; decode the prompt
  minus vLLM's own cached prefix, asynchronously;
- `update_state_after_alloc` (decode): the blocks are the room's pages
  (`GroupPages`; the cached prefix is reused, never written);
- `build_connector_meta` (prefill): each scheduled chunk's KV may leave (`Chunk`);
- `request_finished`: prefill keeps the blocks until every rank released the
  room (an abort fails it first); an unfinished decode load is aborted;
- worker output: a room that failed on one rank fails on every rank.

Phases of an entry (a vLLM request with a room):

    decode:  OPEN ──alloc──► LOADING ──finished_recving──► LOADED
    prefill: OPEN (until vLLM finished the request and every rank let go)

An entry leaves the book when vLLM is done with it: a decode request once it
finished (and its load, if one started, ended); a prefill request once every
rank reported the room released (`finished_sending`). A request vLLM never
gave blocks to a decode load is never reported as loaded (vLLM would not
know it), which is why `Refuse` goes out only with its pages.

Invariants: every `GroupOpen` is followed by a `GroupFail` unless the room
concludes on its own; a decode room gets its pages once; commands leave in
the order they were decided. Nothing here raises on what a request carries:
a bad `kv_transfer_params` becomes a refused room (decode) or an unpaired
request (prefill), counted.

Pure module.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcluster.runtime.pd.instance_counts import RoomFailureTally
from pdcluster.runtime.pd.known_peers import KnownPeers, PeerSetError
from pdcluster.runtime.pd.prefix_reuse import build_reuse, reuse_keys
from pdcluster.runtime.pd.prompt_digest import prompt_id
from pdcluster.runtime.pd_worker.group import GroupFail, GroupFailPeer, GroupOpen, GroupPages
from pdcluster.runtime.spec import Role, pages_for
from pdcluster.runtime.vllm_connector.commands import Chunk, Command, RankNews, Refuse, StepCommands
from pdcluster.runtime.vllm_connector.params import RoomParams


class Phase(enum.Enum):
    OPEN = "open"
    LOADING = "loading"  # decode: pages sent, KV on its way
    LOADED = "loaded"  # decode: every rank received it (or failed it)


@dataclass
class _Entry:
    req_id: str
    room: int
    rid: str
    prompt: Sequence[int]
    phase: Phase = Phase.OPEN
    refused: str | None = None  # decode: why the room never opened
    failed: str | None = None  # the first failure any rank reported
    finished: bool = False  # vLLM finished the request
    sent_upto: int = 0  # prefill: the last chunk's end
    opened_at: float = 0.0


@dataclass
class SchedulerRooms:
    """The scheduler side's rooms of one vLLM engine (one dp group of ours)."""

    role: Role
    page_size: int
    # Decode: the prefill instances it may contact (published by the operator,
    # the launcher or the settings); the token never goes to any other.
    known: KnownPeers = field(default_factory=KnownPeers)
    tally: RoomFailureTally = field(default_factory=lambda: RoomFailureTally(ttl_s=3600.0))
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _rooms: dict[int, str] = field(default_factory=dict)  # room -> req_id
    _queue: list[tuple[str | None, Command]] = field(default_factory=list)
    _preempted: set[str] = field(default_factory=set)
    # Decode: prefill peers a rank declared dead (what the router holds out on),
    # from the step's news or, between steps, from each rank (`rank_peers_down`).
    peers_down: dict[str, str] = field(default_factory=dict)
    _rank_verdicts: dict[str, dict[str, str]] = field(default_factory=dict)
    # Each rank's last counters (rejected frames, drops…), by rank name.
    rank_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    # Requests whose kv_transfer_params could not be used, by label.
    refusals: dict[str, int] = field(default_factory=dict)
    # Decode: prompt tokens asked of prefill, and those vLLM's cache held (reused).
    loaded_tokens: int = 0
    reused_tokens: int = 0

    # ------------------------------------------------------------ vLLM's points
    def open(
        self,
        req_id: str,
        params: RoomParams | None,
        prompt: Sequence[int],
        now: float,
        *,
        params_error: str | None = None,
    ) -> None:
        """A request arrived (`on_new_request`)."""
        if params is None and params_error is None:
            return  # not a PD leg: vLLM serves it alone
        room = params.room if params is not None else -1
        reason = params_error and f"bad_kv_transfer_params: {params_error}"
        if reason is None and room in self._rooms:
            reason = f"room_conflict: room {room} is already in use on this engine"
        if reason is None and not prompt:
            reason = "bad_kv_transfer_params: the prompt is empty"
        if self.role is Role.prefill:
            if reason is not None or params is None:
                self._count(reason or "rejected")
                return  # served alone; its decode leg fails on its own refusal
            self._add(_Entry(req_id, room, params.rid or req_id, prompt, opened_at=now))
            self._queue.append(
                (
                    req_id,
                    GroupOpen(
                        room,
                        params.rid or req_id,
                        len(prompt),
                        prompt=prompt_id(prompt),
                        rid_is_local=params.rid is None,
                        page_keys=reuse_keys(prompt, self.page_size),
                    ),
                )
            )
            return
        peer = None if params is None else params.bootstrap
        if reason is None and peer is None:
            reason = "bad_kv_transfer_params: bootstrap_host and bootstrap_port are required"
        if reason is None and peer is not None:
            try:
                host, _, port = peer.rpartition(":")
                self.known.check(host.strip("[]"), port)
            except PeerSetError as err:
                reason = f"rejected: {err}"
        rid = params.rid if params is not None and params.rid else req_id
        entry = _Entry(req_id, room, rid, prompt, opened_at=now)
        if reason is not None:
            entry.refused = reason
            self._count(reason)
            self._entries[req_id] = entry  # no room: it only waits for its blocks
            return
        assert params is not None and peer is not None
        self._add(entry)
        self._queue.append(
            (
                req_id,
                GroupOpen(
                    room,
                    rid,
                    len(prompt),
                    peer,
                    params.prefill_dp,
                    prompt=prompt_id(prompt),
                    rid_is_local=params.rid is None,
                ),
            )
        )

    def matched_tokens(self, req_id: str, num_local: int) -> tuple[int, bool]:
        """`get_num_new_matched_tokens`: (tokens to load, asynchronously?)."""
        entry = self._entries.get(req_id)
        if self.role is not Role.decode or entry is None or entry.phase is not Phase.OPEN:
            return 0, False
        return max(0, len(entry.prompt) - num_local), True

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """`update_state_after_alloc`: vLLM gave the request its blocks."""
        entry = self._entries.get(req_id)
        if self.role is not Role.decode or entry is None or entry.phase is not Phase.OPEN:
            return
        if num_external <= 0:
            return  # the second call after a load, or nothing to load
        entry.phase = Phase.LOADING
        if entry.refused is not None:
            self._queue.append((req_id, Refuse(entry.room, entry.refused)))
            return
        n = len(entry.prompt)
        num_local = n - num_external
        pages = tuple(block_ids[: pages_for(n, self.page_size)])
        if num_local % self.page_size or len(pages) < pages_for(n, self.page_size):
            reason = (
                f"rejected: vLLM allocated {len(block_ids)} blocks and {num_local} cached "
                f"tokens for a {n}-token prompt of {self.page_size}-token pages"
            )
            self._fail(entry, reason)
            return
        reuse = build_reuse(entry.prompt, num_local // self.page_size, self.page_size)
        self.loaded_tokens += num_external
        self.reused_tokens += num_local
        self._queue.append((req_id, GroupPages(entry.room, list(pages), reuse)))

    def scheduled(self, req_id: str, block_ids: Sequence[int], end: int) -> None:
        """Prefill, `build_connector_meta`: this step computes the prompt up to `end`."""
        entry = self._entries.get(req_id)
        if self.role is not Role.prefill or entry is None or entry.failed is not None:
            return
        end = min(end, len(entry.prompt))
        if end <= entry.sent_upto:
            return
        entry.sent_upto = end
        pages = tuple(block_ids[: pages_for(end, self.page_size)])
        self._queue.append((req_id, Chunk(entry.room, entry.rid, pages, end)))

    def preempted(self, req_ids: Iterable[str]) -> None:
        """vLLM took these requests' blocks back: a prefill room stops sending from them."""
        for req_id in req_ids:
            entry = self._entries.get(req_id)
            if self.role is Role.prefill and entry is not None and entry.failed is None:
                self._preempted.add(req_id)
                self._fail(entry, "preempted: vLLM took the prompt's blocks back")

    def finished(self, req_id: str, *, aborted: bool) -> bool:
        """`request_finished`: True when the blocks must outlive the request (prefill:
        until every rank released the room)."""
        entry = self._entries.get(req_id)
        if entry is None:
            return False
        entry.finished = True
        if self.role is Role.prefill:
            if aborted and entry.failed is None:
                self._fail(entry, "aborted")
            return True
        if entry.phase is Phase.LOADED or (entry.phase is Phase.OPEN and entry.refused):
            self._forget(entry)
        elif entry.phase is Phase.OPEN:
            self._fail(entry, "aborted")
            self._forget(entry)  # no blocks: nothing for vLLM to wait for
        elif entry.failed is None:
            self._fail(entry, "aborted")  # vLLM keeps its blocks until the ranks let go
        return False

    # ------------------------------------------------------------ worker output
    def on_output(
        self,
        finished_recving: Iterable[str],
        finished_sending: Iterable[str],
        news: RankNews | None,
        now: float,
    ) -> None:
        """What the ranks reported after a step (vLLM merged every rank's output)."""
        if news is not None:
            for room, reason in news.failed.items():
                self.tally.record(room, reason, now)
                req_id = self._rooms.get(room)
                entry = None if req_id is None else self._entries.get(req_id)
                if entry is not None and entry.failed is None:
                    self._fail(entry, reason)  # on every rank, not only the one that saw it
            if news.peers_down is not None:
                self.peers_down = dict(news.peers_down)
            for rank, counts in news.counts.items():
                self.rank_counts[rank] = dict(counts)
        for req_id in finished_recving:
            entry = self._entries.get(req_id)
            if entry is not None:
                entry.phase = Phase.LOADED
                if entry.finished:
                    self._forget(entry)
        for req_id in finished_sending:
            entry = self._entries.get(req_id)
            if entry is not None:
                self._forget(entry)

    def rank_peers_down(self, rank: str, verdicts: Mapping[str, str]) -> None:
        """A rank's verdicts now, sent by the rank itself when they change (between
        steps too): `peers_down` is every rank's latest, merged."""
        self._rank_verdicts[rank] = dict(verdicts)
        merged: dict[str, str] = {}
        for each in self._rank_verdicts.values():
            for peer, reason in each.items():
                merged.setdefault(peer, reason)
        self.peers_down = merged

    # ------------------------------------------------------------ admin
    def fail_peer(self, msg: GroupFailPeer) -> None:
        """The operator or the launcher reported a peer lost: every rank fails its rooms."""
        self._queue.append((None, msg))

    def take(self) -> StepCommands:
        """This step's commands (and nothing twice)."""
        out = StepCommands(tuple(self._queue), frozenset(self._preempted))
        self._queue.clear()
        self._preempted.clear()
        return out

    @property
    def has_commands(self) -> bool:
        return bool(self._queue or self._preempted)

    def views(self, now: float) -> list[dict[str, object]]:
        """The admin listing: one row per request with a room."""
        return [
            {
                "room": e.room,
                "request_id": e.req_id,
                "rid": e.rid,
                "phase": e.phase.value,
                "failed": e.failed or e.refused,
                "finished": e.finished,
                "age_s": round(now - e.opened_at, 3),
            }
            for e in self._entries.values()
        ]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._entries

    # ------------------------------------------------------------ helpers
    def _add(self, entry: _Entry) -> None:
        self._entries[entry.req_id] = entry
        self._rooms[entry.room] = entry.req_id

    def _forget(self, entry: _Entry) -> None:
        self._entries.pop(entry.req_id, None)
        if self._rooms.get(entry.room) == entry.req_id:
            del self._rooms[entry.room]

    def _fail(self, entry: _Entry, reason: str) -> None:
        entry.failed = reason
        if self._rooms.get(entry.room) == entry.req_id:
            self._queue.append((entry.req_id, GroupFail(entry.room, reason)))

    def _count(self, reason: str) -> None:
        label = reason.split(":", 1)[0]
        self.refusals[label] = self.refusals.get(label, 0) + 1


MAX_VERDICTS = 1024


def parse_rank_verdicts(body: Any) -> tuple[str, dict[str, str]]:
    """`{"rank": str, "peers_down": {peer: reason}}` as sent by a rank; ValueError else."""
    if not isinstance(body, dict):
        raise ValueError("body must be {rank, peers_down}")
    rank, verdicts = body.get("rank"), body.get("peers_down")
    if not isinstance(rank, str) or not 0 < len(rank) <= 64:
        raise ValueError("rank must be a string of 1..64 characters")
    if not isinstance(verdicts, dict) or len(verdicts) > MAX_VERDICTS:
        raise ValueError(f"peers_down must be an object of at most {MAX_VERDICTS} peers")
    for peer, reason in verdicts.items():
        if not isinstance(reason, str) or len(peer) > 256 or len(reason) > 256:
            raise ValueError("peers_down maps a peer to a reason (strings of 256 at most)")
    return rank, dict(verdicts)
