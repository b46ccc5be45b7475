"""Following one vLLM worker's event stream (runtime/router/vllm_event_stream.py):
order, duplicates, gaps and replays, restarts, lost frames and connections;
every action lands in the router's real PrefixIndex."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.prefix_events import Apply
from pdcluster.runtime.prefix_keys import chain_page_keys, root_key
from pdcluster.runtime.router.prefix_index import PrefixIndex
from pdcluster.runtime.router.vllm_event_stream import (
    VLLM_KEY_SALT,
    Action,
    ApplyKeys,
    RequestReplay,
    ResetIndex,
    StreamPhase,
    StreamStateError,
    VllmEventStream,
)
from pdcluster.runtime.vllm.kv_events import BlockStored, EventFrame

PAGE = 4
URL = "http://127.0.0.1:9"
ROOT = root_key(VLLM_KEY_SALT)


def frame(seq: int) -> EventFrame:
    """Batch `seq` stores one block of its own: hash seq, tokens [seq] * PAGE."""
    event = BlockStored(
        block_hashes=(seq,),
        parent=None,
        token_ids=(seq,) * PAGE,
        block_size=PAGE,
        has_extra_keys=(False,),
        lora=None,
        medium="GPU",
        group=0,
    )
    return EventFrame(seq, (event,))


def key(seq: int) -> bytes:
    return chain_page_keys([seq] * PAGE, PAGE, ROOT)[0]


class Follower:
    """The stream with the router's index, as the I/O loop drives them."""

    def __init__(self) -> None:
        self.stream = VllmEventStream(page_size=PAGE, tokenizer="tok")
        self.index = PrefixIndex()
        self.replays: list[int] = []

    def act(self, actions: Sequence[Action]) -> list[Action]:
        for action in actions:
            if isinstance(action, ResetIndex):
                self.index.reset(URL, action.snapshot)
            elif isinstance(action, ApplyKeys):
                assert self.index.apply(URL, action.batch) is Apply.applied
            else:
                self.replays.append(action.from_seq)
        replica = self.index.replica(URL)
        assert replica is not None and replica.keys == self.stream.blocks.keys
        return list(actions)

    def start(self) -> list[Action]:
        return self.act(self.stream.start())

    def live(self, seq: int) -> list[Action]:
        return self.act(self.stream.on_live(frame(seq)))

    def replay(self, *seqs: int, end: bool = True) -> None:
        for seq in seqs:
            self.act(self.stream.on_replay(frame(seq)))
        if end:
            self.act(self.stream.on_replay_end())

    @property
    def keys(self) -> set[bytes]:
        return set(self.stream.blocks.keys)

    def resyncs(self) -> dict[str, int]:
        return {r: n for (kind, r), n in self.stream.counts.items() if kind == "resyncs"}


def started(*history: int) -> Follower:
    f = Follower()
    f.start()
    f.replay(*history)
    return f


def test_a_new_stream_learns_the_history_the_worker_still_keeps() -> None:
    f = Follower()
    actions = f.start()
    assert isinstance(actions[0], ResetIndex) and actions[1] == RequestReplay(0)
    assert f.stream.phase is StreamPhase.replaying
    f.replay(0, 1, 2)
    assert f.stream.phase is StreamPhase.live and f.stream.next_seq == 3
    assert f.keys == {key(0), key(1), key(2)}
    f.live(3)
    assert f.keys == {key(s) for s in range(4)}


def test_a_new_stream_of_a_worker_that_dropped_old_batches_starts_from_the_oldest() -> None:
    f = started(5, 6)  # vLLM's buffer lost 0..4
    assert f.keys == {key(5), key(6)} and f.stream.next_seq == 7
    assert f.resyncs() == {}


def test_live_batches_already_replayed_are_duplicates() -> None:
    f = started(0, 1, 2)
    assert f.live(1) == [] and f.live(2) == []
    assert f.stream.counts["batches", "duplicate"] == 2
    f.live(3)
    assert f.stream.next_seq == 4


def test_a_gap_asks_a_replay_from_the_batch_expected() -> None:
    f = started(0)
    assert f.live(3) == [RequestReplay(1)]
    assert f.stream.phase is StreamPhase.replaying
    with pytest.raises(StreamStateError):
        f.stream.on_live(frame(4))  # nothing live while replaying
    f.replay(1, 2, 3)
    assert f.keys == {key(s) for s in range(4)}
    assert f.resyncs() == {"gap": 1}
    f.live(4)
    assert f.stream.next_seq == 5


def test_a_replay_that_no_longer_reaches_back_starts_again_from_what_it_has() -> None:
    f = started(0)
    f.live(5)
    epoch = f.stream.epoch
    f.replay(3, 4, 5)  # 1 and 2 are gone from vLLM's buffer
    assert f.stream.epoch != epoch
    assert f.keys == {key(3), key(4), key(5)}, "block 0 may be gone: it is not claimed"
    assert f.resyncs() == {"gap": 1, "replay_short": 1}


def test_a_replay_that_ends_before_the_batch_that_revealed_the_gap_resets() -> None:
    f = started(0)
    f.live(4)
    f.replay(1, 2)  # ends short of 4
    assert f.keys == set() and f.resyncs() == {"gap": 1, "replay_short": 1}
    # No second replay: the next live batch starts the set anew.
    f.live(9)
    assert f.keys == {key(9)} and f.replays == [0, 1]


def test_a_replay_without_an_answer_resets_and_live_batches_go_on() -> None:
    f = started(0)
    f.live(2)
    f.act(f.stream.on_replay_failed())
    assert f.keys == set() and f.resyncs() == {"gap": 1, "replay_failed": 1}
    f.live(3)
    assert f.keys == {key(3)}


def test_a_publisher_that_counts_from_zero_again_restarted() -> None:
    f = started(0, 1, 2)
    f.live(3)
    actions = f.live(0)
    assert isinstance(actions[0], ResetIndex) and actions[1] == RequestReplay(0)
    assert f.keys == set() and f.resyncs() == {"publisher_restarted": 1}
    f.replay(0)
    assert f.keys == {key(0)}


def test_a_bad_frame_drops_the_entries_without_asking_for_it_again() -> None:
    f = started(0, 1)
    assert isinstance(f.act(f.stream.on_bad_frame("malformed"))[0], ResetIndex)
    assert f.keys == set() and f.stream.counts["batches", "bad_malformed"] == 1
    f.live(3)  # 2 was the bad one: not replayed
    assert f.keys == {key(3)} and f.replays == [0]


def test_a_bad_replayed_frame_resets_and_the_replay_goes_on() -> None:
    f = started(0)
    f.live(3)
    f.act(f.stream.on_replay(frame(1)))
    f.act(f.stream.on_bad_frame("malformed"))
    f.replay(2, 3)
    assert f.keys == {key(2), key(3)}


def test_a_lost_connection_drops_the_entries_and_the_next_batch_replays() -> None:
    f = started(0, 1)
    f.act(f.stream.on_disconnect())
    assert f.keys == set() and f.resyncs() == {"disconnected": 1}
    assert f.live(0) == [RequestReplay(0)]  # whoever answers may count from 0
    f.replay(0)
    assert f.keys == {key(0)}


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.on_replay(frame(0)),
        lambda s: s.on_replay_end(),
        lambda s: s.on_replay_failed(),
    ],
)
def test_replay_calls_outside_a_replay_are_refused(call: object) -> None:
    f = started(0)
    with pytest.raises(StreamStateError):
        call(f.stream)  # type: ignore[operator]


def test_every_reset_opens_an_epoch_of_its_own() -> None:
    f = Follower()
    epochs = set()
    f.start()
    epochs.add(f.stream.epoch)
    for _ in range(3):
        f.replay(0)
        f.act(f.stream.on_disconnect())
        epochs.add(f.stream.epoch)
        f.live(0)
    assert len(epochs) == 4


# ---- any order of frames ---------------------------------------------------

_step = st.one_of(
    st.tuples(st.just("live"), st.integers(0, 12)),
    st.tuples(st.just("bad"), st.just(0)),
    st.tuples(st.just("disconnect"), st.just(0)),
)


@settings(max_examples=300)
@given(st.lists(_step, max_size=30), st.data())
def test_any_order_of_frames_keeps_the_index_equal_to_a_subset_of_the_workers_batches(
    steps: list[tuple[str, int]], data: st.DataObject
) -> None:
    """Each batch stores its own block and none are removed, so the worker holds
    key(s) for every batch s it published; the index must claim no other key."""
    f = Follower()
    published = -1
    f.start()

    def answer_replays() -> None:
        while f.stream.phase is StreamPhase.replaying:
            start = f.replays[-1]
            outcome = data.draw(st.sampled_from(["full", "from_later", "short", "fail"]))
            if outcome == "fail":
                f.act(f.stream.on_replay_failed())
                continue
            first = start if outcome != "from_later" else start + data.draw(st.integers(1, 3))
            last = published if outcome != "short" else published - 1
            f.replay(*range(first, last + 1))

    answer_replays()
    for kind, value in steps:
        if kind == "live":
            seq = value if value <= published else published + 1 + data.draw(st.integers(0, 2))
            published = max(published, seq)
            f.live(seq)
        elif kind == "bad":
            f.act(f.stream.on_bad_frame("malformed"))
        else:
            f.act(f.stream.on_disconnect())
        answer_replays()
        assert f.keys <= {key(s) for s in range(published + 1)}
