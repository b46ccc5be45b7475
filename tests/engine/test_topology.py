"""Rank arithmetic of an instance (pure)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.engine.topology import (
    ParallelConfig,
    TopologyError,
    layer_range,
    split_range,
)

sizes = st.integers(1, 4)


@settings(deadline=None)  # a loaded CI box must not turn slowness into failure
@given(dp=sizes, cp=sizes, tp=sizes, pp=sizes)
def test_ranks_and_coordinates_are_a_bijection(dp: int, cp: int, tp: int, pp: int) -> None:
    par = ParallelConfig(dp=dp, cp=cp, tp=tp, pp=pp)
    infos = [par.rank_info(r) for r in range(par.world_size)]
    assert [i.rank for i in infos] == list(range(par.world_size))
    assert len({(i.dp_rank, i.cp_rank, i.tp_rank, i.pp_rank) for i in infos}) == par.world_size
    # Each dp group is contiguous, has one leader and one token-returning rank.
    for d in range(dp):
        group = par.dp_group_ranks(d)
        assert group == list(range(d * par.group_size, (d + 1) * par.group_size))
        members = [infos[r] for r in group]
        assert [m.rank for m in members if m.is_leader] == [group[0]]
        assert len([m for m in members if m.returns_tokens]) == 1
        assert all(m.leader_rank == group[0] for m in members)
    # tp groups partition the world; members differ only in tp rank.
    flat = sorted(r for g in par.tp_groups() for r in g)
    assert flat == list(range(par.world_size))
    for g in par.tp_groups():
        coords = {(infos[r].dp_rank, infos[r].cp_rank, infos[r].pp_rank) for r in g}
        assert len(coords) == 1 and [infos[r].tp_rank for r in g] == list(range(tp))


def test_the_documented_rank_order() -> None:
    par = ParallelConfig(dp=2, cp=1, tp=2, pp=2)
    assert par.rank_of(1, 0, 1, 0) == ((1 * 1 + 0) * 2 + 1) * 2 + 0 == 6
    info = par.rank_info(6)
    assert info.stage_rank(1) == 7 and info.sampler_rank == 5 and info.leader_rank == 4


@settings(deadline=None)
@given(total=st.integers(0, 100), parts=st.integers(1, 9))
def test_split_range_tiles_the_whole_range(total: int, parts: int) -> None:
    ranges = [split_range(total, parts, i) for i in range(parts)]
    assert [t for r in ranges for t in r] == list(range(total))
    assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1


def test_cp_ranks_own_contiguous_token_ranges() -> None:
    par = ParallelConfig(cp=3)
    owned = [par.rank_info(r).cp_token_range(10) for r in range(3)]
    assert owned == [range(0, 4), range(4, 7), range(7, 10)]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ParallelConfig(tp=0), "tp must be an integer >= 1"),
        (lambda: ParallelConfig(pp=True), "pp must be an integer"),
        (lambda: ParallelConfig(tp=2).rank_info(2), "outside world size 2"),
        (lambda: ParallelConfig(tp=2).rank_of(0, 0, 2, 0), "tp rank 2 is outside"),
        (lambda: ParallelConfig(tp=3).rank_info(0).kv_head_range(4), "not divisible by tp"),
        (lambda: layer_range(4, 5, 0), "pp \\(5\\) exceeds"),
    ],
)
def test_bad_topologies_are_named(call: Callable[[], object], message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        call()
