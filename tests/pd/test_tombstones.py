"""Tombstones: remembered for their ttl, bounded in number, first reason kept."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd.tombstones import Tombstones


def test_remembered_until_ttl_then_forgotten() -> None:
    t = Tombstones(ttl=10.0)
    t.add(5, now=0.0, reason="bootstrap_timeout")
    assert t.get(5, 9.99) == "bootstrap_timeout"
    assert t.get(5, 10.0) is None
    assert t.prune(10.0) == 1 and len(t) == 0


def test_first_reason_is_kept() -> None:
    t = Tombstones(ttl=10.0)
    t.add(5, 0.0, "aborted")
    t.add(5, 1.0, "succeeded")
    assert t.get(5, 2.0) == "aborted"


def test_bounded_forgets_oldest_first() -> None:
    t = Tombstones(ttl=100.0, max_entries=3)
    for room in range(5):
        t.add(room, float(room), f"r{room}")
    assert len(t) == 3
    assert [t.get(r, 10.0) for r in range(5)] == [None, None, "r2", "r3", "r4"]


@pytest.mark.parametrize(("ttl", "cap"), [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_bad_settings_raise(ttl: float, cap: int) -> None:
    with pytest.raises(ValueError):
        Tombstones(ttl, cap)


@given(st.lists(st.tuples(st.integers(0, 20), st.floats(0, 5)), max_size=60))
def test_matches_a_reference_model(events: list[tuple[int, float]]) -> None:
    ttl = 7.0
    t = Tombstones(ttl, max_entries=10)
    now = 0.0
    model: dict[int, float] = {}
    for room, dt in events:
        now += dt
        model = {r: exp for r, exp in model.items() if exp > now}
        if room not in model:
            model[room] = now + ttl
            while len(model) > 10:
                del model[min(model, key=model.__getitem__)]
        t.add(room, now, "x")
        for r in range(21):
            assert (t.get(r, now) is not None) == (r in model)
