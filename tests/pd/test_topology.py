"""Topology mapping: every (layer, head, token) of a decode rank arrives exactly once."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.topology import (
    DpRankConflict,
    ModelShape,
    PDTopology,
    TopologyError,
    cp_token_range,
    layer_range,
    prefill_dp_group,
    shape_of,
    split_span,
)
from pdcluster.runtime.spec import Topology, pages_for


def check_mapping(topo: PDTopology, num_tokens: int, page_size: int) -> None:
    model = topo.model
    for prefill_dp in range(topo.prefill.dp):
        for d in topo.decode.group(0):
            sources = topo.sources(d, prefill_dp)
            # Exactly-once coverage of the decode rank's whole KV share.
            d_layers, d_heads = sources[0].decode_layers, sources[0].decode_heads
            seen = np.zeros((model.num_layers, model.num_kv_heads, num_tokens), dtype=np.int32)
            for s in sources:
                assert s.decode_rank == d and s.prefill_rank.dp == prefill_dp
                if s.is_dummy:
                    assert s.token_range(num_tokens, page_size) == (0, 0)
                    continue
                t0, t1 = s.token_range(num_tokens, page_size)
                assert 0 <= t0 <= t1 <= num_tokens
                seen[s.layers[0] : s.layers[1], s.heads[0] : s.heads[1], t0:t1] += 1
                # Local offsets address each side's own pool.
                for lo, hi in (s.prefill_local.layers, s.decode_local.layers):
                    assert 0 <= lo < hi <= model.num_layers
                assert 0 <= s.decode_local.heads[0] < s.decode_local.heads[1]
                assert s.decode_local.heads[1] <= d_heads[1] - d_heads[0]
                assert s.prefill_local.heads[1] <= s.prefill_heads[1] - s.prefill_heads[0]
            share = seen[d_layers[0] : d_layers[1], d_heads[0] : d_heads[1], :]
            assert (share == 1).all(), f"{d}: a cell arrived {share.min()}..{share.max()} times"
            assert seen.sum() == share.size, f"{d}: received KV it does not hold"
            ranks = {s.prefill_rank for s in sources}
            assert topo.required_responses(d) == len(ranks) == len(sources)
        # Every prefill rank of the group feeds someone, and both views agree.
        for p in topo.prefill.group(prefill_dp):
            dests = topo.destinations(p, 0)
            assert dests, f"prefill rank {p} has no destination: its room would never conclude"
            assert topo.num_destinations(p) == len(dests)
            for s in dests:
                assert s in topo.sources(s.decode_rank, prefill_dp)


SHAPES = list(
    itertools.product(
        [1, 2],  # prefill dp
        [1, 2, 3],  # prefill cp
        [1, 2, 4],  # prefill tp
        [1, 2],  # prefill pp
        [1, 2, 4],  # decode tp
        [False, True],  # decode pp equals prefill pp (else 1)
        [False, True],  # replicated kv
    )
)


def test_every_supported_combination_covers_exactly_once() -> None:
    checked = 0
    for pdp, pcp, ptp, ppp, dtp, same_pp, replicated in SHAPES:
        prefill = InstanceShape(dp=pdp, cp=pcp, tp=ptp, pp=ppp)
        decode = InstanceShape(tp=dtp, pp=ppp if same_pp else 1)
        for layers, heads in ((4, 4), (5, 8)):
            topo = PDTopology(prefill, decode, ModelShape(layers, heads, replicated))
            for num_tokens, page_size in ((1, 4), (13, 4), (16, 16)):
                check_mapping(topo, num_tokens, page_size)
                checked += 1
    assert checked == len(SHAPES) * 6


@settings(max_examples=150, deadline=None)
@given(
    pcp=st.integers(1, 4),
    ptp=st.sampled_from([1, 2, 3, 6]),
    ppp=st.integers(1, 3),
    dtp=st.sampled_from([1, 2, 3, 6]),
    same_pp=st.booleans(),
    layers=st.integers(3, 9),
    heads_per=st.integers(1, 2),
    replicated=st.booleans(),
    num_tokens=st.integers(1, 70),
    page_size=st.sampled_from([1, 2, 4, 16]),
)
def test_coverage_property(
    pcp: int,
    ptp: int,
    ppp: int,
    dtp: int,
    same_pp: bool,
    layers: int,
    heads_per: int,
    replicated: bool,
    num_tokens: int,
    page_size: int,
) -> None:
    heads = 6 * heads_per  # divisible by every tp drawn
    topo = PDTopology(
        InstanceShape(cp=pcp, tp=ptp, pp=ppp),
        InstanceShape(tp=dtp, pp=ppp if same_pp else 1),
        ModelShape(layers, heads, replicated),
    )
    check_mapping(topo, num_tokens, page_size)


@given(st.integers(0, 500), st.integers(1, 64), st.integers(1, 8))
def test_cp_ranges_are_contiguous_page_aligned_and_complete(n: int, page: int, cp: int) -> None:
    ranges = [cp_token_range(n, page, cp, r) for r in range(cp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (a0, a1), (b0, _) in zip(ranges, ranges[1:], strict=False):
        assert a0 <= a1 == b0
    for start, _ in ranges:
        assert start % page == 0 or start == n
    # Sizes differ by at most one page.
    sizes = [pages_for(b, page) - a // page for a, b in ranges if b > a]
    assert not sizes or max(sizes) - min(sizes) <= 1


@given(st.integers(0, 100), st.integers(1, 10))
def test_split_span_partitions(total: int, parts: int) -> None:
    spans = [split_span(total, parts, i) for i in range(parts)]
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    lengths = [b - a for a, b in spans]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


def test_layer_ranges_match_the_documented_rule() -> None:
    assert [layer_range(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [layer_range(4, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize(
    ("prefill", "decode", "model", "message"),
    [
        (
            InstanceShape(tp=3),
            InstanceShape(),
            ModelShape(4, 4),
            "num_kv_heads=4 is not divisible by prefill tp=3",
        ),
        (
            InstanceShape(),
            InstanceShape(tp=8),
            ModelShape(4, 4),
            "num_kv_heads=4 is not divisible by decode tp=8",
        ),
        (InstanceShape(), InstanceShape(cp=2), ModelShape(4, 4), "decode cp must be 1 (got 2)"),
        (
            InstanceShape(pp=2),
            InstanceShape(pp=4),
            ModelShape(8, 4),
            "decode pp must be 1 or equal prefill pp (2), got 4",
        ),
        (
            InstanceShape(pp=1),
            InstanceShape(pp=2),
            ModelShape(8, 4),
            "decode pp must be 1 or equal prefill pp (1), got 2",
        ),
        (
            InstanceShape(pp=4),
            InstanceShape(),
            ModelShape(3, 4),
            "prefill pp=4 exceeds num_layers=3",
        ),
    ],
)
def test_unsupported_combinations_are_rejected_naming_values(
    prefill: InstanceShape, decode: InstanceShape, model: ModelShape, message: str
) -> None:
    with pytest.raises(TopologyError) as err:
        PDTopology(prefill, decode, model)
    assert message in str(err.value)


def test_replicated_kv_allows_tp_that_does_not_divide_heads() -> None:
    topo = PDTopology(
        InstanceShape(tp=4), InstanceShape(tp=2), ModelShape(2, 1, replicated_kv=True)
    )
    d1 = RankCoord(tp=1)
    kinds = {(s.prefill_rank.tp, s.is_dummy) for s in topo.sources(d1, 0)}
    # Real data from prefill tp 1; prefill tp 3 (read by nobody) reports to decode tp 1 as a dummy.
    assert kinds == {(1, False), (3, True)}
    assert topo.required_responses(d1) == 2


def test_room_picks_the_prefill_dp_group_by_modulo() -> None:
    topo = PDTopology(InstanceShape(dp=3), InstanceShape(), ModelShape(2, 2))
    assert [topo.prefill_dp_for_room(r) for r in (0, 1, 2, 3, 2**63 - 1)] == [0, 1, 2, 0, 1]
    with pytest.raises(TopologyError):
        topo.prefill_dp_for_room(-1)


@given(st.integers(0, (1 << 63) - 1), st.integers(1, 8), st.integers(0, 8))
def test_an_explicit_dp_rank_must_say_room_mod_dp(room: int, dp: int, explicit: int) -> None:
    group = room % dp
    assert prefill_dp_group(room, dp) == group
    if explicit == group:
        assert prefill_dp_group(room, dp, explicit) == group
    else:
        with pytest.raises(DpRankConflict) as err:
            prefill_dp_group(room, dp, explicit)
        assert str(err.value) == (
            f"dp_rank_conflict: data_parallel_rank {explicit} != room % {dp} = {group}"
        )


def test_both_legs_apply_one_dp_rule() -> None:
    # Decode resolves a room's prefill group through PDTopology, the worker's
    # entry through prefill_dp_group: the same answer and the same refusal.
    topo = PDTopology(InstanceShape(dp=2), InstanceShape(), ModelShape(2, 2))
    assert topo.prefill_dp_for_room(5, 1) == prefill_dp_group(5, 2, 1) == 1
    for check in (lambda: topo.prefill_dp_for_room(4, 1), lambda: prefill_dp_group(4, 2, 1)):
        with pytest.raises(DpRankConflict, match=r"data_parallel_rank 1 != room % 2 = 0"):
            check()


def test_ranks_outside_the_instances_are_rejected() -> None:
    topo = PDTopology(InstanceShape(tp=2), InstanceShape(tp=2), ModelShape(2, 2))
    with pytest.raises(TopologyError, match="decode rank dp0/cp0/tp2/pp0 is outside"):
        topo.sources(RankCoord(tp=2), 0)
    with pytest.raises(TopologyError, match="prefill dp group 1 outside dp=1"):
        topo.sources(RankCoord(), 1)
    with pytest.raises(TopologyError, match="prefill rank"):
        topo.destinations(RankCoord(pp=1), 0)


def test_manifest_topology_converts() -> None:
    assert shape_of(Topology(dp=2, tp=4, cp=1, pp=2)) == InstanceShape(dp=2, cp=1, tp=4, pp=2)
