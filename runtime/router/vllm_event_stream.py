"""Following one vLLM worker's prefix-cache event stream: the sequence rules.

vLLM numbers its event batches 0, 1, … per process and replays the newest
it kept on request (`vllm/kv_events.py`). A router follows a worker with one
`VllmEventStream`: the I/O loop (`vllm_prefix_feed.py`) hands it the batches
it reads from the worker's PUB socket (`on_live`) and from its replay socket
(`on_replay`, `on_replay_end`, `on_replay_failed`), frames it could not read
(`on_bad_frame`) and a lost connection (`on_disconnect`); the stream answers
with actions: `ResetIndex` (follow the worker anew, from an empty key set),
`ApplyKeys` (key changes for `PrefixIndex.apply`) and `RequestReplay`.

So the router's index (`prefix_index.py`: a `KeyReplica` per worker, the
same one `cache_aware` reads for our own workers) holds vLLM's cache as our
page keys (`vllm_block_keys.py`), numbered in our own epochs.

Rules:
- the stream starts empty and asks for a replay from batch 0, so a router
  that starts (or restarts) after the worker still learns what it cached;
- batches apply in order, each once: one numbered below the next expected
  is a duplicate (the replay and the live socket overlap) and is skipped;
  one numbered above it is a gap: the stream asks for a replay from the next
  expected batch and reads nothing live until it ended;
- a replay that does not reach back to the batch expected (vLLM dropped it
  from its buffer), ends short of the live batch that revealed the gap, or
  does not answer: the entries are dropped (`ResetIndex`) and the stream
  starts again from the oldest batch it gets. The key set is then a subset
  of the worker's (blocks cached before that batch are not known), never
  more: the router misses a prefix rather than claim one that is gone;
- a frame that does not decode: the batch's changes are unknown, so the
  entries are dropped; no replay is asked (it would hand the same frame
  back), the next batch starts the set anew;
- a live batch numbered at or below the last live one means the worker's
  publisher counts from 0 again (the process restarted): the entries are
  dropped and its history replayed from 0; a lost connection drops them too
  (the next batch, from whichever process answers, asks for a replay);
- every reset opens a new epoch, so a `KeyReplica` never mixes two
  histories.

Illegal calls raise `StreamStateError`: a live batch during a replay, a
replay batch outside one.

Pure module: no I/O.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

from pdcluster.runtime.prefix_events import EventBatch, KeyEvent, Snapshot
from pdcluster.runtime.prefix_keys import root_key
from pdcluster.runtime.router.vllm_block_keys import DEFAULT_MAX_BLOCKS, BlockKeyMap
from pdcluster.runtime.vllm.kv_events import EventFrame

__all__ = [
    "VLLM_KEY_SALT",
    "Action",
    "ApplyKeys",
    "RequestReplay",
    "ResetIndex",
    "StreamPhase",
    "StreamStateError",
    "VllmEventStream",
]

# The salt of the page keys the router derives for vLLM workers (their root).
VLLM_KEY_SALT = b"pdcluster.vllm-blocks"


@dataclass(frozen=True, slots=True)
class ResetIndex:
    snapshot: Snapshot  # empty: `PrefixIndex.reset(url, snapshot)`


@dataclass(frozen=True, slots=True)
class ApplyKeys:
    batch: EventBatch  # `PrefixIndex.apply(url, batch)`


@dataclass(frozen=True, slots=True)
class RequestReplay:
    from_seq: int


Action = ResetIndex | ApplyKeys | RequestReplay


class StreamPhase(enum.Enum):
    live = "live"  # reading the PUB socket
    replaying = "replaying"  # reading a replay's answer, nothing live


class StreamStateError(RuntimeError):
    """A call the stream's phase does not allow (a bug in the I/O loop)."""


class VllmEventStream:
    def __init__(
        self,
        *,
        page_size: int,
        tokenizer: str = "",
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        salt: bytes = VLLM_KEY_SALT,
    ) -> None:
        self.page_size = page_size
        self.tokenizer = tokenizer
        self.max_blocks = max_blocks
        self.salt = salt
        self._root = root_key(salt)
        self.phase = StreamPhase.live
        self.blocks = BlockKeyMap(self._root, page_size, max_blocks)
        self._num_epochs = 0
        self._epoch = ""
        self._key_seq = 0  # our numbering of key events in this epoch
        self._next: int | None = None  # vLLM's next batch; None: take the next one given
        self._last_live = -1  # the last batch number read live
        self._replayed_since_reset = False
        self._replay_must_reach: int | None = None  # the live batch that revealed a gap
        # (kind, reason) → count: "batches" by outcome, "resyncs" by reason,
        # "unindexed" blocks by reason. The I/O loop exports and clears them.
        self.counts: Counter[tuple[str, str]] = Counter()

    @property
    def epoch(self) -> str:
        return self._epoch

    @property
    def next_seq(self) -> int | None:
        return self._next

    # ------------------------------------------------------------ inputs
    def start(self) -> list[Action]:
        """The first actions: an empty index entry, then the worker's whole history."""
        return [*self._reset(None), *self._replay_from(0, None)]

    def on_live(self, frame: EventFrame) -> list[Action]:
        self._require(StreamPhase.live, "a live batch")
        seq = frame.seq
        if seq <= self._last_live:
            self._last_live = seq
            return [*self._reset("publisher_restarted"), *self._replay_from(0, seq)]
        self._last_live = seq
        if self._next is None:
            if not self._replayed_since_reset:
                return self._replay_from(0, seq)
            return self._accept(frame)
        if seq < self._next:
            self.counts["batches", "duplicate"] += 1
            return []
        if seq == self._next:
            return self._accept(frame)
        self.counts["resyncs", "gap"] += 1
        return self._replay_from(self._next, seq)

    def on_replay(self, frame: EventFrame) -> list[Action]:
        self._require(StreamPhase.replaying, "a replayed batch")
        if self._next is None:
            return self._accept(frame)
        if frame.seq < self._next:
            self.counts["batches", "duplicate"] += 1
            return []
        if frame.seq == self._next:
            return self._accept(frame)
        # vLLM no longer keeps the batches between: start again from this one.
        reset = self._reset("replay_short")
        self._replayed_since_reset = True
        return [*reset, *self._accept(frame)]

    def on_replay_end(self) -> list[Action]:
        self._require(StreamPhase.replaying, "the end of a replay")
        self.phase = StreamPhase.live
        must_reach, self._replay_must_reach = self._replay_must_reach, None
        if must_reach is not None and (self._next is None or self._next <= must_reach):
            return self._reset_after_replay("replay_short")
        return []

    def on_replay_failed(self) -> list[Action]:
        """The replay socket did not answer in time."""
        self._require(StreamPhase.replaying, "a failed replay")
        self.phase = StreamPhase.live
        self._replay_must_reach = None
        return self._reset_after_replay("replay_failed")

    def on_bad_frame(self, reason: str) -> list[Action]:
        """A frame that did not decode (`KVEventFrameError.reason`), live or replayed."""
        self.counts["batches", f"bad_{reason}"] += 1
        reset = self._reset("bad_batch")
        # A replay would hand the same frame back: the next good batch starts anew.
        self._replayed_since_reset = True
        return reset

    def on_disconnect(self) -> list[Action]:
        """The PUB connection dropped (the process ended, or the network)."""
        self._require(StreamPhase.live, "a lost connection")
        self._last_live = -1  # whoever answers next may count from 0
        return self._reset("disconnected")

    # ------------------------------------------------------------ helpers
    def _require(self, phase: StreamPhase, what: str) -> None:
        if self.phase is not phase:
            raise StreamStateError(f"{what} while {self.phase.value}")

    def _reset(self, reason: str | None) -> list[Action]:
        if reason is not None:
            self.counts["resyncs", reason] += 1
        self._num_epochs += 1
        self._epoch = f"vllm-{self._num_epochs}"
        self._key_seq = 0
        self._next = None
        self._replayed_since_reset = False
        self.blocks = BlockKeyMap(self._root, self.page_size, self.max_blocks)
        empty = Snapshot(
            epoch=self._epoch,
            seq=0,
            keys=frozenset(),
            salt=self.salt,
            page_size=self.page_size,
            tokenizer=self.tokenizer,
        )
        return [ResetIndex(empty)]

    def _reset_after_replay(self, reason: str) -> list[Action]:
        reset = self._reset(reason)
        self._replayed_since_reset = True  # no second replay: the next live batch starts anew
        return reset

    def _replay_from(self, seq: int, must_reach: int | None) -> list[Action]:
        self.phase = StreamPhase.replaying
        self._replayed_since_reset = True
        self._replay_must_reach = must_reach
        return [RequestReplay(seq)]

    def _accept(self, frame: EventFrame) -> list[Action]:
        self._next = frame.seq + 1
        self.counts["batches", "applied"] += 1
        skipped_before = Counter(self.blocks.skipped)
        changes = self.blocks.apply(frame.events)
        for reason, n in (self.blocks.skipped - skipped_before).items():
            self.counts["unindexed", reason] += n
        if not changes:
            return []
        events = []
        for change in changes:
            self._key_seq += 1
            events.append(KeyEvent(self._key_seq, change.stored, change.keys))
        return [ApplyKeys(EventBatch(self._epoch, tuple(events), self._key_seq))]
