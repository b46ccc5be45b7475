"""Backpressure for prefill legs: at most `max_active` rooms run, the rest wait in FIFO order.

A prefill dp group computes and transfers at most `max_active` rooms at
once. A leg arriving beyond that waits in a bounded FIFO queue instead of
being refused; only a leg arriving when the queue is full too is refused
(`QueueFull`, answered 503 with `Retry-After`). Invariants (tested):
- a room is active or queued, never both, and counted once;
- rooms start in arrival order: `release` starts the queue head first, and
  `offer` never lets a newcomer pass a waiting room;
- `len(active) <= max_active` and `len(queued) <= max_queued` at all times;
- a refused offer changes nothing.

Pure module.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import StrEnum

from pdcluster.runtime.bounds import require_at_least


class Offer(StrEnum):
    start = "start"  # run it now
    queued = "queued"  # it waits for a slot


class QueueFull(Exception):
    """Every slot is taken and the queue is full; nothing was changed."""

    reason = "prefill_busy"

    def __init__(self, num_active: int, num_queued: int) -> None:
        super().__init__(
            f"prefill_busy: {num_active} rooms running and {num_queued} queued (both limits "
            "reached); retry later"
        )
        self.num_active = num_active
        self.num_queued = num_queued


class RoomQueue:
    def __init__(self, max_active: int, max_queued: int) -> None:
        require_at_least("RoomQueue", max_active=(max_active, 1), max_queued=(max_queued, 0))
        self.max_active = max_active
        self.max_queued = max_queued
        self._active: set[int] = set()
        self._queued: OrderedDict[int, None] = OrderedDict()

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def __contains__(self, room: object) -> bool:
        return room in self._active or room in self._queued

    def is_full(self) -> bool:
        """Whether a new offer would be refused now."""
        return len(self._active) >= self.max_active and len(self._queued) >= self.max_queued

    def offer(self, room: int) -> Offer:
        """A new leg. Raises ValueError for a room already here, QueueFull past both bounds."""
        if room in self:
            raise ValueError(f"room {room} is already running or queued")
        if len(self._active) < self.max_active and not self._queued:
            self._active.add(room)
            return Offer.start
        if len(self._queued) >= self.max_queued:
            raise QueueFull(len(self._active), len(self._queued))
        self._queued[room] = None
        return Offer.queued

    def release(self, room: int) -> list[int]:
        """`room` ended (wherever it was); returns the queued rooms that start now, in order."""
        self._active.discard(room)
        self._queued.pop(room, None)
        started: list[int] = []
        while self._queued and len(self._active) < self.max_active:
            head, _ = self._queued.popitem(last=False)
            self._active.add(head)
            started.append(head)
        return started
