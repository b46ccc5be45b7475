"""What the two halves of the connector tell each other, once per vLLM step.

vLLM runs the connector in two halves: a scheduler side (one per engine)
and a worker side (one per rank: tp × pp processes). It hands the scheduler
side's metadata to every worker before each step's forward, and every
worker's output back to the scheduler after it. The connector uses those two
channels as our own workers use their dp group's messages (`pd_worker/group.py`):

scheduler → every rank (`StepCommands`, in order):
    GroupOpen / GroupPages / GroupFail / GroupFailPeer   as our group leader sends them
    Chunk    (prefill) this step computes the prompt's KV up to `end`
    Refuse   (decode) the room cannot open; fail its load at once

every rank → scheduler (`RankNews`, merged over ranks by vLLM):
    the rooms that failed on the rank (first reason), so the scheduler fails
    them on every other rank; the decode rank's peer verdicts; the rank's
    counters (rejected frames, drops…) when they changed.

A `GroupOpen` travels whole (`key_chunks` 0, no `GroupPageKeys`): vLLM's
metadata is no frame of ours, so nothing bounds its size.

Each command names the vLLM request it is about, so a rank can tell vLLM
which requests finished loading or sending.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdcluster.runtime.pd_worker.group import GroupFail, GroupFailPeer, GroupOpen, GroupPages


@dataclass(frozen=True)
class Chunk:
    """Prefill: after this step, tokens [0, end) of the room's prompt have their KV
    in `pages` (the request's block table, as vLLM's scheduler holds it)."""

    room: int
    rid: str
    pages: tuple[int, ...]
    end: int


@dataclass(frozen=True)
class Refuse:
    """Decode: the room cannot open (`reason`): report its load failed at once."""

    room: int
    reason: str


Command = GroupOpen | GroupPages | GroupFail | GroupFailPeer | Chunk | Refuse


@dataclass(frozen=True)
class StepCommands:
    """One step's commands for every rank, in order: (vLLM request id or None, command)."""

    commands: tuple[tuple[str | None, Command], ...] = ()
    # Prefill requests vLLM preempted this step: their blocks may go to other
    # requests before this step's forward, so their sends stop first.
    preempted: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.commands or self.preempted)


@dataclass(frozen=True)
class RankNews:
    """What one rank (or, merged, every rank) tells the scheduler after a step."""

    # Rooms that failed on the rank since its last news, with the first reason.
    failed: Mapping[int, str] = field(default_factory=dict)
    # Decode: the rank's prefill peers declared dead now → why (None: unchanged).
    peers_down: Mapping[str, str] | None = None
    # Each rank's counters, by rank name, when they changed.
    counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def merged(self, other: RankNews) -> RankNews:
        """Both ranks' news: every failed room once (the first reason seen), the
        union of peer verdicts and of rank counters."""
        failed = dict(other.failed) | dict(self.failed)
        if self.peers_down is None:
            peers = other.peers_down
        elif other.peers_down is None:
            peers = self.peers_down
        else:
            peers = dict(other.peers_down) | dict(self.peers_down)
        return RankNews(failed, peers, dict(other.counts) | dict(self.counts))

    def __bool__(self) -> bool:
        return bool(self.failed) or self.peers_down is not None or bool(self.counts)
