"""Instance-wide failure counts: rooms once per group, other counters summed, missing ranks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd.instance_counts import (
    CountsView,
    RankCountsBook,
    RoomFailureTally,
    build_group_view,
    failure_key,
    merge_views,
)


@pytest.mark.parametrize(
    ("reason", "key"),
    [
        ("prefill_unreachable", "room_failed:prefill_unreachable"),
        ("incomplete_transfer: received 3 of 8 KV bytes", "room_failed:incomplete_transfer"),
        ("", "room_failed:unknown"),
    ],
)
def test_failure_key_matches_the_rank_counters(reason: str, key: str) -> None:
    assert failure_key(reason) == key


def test_a_room_failed_on_every_rank_counts_once_under_its_first_reason() -> None:
    tally = RoomFailureTally(ttl_s=10.0)
    assert tally.record(5, "waiting_timeout", 0.0)
    assert not tally.record(5, "aborted", 0.1)  # the GroupFail echo of another rank
    assert tally.record(6, "aborted", 0.2)
    assert tally.counts() == {"room_failed:waiting_timeout": 1, "room_failed:aborted": 1}


def test_a_room_failing_again_after_the_ttl_counts_again() -> None:
    tally = RoomFailureTally(ttl_s=1.0)
    tally.record(5, "transfer_timeout", 0.0)
    assert tally.record(5, "transfer_timeout", 1.0)
    assert tally.counts() == {"room_failed:transfer_timeout": 2}


@given(rooms=st.lists(st.integers(0, 50), max_size=200), cap=st.integers(1, 20))
def test_tally_memory_is_bounded_and_counts_never_drop(rooms: list[int], cap: int) -> None:
    tally = RoomFailureTally(ttl_s=1e9, max_rooms=cap)
    total = 0
    for i, room in enumerate(rooms):
        before = sum(tally.counts().values())
        counted = tally.record(room, "r", float(i))
        total += counted
        assert sum(tally.counts().values()) == before + counted
        assert len(tally) <= cap
    # Distinct rooms are all counted; a repeat counts only once evicted.
    assert total >= len(set(rooms))


@pytest.mark.parametrize("bad", [{"ttl_s": 0.0}, {"ttl_s": 1.0, "max_rooms": 0}])
def test_tally_bad_settings(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RoomFailureTally(**bad)  # type: ignore[arg-type]


def test_book_reports_silent_and_never_heard_followers_missing() -> None:
    book = RankCountsBook([1, 2, 3], stale_s=3.0)
    book.update(1, "dp0/cp0/tp1/pp0", {"reject:bad_magic": 2}, 0.0)
    book.update(2, "dp0/cp0/tp2/pp0", {}, 5.0)
    assert book.missing(5.0) == ["dp0/cp0/tp1/pp0", "rank3"]
    # Its last counters still stand (counters only grow).
    assert book.by_rank()["dp0/cp0/tp1/pp0"] == {"reject:bad_magic": 2}


@pytest.mark.parametrize(
    ("rank", "counts"),
    [
        (0, {"a": 1}),  # the leader itself
        (9, {"a": 1}),  # not in the group
        (1, {"a": -1}),
        (1, {"a": True}),
        (1, {"": 1}),
        (1, ["a"]),
    ],
)
def test_book_refuses_bad_updates_and_keeps_what_it_had(rank: int, counts: object) -> None:
    book = RankCountsBook([1], stale_s=3.0)
    book.update(1, "r1", {"a": 4}, 0.0)
    with pytest.raises(ValueError):
        book.update(rank, "x", counts, 1.0)  # type: ignore[arg-type]
    assert book.by_rank() == {"r1": {"a": 4}}


def test_group_view_sums_rank_counters_but_counts_rooms_once() -> None:
    view = build_group_view(
        "tp0",
        {"room_failed:aborted": 1, "reject:bad_magic": 1},
        {"tp1": {"room_failed:aborted": 1, "reject:bad_magic": 2, "peer_dead": 1}},
        ["tp2"],
        {"room_failed:aborted": 1},
    )
    assert view.failures == {"room_failed:aborted": 1}
    assert view.stats == {"room_failed:aborted": 1, "reject:bad_magic": 3, "peer_dead": 1}
    assert view.ranks["tp1"]["room_failed:aborted"] == 1
    assert view.missing == ["tp2"]


def test_instance_view_adds_dp_groups_and_round_trips() -> None:
    g0 = CountsView({"room_failed:x": 1}, {"room_failed:x": 1}, {"dp0": {}}, [])
    g1 = CountsView({"room_failed:x": 2, "room_failed:y": 1}, {"s": 4}, {"dp1": {"s": 4}}, ["r"])
    merged = merge_views([g0, CountsView.from_json(g1.to_json())], ["dp2"])
    assert merged.failures == {"room_failed:x": 3, "room_failed:y": 1}
    assert merged.stats == {"room_failed:x": 1, "s": 4}
    assert set(merged.ranks) == {"dp0", "dp1"}
    assert merged.missing == ["r", "dp2"]


@pytest.mark.parametrize(
    "body",
    [
        None,
        {"failures": {}, "stats": {}, "ranks": {}},
        {"failures": {"a": "1"}, "stats": {}, "ranks": {}, "missing": []},
        {"failures": {}, "stats": {}, "ranks": {"r": {"a": -2}}, "missing": []},
    ],
)
def test_a_malformed_group_answer_is_refused(body: object) -> None:
    with pytest.raises(ValueError):
        CountsView.from_json(body)
