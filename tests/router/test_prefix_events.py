"""Page-key events: the worker's numbered, bounded log and the router's replica
built from a snapshot plus the events after it. A replica ends equal to the
worker's key set whatever the timing: a late join, retried or overlapping
fetches, truncated batches, a worker restart, events dropped from the buffer.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.prefix_events import (
    Apply,
    EventBatch,
    KeyEvent,
    KeyEventLog,
    KeyReplica,
    SnapshotNeeded,
    WireError,
    parse_batch,
    parse_snapshot,
)
from pdcluster.runtime.prefix_keys import PageKey, root_key


def key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def new_log(max_keys: int = 1000, epoch: str = "e1") -> KeyEventLog:
    return KeyEventLog(epoch, salt=b"salt", page_size=4, tokenizer="tok", max_keys=max_keys)


# ---- the worker's log ------------------------------------------------------


def test_events_are_numbered_from_one_and_the_snapshot_holds_the_key_set() -> None:
    log = new_log()
    assert log.record(True, [key(1), key(2)]) == KeyEvent(1, True, (key(1), key(2)))
    assert log.record(False, [key(1)]) == KeyEvent(2, False, (key(1),))
    snap = log.snapshot()
    assert (snap.epoch, snap.seq, snap.keys) == ("e1", 2, frozenset({key(2)}))
    assert (snap.salt, snap.page_size, snap.tokenizer) == (b"salt", 4, "tok")
    assert snap.root == root_key(b"salt")


def test_an_empty_change_is_not_an_event() -> None:
    log = new_log()
    assert log.record(True, []) is None
    assert log.last_seq == 0


@pytest.mark.parametrize(
    ("stored", "keys", "message"),
    [
        (True, [key(1)], "already cached"),
        (False, [key(9)], "not cached"),
        (True, [key(5), key(5)], "listed twice"),
        (True, [b"short"], "16 bytes"),
        (False, [key(1), key(9)], "not cached"),
    ],
)
def test_a_change_the_cache_never_reports_is_refused_and_changes_nothing(
    stored: bool, keys: list[PageKey], message: str
) -> None:
    log = new_log()
    log.record(True, [key(1)])
    before = log.snapshot()
    with pytest.raises(ValueError, match=message):
        log.record(stored, keys)
    assert log.snapshot() == before
    assert log.num_buffered_keys == 1


def test_the_buffer_keeps_at_most_max_keys_dropping_the_oldest_events() -> None:
    log = new_log(max_keys=5)
    for i in range(4):
        log.record(True, [key(2 * i), key(2 * i + 1)])
    assert log.num_buffered_keys <= 5
    assert log.oldest_seq == 3
    with pytest.raises(SnapshotNeeded, match="dropped"):
        log.events_after("e1", 1)
    assert [e.seq for e in log.events_after("e1", 2).events] == [3, 4]
    # The key set itself is whole: the snapshot does not depend on the buffer.
    assert log.snapshot().keys == frozenset(key(i) for i in range(8))


def test_the_newest_event_is_kept_even_when_alone_over_the_bound() -> None:
    log = new_log(max_keys=2)
    log.record(True, [key(i) for i in range(5)])
    assert [e.seq for e in log.events_after("e1", 0).events] == [1]


@pytest.mark.parametrize(
    ("epoch", "after", "message"),
    [("other", 0, "epoch"), ("e1", 3, "outside"), ("e1", -1, "outside"), ("e1", True, "outside")],
)
def test_events_after_asks_for_a_snapshot_it_cannot_continue(
    epoch: str, after: int, message: str
) -> None:
    log = new_log()
    log.record(True, [key(1)])
    with pytest.raises(SnapshotNeeded, match=message):
        log.events_after(epoch, after)


def test_events_after_caps_the_batch_and_says_how_far_the_log_goes() -> None:
    log = new_log()
    for i in range(5):
        log.record(True, [key(i)])
    batch = log.events_after("e1", 1, limit=2)
    assert [e.seq for e in batch.events] == [2, 3]
    assert batch.last_seq == 5
    assert log.events_after("e1", 5).events == ()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"epoch": ""},
        {"epoch": "x" * 65},
        {"page_size": 0},
        {"max_keys": 0},
        {"salt": "not-bytes"},
    ],
)
def test_bad_log_settings_are_refused(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"epoch": "e", "salt": b"s", "page_size": 4, **kwargs}
    epoch = args.pop("epoch")
    with pytest.raises(ValueError):
        KeyEventLog(epoch, **args)  # type: ignore[arg-type]


# ---- the router's replica --------------------------------------------------


def test_a_replica_skips_events_it_has_and_refuses_a_gap_unchanged() -> None:
    log = new_log()
    log.record(True, [key(1)])
    replica = KeyReplica(log.snapshot())
    log.record(True, [key(2)])
    log.record(False, [key(1)])
    log.record(True, [key(3)])
    full = log.events_after("e1", 0)
    assert replica.apply(full) is Apply.applied  # event 1 is skipped, 2..4 applied
    assert replica.keys == {key(2), key(3)} and replica.seq == 4
    assert replica.apply(full) is Apply.applied  # a retried fetch applies nothing twice
    assert replica.keys == {key(2), key(3)}
    log.record(True, [key(4)])
    log.record(True, [key(5)])
    missing_one = EventBatch("e1", (log.events_after("e1", 5).events), log.last_seq)
    assert replica.apply(missing_one) is Apply.gap
    assert replica.keys == {key(2), key(3)} and replica.seq == 4


def test_a_replica_refuses_another_epoch_and_a_log_behind_it() -> None:
    log = new_log()
    log.record(True, [key(1)])
    replica = KeyReplica(log.snapshot())
    assert replica.apply(EventBatch("e2", (), 0)) is Apply.other_epoch
    assert replica.apply(EventBatch("e1", (), 0)) is Apply.gap
    assert replica.apply(EventBatch("e1", (), 3)) is Apply.gap  # events it does not carry
    assert replica.keys == {key(1)}


def test_a_truncated_batch_leaves_the_replica_behind_until_the_next_fetch() -> None:
    log = new_log()
    replica = KeyReplica(log.snapshot())
    for i in range(5):
        log.record(True, [key(i)])
    assert replica.apply(log.events_after("e1", replica.seq, limit=2)) is Apply.applied
    assert replica.is_behind and replica.seq == 2
    assert replica.apply(log.events_after("e1", replica.seq, limit=10)) is Apply.applied
    assert not replica.is_behind and replica.keys == {key(i) for i in range(5)}


def test_num_cached_pages_counts_the_leading_run_only() -> None:
    log = new_log()
    log.record(True, [key(1), key(2), key(4)])
    replica = KeyReplica(log.snapshot())
    assert replica.num_cached_pages([key(1), key(2), key(3), key(4)]) == 2
    assert replica.num_cached_pages([key(3), key(1)]) == 0
    assert replica.num_cached_pages([]) == 0


# ---- wire ------------------------------------------------------------------


def test_snapshot_and_batch_survive_the_wire() -> None:
    log = new_log()
    log.record(True, [key(1), key(2)])
    log.record(False, [key(2)])
    assert parse_snapshot(log.snapshot().to_wire()) == log.snapshot()
    batch = log.events_after("e1", 0)
    assert parse_batch(batch.to_wire()) == batch


@pytest.mark.parametrize(
    "change",
    [
        {"epoch": ""},
        {"epoch": 5},
        {"seq": -1},
        {"seq": "1"},
        {"salt": "zz"},
        {"salt": 3},
        {"page_size": 0},
        {"keys": ["ab"]},
        {"keys": "00"},
        {"keys": [None]},
        {"tokenizer": 7},
    ],
)
def test_a_malformed_snapshot_is_refused_with_a_reason(change: dict[str, object]) -> None:
    wire = {**new_log().snapshot().to_wire(), **change}
    with pytest.raises(WireError):
        parse_snapshot(wire)


@pytest.mark.parametrize(
    "wire",
    [
        [],
        {"epoch": "e1", "last_seq": 0},
        {"epoch": "e1", "last_seq": 0, "events": [{"seq": 1, "stored": 1, "keys": []}]},
        {"epoch": "e1", "last_seq": 0, "events": ["x"]},
        {"epoch": "e1", "last_seq": -2, "events": []},
        {"epoch": "e1", "last_seq": 1, "events": [{"seq": 1, "stored": True, "keys": ["g" * 32]}]},
    ],
)
def test_a_malformed_batch_is_refused_with_a_reason(wire: object) -> None:
    with pytest.raises(WireError):
        parse_batch(wire)


# ---- convergence, whatever the timing --------------------------------------

# A worker's changes: store a set of absent keys or evict present ones
# (chosen by index into the current key set / a fresh range).
_changes = st.lists(
    st.tuples(st.booleans(), st.lists(st.integers(0, 40), min_size=1, max_size=5)),
    max_size=60,
)
# What the router does at each step: nothing, fetch (after its seq, or a
# stale seq as a retried request would), with a batch limit.
_fetches = st.lists(
    st.tuples(st.sampled_from(["none", "fetch", "stale"]), st.integers(1, 4)),
    max_size=60,
)


def _apply_change(log: KeyEventLog, stored: bool, picks: list[int]) -> None:
    present = sorted(log.snapshot().keys)
    if stored:
        keys = sorted({key(p) for p in picks} - set(present))
    else:
        keys = sorted({present[p % len(present)] for p in picks}) if present else []
    log.record(stored, keys)


@settings(max_examples=300)
@given(
    changes=_changes,
    fetches=_fetches,
    join_at=st.integers(0, 60),
    max_keys=st.integers(1, 30),
)
def test_a_replica_converges_to_the_worker_key_set(
    changes: list[tuple[bool, list[int]]],
    fetches: list[tuple[str, int]],
    join_at: int,
    max_keys: int,
) -> None:
    log = new_log(max_keys=max_keys)
    replica: KeyReplica | None = None
    num_snapshots = 0
    prev_seq = 0

    def follow(mode: str, limit: int) -> None:
        nonlocal replica, num_snapshots, prev_seq
        if replica is None:
            replica = KeyReplica(log.snapshot())
            num_snapshots += 1
            return
        after = prev_seq if mode == "stale" else replica.seq
        prev_seq = replica.seq
        try:
            batch = log.events_after(replica.epoch, after, limit)
        except SnapshotNeeded:
            replica = None  # the router takes a new snapshot next time
            return
        if replica.apply(batch) is not Apply.applied:
            replica = None

    for step in range(max(len(changes), len(fetches))):
        if step < len(changes):
            _apply_change(log, *changes[step])
        if step >= join_at and step < len(fetches) and fetches[step][0] != "none":
            follow(*fetches[step])
        if replica is not None:
            # Never ahead of the worker, never holding a key the worker had
            # not stored by the replica's seq.
            assert replica.seq <= log.last_seq
    # Catch up: keep following until current (at most one snapshot more).
    for _ in range(200):
        follow("fetch", 4)
        if replica is not None and replica.seq == log.last_seq:
            break
    assert replica is not None
    assert replica.keys == set(log.snapshot().keys)


@given(changes=_changes, num_routers=st.integers(2, 4), joins=st.lists(st.integers(0, 60)))
def test_several_routers_each_converge_on_their_own(
    changes: list[tuple[bool, list[int]]], num_routers: int, joins: list[int]
) -> None:
    log = new_log()
    replicas: list[KeyReplica | None] = [None] * num_routers
    join_steps = (joins + [0] * num_routers)[:num_routers]
    for step, change in enumerate(changes):
        _apply_change(log, *change)
        for r in range(num_routers):
            if step < join_steps[r]:
                continue
            rep = replicas[r]
            if rep is None:
                replicas[r] = KeyReplica(log.snapshot())
            else:
                assert rep.apply(log.events_after(rep.epoch, rep.seq)) is Apply.applied
    for rep in replicas:
        if rep is None:
            rep = KeyReplica(log.snapshot())
        rep.apply(log.events_after(rep.epoch, rep.seq))
        assert rep.keys == set(log.snapshot().keys)


def test_a_restarted_worker_is_followed_from_its_new_snapshot() -> None:
    old = new_log(epoch="old")
    old.record(True, [key(1), key(2)])
    replica = KeyReplica(old.snapshot())
    new = new_log(epoch="new")  # counts from 0 again: same seqs, other history
    new.record(True, [key(7)])
    with pytest.raises(SnapshotNeeded):
        new.events_after(replica.epoch, replica.seq)
    assert replica.apply(new.events_after("new", 0)) is Apply.other_epoch
    replica = KeyReplica(new.snapshot())
    assert replica.keys == {key(7)}
