"""Bounded memory of rooms that have concluded.

A room number identifies one request, not a reusable slot. After a room
fails (or finishes), a late BOOTSTRAP, metadata or open for it must get
Failed — not wait forever, and never attach to another request that happens
to reuse the number. A tombstone remembers the outcome for `ttl` seconds.

Bounds: entries expire after `ttl`; at most `max_entries` are kept (the
oldest is forgotten first), so a flood of rooms cannot grow memory. A
forgotten tombstone degrades to "unknown room", which the prefill table
still answers with a bootstrap timeout, never with a wrong attachment.

Pure module: the caller passes `now` (monotonic seconds).
"""

from __future__ import annotations

from collections import OrderedDict


class Tombstones:
    def __init__(self, ttl: float, max_entries: int = 1 << 16) -> None:
        if ttl <= 0 or max_entries < 1:
            raise ValueError(
                f"tombstones need ttl > 0 and max_entries >= 1, got {ttl}, {max_entries}"
            )
        self.ttl = ttl
        self.max_entries = max_entries
        # Insertion order == expiry order because ttl is constant.
        self._entries: OrderedDict[int, tuple[float, str]] = OrderedDict()

    def add(self, room: int, now: float, reason: str) -> None:
        """Remember `room`'s outcome; an existing tombstone keeps its first reason."""
        self.prune(now)
        if room in self._entries:
            return
        self._entries[room] = (now + self.ttl, reason)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, room: int, now: float) -> str | None:
        """The recorded outcome, or None when the room is not (or no longer) tombstoned."""
        entry = self._entries.get(room)
        if entry is None or entry[0] <= now:
            return None
        return entry[1]

    def prune(self, now: float) -> int:
        removed = 0
        while self._entries:
            room, (expires, _) = next(iter(self._entries.items()))
            if expires > now:
                break
            del self._entries[room]
            removed += 1
        return removed

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, room: object) -> bool:
        return room in self._entries
