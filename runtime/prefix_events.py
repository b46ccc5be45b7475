"""Page-key events: how a worker tells routers which prefixes it has cached.

A worker's prefix cache reports every change of its key set (keys stored,
keys evicted). `KeyEventLog`, on the worker, numbers them (``seq`` 1, 2, …),
keeps the newest in a bounded buffer and keeps a copy of the current key
set. A router follows a worker with `KeyReplica`:

1. it takes a `Snapshot`: the key set as of event ``seq`` (plus the salt,
   page size and tokenizer fingerprint it needs to compute the same keys);
2. it then asks for the events after that ``seq`` and applies them in order.

Rules that make the replica exact:
- an event numbered at or below the replica's ``seq`` is already in it and
  is skipped (a retried fetch cannot apply one twice);
- an event numbered above ``seq + 1`` means one was missed: the replica
  refuses the batch (`Apply.gap`) and the router takes a new snapshot;
- the log answers `SnapshotNeeded` when the asker's ``seq`` is older than
  the oldest event it still holds, newer than its last, or from another
  ``epoch`` (a worker process that restarted starts a new epoch and counts
  from 0 again), so a stale replica is rebuilt, never patched;
- memory at the worker is bounded: at most ``max_keys`` keys across the
  buffered events (oldest dropped first) plus the key set itself, which is
  bounded by the worker's page pool.

Several routers follow one worker independently; each replica converges to
the worker's key set. Pure module: no I/O, no clock, no locks (the worker's
edge serialises calls).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from pdcluster.runtime.prefix_keys import (
    KEY_BYTES,
    PageKey,
    PageKeyError,
    check_page_size,
    parse_key,
    root_key,
)

__all__ = [
    "DEFAULT_MAX_EVENT_KEYS",
    "Apply",
    "EventBatch",
    "KeyEvent",
    "KeyEventLog",
    "KeyReplica",
    "Snapshot",
    "SnapshotNeeded",
    "WireError",
    "parse_batch",
    "parse_snapshot",
]

DEFAULT_MAX_EVENT_KEYS = 65536  # keys buffered across events (~1 MiB)
_MAX_EPOCH_LEN = 64
_MAX_SALT_BYTES = 1 << 16
_MAX_WIRE_KEYS = 1 << 20


class WireError(ValueError):
    """A snapshot or event batch that does not parse; the message says why."""


class SnapshotNeeded(Exception):
    """The log cannot continue the asker's replica: it must take a snapshot."""


@dataclass(frozen=True, slots=True)
class KeyEvent:
    seq: int
    stored: bool  # True: keys entered the cache; False: they were evicted
    keys: tuple[PageKey, ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A worker's key set as of event ``seq``, and what a router needs to
    compute the same keys for a prompt."""

    epoch: str
    seq: int
    keys: frozenset[PageKey]
    salt: bytes
    page_size: int
    tokenizer: str  # the worker's tokenizer fingerprint ("" when unknown)

    @property
    def root(self) -> PageKey:
        return root_key(self.salt)

    def to_wire(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "seq": self.seq,
            "salt": self.salt.hex(),
            "page_size": self.page_size,
            "tokenizer": self.tokenizer,
            "keys": sorted(k.hex() for k in self.keys),
        }


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events after some ``seq``, in order, and the log's last ``seq``."""

    epoch: str
    events: tuple[KeyEvent, ...]
    last_seq: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "last_seq": self.last_seq,
            "events": [
                {"seq": e.seq, "stored": e.stored, "keys": [k.hex() for k in e.keys]}
                for e in self.events
            ],
        }


@dataclass(eq=False)
class KeyEventLog:
    """The worker's side: numbered events, a bounded buffer, the current keys."""

    epoch: str
    _: KW_ONLY
    salt: bytes
    page_size: int
    tokenizer: str = ""
    max_keys: int = DEFAULT_MAX_EVENT_KEYS
    _keys: set[PageKey] = field(default_factory=set, init=False, repr=False)
    _events: deque[KeyEvent] = field(default_factory=deque, init=False, repr=False)
    _num_buffered_keys: int = field(default=0, init=False, repr=False)
    _seq: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)
        check_page_size(self.page_size)
        max_keys = self.max_keys
        if not isinstance(max_keys, int) or isinstance(max_keys, bool) or max_keys < 1:
            raise ValueError(f"max_keys must be a positive integer, got {max_keys!r}")
        root_key(self.salt)  # a bad salt fails here, not at the first snapshot

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def num_buffered_keys(self) -> int:
        return self._num_buffered_keys

    @property
    def oldest_seq(self) -> int:
        """The first event still buffered (``last_seq + 1`` when none is)."""
        return self._events[0].seq if self._events else self._seq + 1

    def record(self, stored: bool, keys: Sequence[PageKey]) -> KeyEvent | None:
        """Number and keep one change of the cache's key set (None for an empty one).

        Refuses, changing nothing, a malformed key, a key listed twice, a
        stored key already present or an evicted key not present: the cache
        never reports those, so one would mean the copy has drifted.
        """
        batch = tuple(keys)
        seen: set[PageKey] = set()
        for key in batch:
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise ValueError(f"a page key is {KEY_BYTES} bytes, got {key!r:.60}")
            if key in seen:
                raise ValueError(f"key {key.hex()} listed twice in one event")
            seen.add(key)
            if stored == (key in self._keys):
                state = "already cached" if stored else "not cached"
                raise ValueError(f"key {key.hex()} is {state}")
        if not batch:
            return None
        self._seq += 1
        event = KeyEvent(self._seq, bool(stored), batch)
        (self._keys.update if stored else self._keys.difference_update)(batch)
        self._events.append(event)
        self._num_buffered_keys += len(batch)
        # Keep the newest event even when it alone is over the bound.
        while self._num_buffered_keys > self.max_keys and len(self._events) > 1:
            self._num_buffered_keys -= len(self._events.popleft().keys)
        return event

    def snapshot(self) -> Snapshot:
        return Snapshot(
            epoch=self.epoch,
            seq=self._seq,
            keys=frozenset(self._keys),
            salt=self.salt,
            page_size=self.page_size,
            tokenizer=self.tokenizer,
        )

    def events_after(self, epoch: str, seq: int, limit: int = 1024) -> EventBatch:
        """The events numbered above ``seq`` (at most ``limit``), or raise
        `SnapshotNeeded` when they cannot all be given."""
        if epoch != self.epoch:
            raise SnapshotNeeded(f"epoch {epoch!r:.70} is not this worker's ({self.epoch!r})")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0 or seq > self._seq:
            raise SnapshotNeeded(f"seq {seq!r} is outside 0..{self._seq}")
        if seq + 1 < self.oldest_seq:
            raise SnapshotNeeded(
                f"events after {seq} were dropped (the oldest kept is {self.oldest_seq})"
            )
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        skip = seq + 1 - self.oldest_seq
        events = tuple(self._events[i] for i in range(skip, min(len(self._events), skip + limit)))
        return EventBatch(self.epoch, events, self._seq)


class Apply(enum.Enum):
    applied = "applied"  # the replica now includes every event of the batch
    gap = "gap"  # an event is missing: take a new snapshot
    other_epoch = "other_epoch"  # the worker restarted: take a new snapshot


class KeyReplica:
    """A router's exact copy of one worker's key set (`snapshot`, then `apply`)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.epoch = snapshot.epoch
        self.seq = snapshot.seq
        self.salt = snapshot.salt
        self.page_size = snapshot.page_size
        self.tokenizer = snapshot.tokenizer
        self.root = snapshot.root
        self.keys: set[PageKey] = set(snapshot.keys)
        self.last_seq_seen = snapshot.seq

    def apply(self, batch: EventBatch) -> Apply:
        """Fold a batch in, all or nothing: a batch with a gap changes nothing.

        A batch may stop short of ``last_seq`` (the log caps its size); the
        replica then holds what it got and the caller asks again
        (`is_behind`).
        """
        if batch.epoch != self.epoch:
            return Apply.other_epoch
        if batch.last_seq < self.seq:
            return Apply.gap  # the worker says it is behind us: not the same history
        expected = self.seq
        fresh: list[KeyEvent] = []
        for event in batch.events:
            if event.seq <= expected:
                continue  # already applied (a retried or overlapping fetch)
            if event.seq != expected + 1 or event.seq > batch.last_seq:
                return Apply.gap
            fresh.append(event)
            expected = event.seq
        if not fresh and expected < batch.last_seq:
            return Apply.gap  # events exist that the batch does not carry
        _fold(self.keys, fresh)
        self.seq = expected
        self.last_seq_seen = batch.last_seq
        return Apply.applied

    @property
    def is_behind(self) -> bool:
        """Whether the last batch said more events exist than it carried."""
        return self.last_seq_seen > self.seq

    def num_cached_pages(self, keys: Iterable[PageKey]) -> int:
        """How many of a prompt's leading page keys (in order) this worker holds."""
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n


def _fold(keys: set[PageKey], events: Iterable[KeyEvent]) -> None:
    for event in events:
        if event.stored:
            keys.update(event.keys)
        else:
            keys.difference_update(event.keys)


def _check_epoch(epoch: object) -> None:
    if not isinstance(epoch, str) or not 0 < len(epoch) <= _MAX_EPOCH_LEN:
        raise ValueError(f"epoch must be a string of 1..{_MAX_EPOCH_LEN} characters")


# ---- wire -----------------------------------------------------------------


def _int(obj: Mapping[str, Any], name: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WireError(f"{name} must be a non-negative integer, got {value!r:.60}")
    return value


def _keys(value: object) -> list[PageKey]:
    if not isinstance(value, list) or len(value) > _MAX_WIRE_KEYS:
        raise WireError(f"keys must be a list of at most {_MAX_WIRE_KEYS} hex keys")
    try:
        return [parse_key(k) for k in value]
    except PageKeyError as err:
        raise WireError(str(err)) from None


def _epoch(obj: Mapping[str, Any]) -> str:
    epoch = obj.get("epoch")
    try:
        _check_epoch(epoch)
    except ValueError as err:
        raise WireError(str(err)) from None
    assert isinstance(epoch, str)
    return epoch


def parse_snapshot(obj: object) -> Snapshot:
    """A `Snapshot` from its JSON form, or `WireError` naming the bad field."""
    if not isinstance(obj, Mapping):
        raise WireError(f"a snapshot is a JSON object, got {type(obj).__name__}")
    salt_hex = obj.get("salt")
    if not isinstance(salt_hex, str) or len(salt_hex) > 2 * _MAX_SALT_BYTES:
        raise WireError("salt must be a hex string")
    try:
        salt = bytes.fromhex(salt_hex)
    except ValueError:
        raise WireError("salt must be a hex string") from None
    page_size = _int(obj, "page_size")
    if page_size < 1:
        raise WireError("page_size must be >= 1")
    tokenizer = obj.get("tokenizer", "")
    if not isinstance(tokenizer, str) or len(tokenizer) > 256:
        raise WireError("tokenizer must be a string of at most 256 characters")
    return Snapshot(
        epoch=_epoch(obj),
        seq=_int(obj, "seq"),
        keys=frozenset(_keys(obj.get("keys"))),
        salt=salt,
        page_size=page_size,
        tokenizer=tokenizer,
    )


def parse_batch(obj: object) -> EventBatch:
    """An `EventBatch` from its JSON form, or `WireError` naming the bad field."""
    if not isinstance(obj, Mapping):
        raise WireError(f"an event batch is a JSON object, got {type(obj).__name__}")
    raw = obj.get("events")
    if not isinstance(raw, list):
        raise WireError("events must be a list")
    events = []
    for item in raw:
        if not isinstance(item, Mapping) or not isinstance(item.get("stored"), bool):
            raise WireError("an event is {seq, stored: bool, keys}")
        events.append(KeyEvent(_int(item, "seq"), item["stored"], tuple(_keys(item.get("keys")))))
    return EventBatch(_epoch(obj), tuple(events), _int(obj, "last_seq"))
