"""The nixl descriptor planner: the bytes its descriptors move are exactly the frame's KV."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.engine.kv_order import KVOrder
from pdcluster.runtime.spec import KVLayout
from pdcluster.runtime.transfer.nixl_plan import (
    PlanError,
    RegionGeometry,
    can_use_page_units,
    check_geometries,
    frame_page_units,
    merge_descriptors,
    page_unit_grid,
    page_units,
    plan_descriptors,
    split_runs,
    unit_bytes,
    whole_pages,
)


def geo(layers=2, pages=8, ps=4, heads=4, dim=2, dtype="float32", layout=KVLayout.NHD):
    return RegionGeometry(layers, pages, ps, heads, dim, dtype, layout)


# Our layouts and vLLM's: CPU pages (K block, V block per head) and K|V side by side per token.
ORDERS = [KVLayout.NHD, KVLayout.HND, KVOrder("LPHKN"), KVOrder("LPHNK")]


def shaped(g: RegionGeometry, flat: np.ndarray) -> np.ndarray:
    """[L, 2, P, ps, H, D] view of a pool's bytes, whatever its order."""
    item = flat.view({4: np.int32, 2: np.int16, 8: np.int64}[g.item_size])
    order = g.order
    dims = order.sizes_in_order(g.num_layers, g.num_pages, g.page_size, g.num_kv_heads)
    return item.reshape(*dims, g.head_dim).transpose(order.logical_permutation())


def runs_of(src_slots, dst_slots, src_ps, dst_ps):
    """Token runs consecutive on both sides, inside one page each (as shm.copy_runs cuts)."""
    runs: list[list[int]] = []
    for s, d in zip(src_slots, dst_slots, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            if s % src_ps and d % dst_ps:
                runs[-1][2] += 1
                continue
        runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def execute(table: np.ndarray, src_bytes: np.ndarray, dst_bytes: np.ndarray) -> None:
    for s, d, n in table:
        assert 0 <= s and s + n <= len(src_bytes) and 0 <= d and d + n <= len(dst_bytes)
        dst_bytes[d : d + n] = src_bytes[s : s + n]


def check_moves_exactly(src, dst, src_slots, dst_slots, layer_pairs, src_heads, dst_heads):
    rng = np.random.default_rng(0)
    src_bytes = rng.integers(1, 255, src.nbytes, dtype=np.uint8)
    dst_bytes = np.zeros(dst.nbytes, dtype=np.uint8)
    runs = runs_of(src_slots, dst_slots, src.page_size, dst.page_size)
    table = plan_descriptors(src, dst, runs, layer_pairs, src_heads, dst_heads)
    execute(table, src_bytes, dst_bytes)
    want = np.zeros(dst.nbytes, dtype=np.uint8)
    s_view, w_view = shaped(src, src_bytes), shaped(dst, want)
    for s_slot, d_slot in zip(src_slots, dst_slots, strict=True):
        sp, st_ = divmod(s_slot, src.page_size)
        dp, dt = divmod(d_slot, dst.page_size)
        for sl, dl in layer_pairs:
            w_view[dl, :, dp, dt, slice(*dst_heads)] = s_view[sl, :, sp, st_, slice(*src_heads)]
    assert np.array_equal(dst_bytes, want)  # the named bytes, and nothing else
    return table


@st.composite
def frames(draw):
    layout = draw(st.sampled_from(ORDERS))
    dtype = draw(st.sampled_from(["float32", "float16", "float64"]))
    dim = draw(st.integers(1, 3))
    src_heads_n = draw(st.integers(1, 4))
    dst_heads_n = draw(st.integers(1, 4))
    n = draw(st.integers(1, min(src_heads_n, dst_heads_n)))
    sh0 = draw(st.integers(0, src_heads_n - n))
    dh0 = draw(st.integers(0, dst_heads_n - n))
    src_layers, dst_layers = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    num = draw(st.integers(1, min(src_layers, dst_layers)))
    s0 = draw(st.integers(0, src_layers - num))
    d0 = draw(st.integers(0, dst_layers - num))
    src_ps, dst_ps = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    src = RegionGeometry(src_layers, 6, src_ps, src_heads_n, dim, dtype, layout)
    dst = RegionGeometry(dst_layers, 6, dst_ps, dst_heads_n, dim, dtype, layout)
    tokens = draw(st.integers(1, min(6 * src_ps, 6 * dst_ps)))
    src_slots = draw(st.permutations(range(6 * src_ps)))[:tokens]
    dst_slots = draw(st.permutations(range(6 * dst_ps)))[:tokens]
    if draw(st.booleans()):  # consecutive on both sides, the common case
        src_slots, dst_slots = sorted(src_slots), sorted(dst_slots)
    pairs = [(s0 + i, d0 + i) for i in range(num)]
    return src, dst, src_slots, dst_slots, pairs, (sh0, sh0 + n), (dh0, dh0 + n)


@settings(max_examples=150, deadline=None)
@given(frames())
def test_descriptors_move_exactly_the_frames_kv(case) -> None:
    check_moves_exactly(*case)


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
def test_whole_pages_in_the_same_order_merge_into_one_descriptor_per_layer_half(layout) -> None:
    g = geo(layout=layout)
    table = check_moves_exactly(
        g, g, list(range(4, 16)), list(range(20, 32)), [(0, 0), (1, 1)], (0, 4), (0, 4)
    )
    assert len(table) == 2 * 2  # 2 layers x K|V, three pages each
    assert (table[:, 2] == 3 * 4 * 4 * 2 * 4).all()


def test_the_whole_pool_into_the_same_place_is_one_descriptor() -> None:
    g = geo()
    slots = list(range(g.num_pages * g.page_size))
    table = check_moves_exactly(g, g, slots, slots, [(0, 0), (1, 1)], (0, 4), (0, 4))
    assert table.tolist() == [[0, 0, g.nbytes]]


def test_heterogeneous_tp_head_slice_is_one_descriptor_per_token_in_nhd() -> None:
    # Prefill tp=1 (4 heads) feeding a decode tp=2 rank that owns heads 2..4.
    src, dst = geo(heads=4), geo(heads=2)
    table = check_moves_exactly(src, dst, [0, 1, 2], [8, 9, 10], [(0, 0), (1, 1)], (2, 4), (0, 2))
    assert len(table) == 2 * 2 * 3


def test_decode_tp_smaller_than_prefill_tp_writes_its_slice_into_the_wide_pool() -> None:
    # Prefill tp=2 rank (heads 2..4 of 4) feeding a decode tp=1 rank (all 4 heads).
    check_moves_exactly(geo(heads=2), geo(heads=4), [5, 6], [1, 2], [(0, 0)], (0, 2), (2, 4))


def test_pp_layer_range_lands_at_the_peers_layer_ids() -> None:
    # Prefill pp=2 rank holding global layers 2..4; decode pp=1 holds 0..4.
    check_moves_exactly(
        geo(layers=2), geo(layers=4), [0, 1], [4, 5], [(0, 2), (1, 3)], (0, 4), (0, 4)
    )


def test_different_page_sizes_pair_through_slots() -> None:
    check_moves_exactly(
        geo(ps=4), geo(ps=2), list(range(8)), list(range(6, 14)), [(0, 0)], (0, 4), (0, 4)
    )


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (geo(dtype="float16"), "dtype differs"),
        (geo(dim=4), "head_dim differs"),
        (geo(layout=KVLayout.HND), "layout differs"),
    ],
)
def test_pools_no_descriptor_can_pair_are_refused(other, match) -> None:
    with pytest.raises(PlanError, match=match):
        check_geometries(geo(), other)
    with pytest.raises(PlanError, match=match):
        plan_descriptors(geo(), other, [(0, 0, 1)], [(0, 0)], (0, 1), (0, 1))


@pytest.mark.parametrize(
    ("runs", "pairs", "sh", "dh", "match"),
    [
        ([(0, 0, 1)], [(0, 0)], (0, 2), (0, 1), "differ in size"),
        ([(0, 0, 1)], [(0, 0)], (3, 5), (0, 2), "outside"),
        ([(0, 0, 1)], [(2, 0)], (0, 1), (0, 1), "our layers"),
        ([(0, 0, 1)], [], (0, 1), (0, 1), "no layers"),
        ([(2, 0, 3)], [(0, 0)], (0, 1), (0, 1), "crosses"),
        ([(0, 31, 2)], [(0, 0)], (0, 1), (0, 1), "peer's slots outside"),
        ([(0, 0, 0)], [(0, 0)], (0, 1), (0, 1), "empty"),
    ],
)
def test_frames_outside_either_pool_are_refused(runs, pairs, sh, dh, match) -> None:
    with pytest.raises(PlanError, match=match):
        plan_descriptors(geo(), geo(), runs, pairs, sh, dh)


def test_bad_geometry_is_refused() -> None:
    with pytest.raises(PlanError, match="dtype"):
        geo(dtype="int8")
    with pytest.raises(PlanError, match="num_pages"):
        geo(pages=0)


def test_merge_keeps_rows_that_do_not_continue_on_both_sides() -> None:
    table = np.array([[0, 0, 4], [4, 4, 4], [8, 100, 4], [12, 104, 4], [20, 108, 4]])
    assert merge_descriptors(table).tolist() == [[0, 0, 8], [8, 100, 8], [20, 108, 4]]


def test_no_runs_no_descriptors() -> None:
    assert plan_descriptors(geo(), geo(), [], [(0, 0)], (0, 1), (0, 1)).shape == (0, 3)


# ---- page units (descriptor lists prepared once per registration) -------------


def flat_units(*args) -> tuple[np.ndarray, np.ndarray]:
    """`page_unit_grid` raveled: the unit indices (ours, the peer's) a WRITE names."""
    local, remote = page_unit_grid(*args)
    return local.ravel(), remote.ravel()


def unit_table(src, dst, local, remote) -> np.ndarray:
    """The (src offset, dst offset, bytes) rows a prepared WRITE of these unit indices moves."""
    s_units, d_units = page_units(src), page_units(dst)
    assert (s_units[local, 1] == d_units[remote, 1]).all()
    return np.stack([s_units[local, 0], d_units[remote, 0], s_units[local, 1]], axis=1)


@settings(max_examples=150, deadline=None)
@given(frames())
def test_page_units_and_the_rest_move_what_per_frame_descriptors_move(case) -> None:
    src, dst, src_slots, dst_slots, pairs, sh, dh = case
    rng = np.random.default_rng(1)
    src_bytes = rng.integers(1, 255, src.nbytes, dtype=np.uint8)
    runs = runs_of(src_slots, dst_slots, src.page_size, dst.page_size)
    want = np.zeros(dst.nbytes, dtype=np.uint8)
    execute(plan_descriptors(src, dst, runs, pairs, sh, dh), src_bytes, want)
    got = np.zeros(dst.nbytes, dtype=np.uint8)
    rest = runs
    if can_use_page_units(src, dst, sh, dh):
        pages, rest = split_runs(runs, src.page_size)
        local, remote = flat_units(src, dst, pages, pairs, sh, dh)
        assert local.dtype == remote.dtype == np.int32
        execute(unit_table(src, dst, local, remote), src_bytes, got)
    if rest:
        execute(plan_descriptors(src, dst, rest, pairs, sh, dh), src_bytes, got)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND, KVOrder("LPHKN")])
def test_page_units_tile_the_whole_pool(layout) -> None:
    g = geo(layout=layout)
    units = page_units(g)
    assert units[0, 0] == 0 and (np.diff(units[:, 0]) == units[:-1, 1]).all()
    assert units[:, 1].sum() == g.nbytes and (units[:, 1] == unit_bytes(g)).all()


def test_only_whole_pages_on_both_sides_move_as_units() -> None:
    runs = [(0, 8, 4), (5, 13, 3), (16, 20, 4), (24, 1, 4), (28, 28, 2)]
    pages, rest = split_runs(runs, 4)
    assert pages.tolist() == [[0, 2], [4, 5]]
    assert rest == [(5, 13, 3), (24, 1, 4), (28, 28, 2)]


def test_a_whole_page_of_hnd_is_one_unit_per_head_of_the_slice() -> None:
    src, dst = geo(layout=KVLayout.HND, heads=4), geo(layout=KVLayout.HND, heads=2)
    local, remote = flat_units(src, dst, np.array([[3, 5]]), [(1, 0)], (2, 4), (0, 2))
    # (layer, K|V, page, head) -> ((layer * 2 + kv) * pages + page) * heads + head
    assert local.tolist() == [(2 * 8 + 3) * 4 + 2, (2 * 8 + 3) * 4 + 3,
                              (3 * 8 + 3) * 4 + 2, (3 * 8 + 3) * 4 + 3]  # fmt: skip
    assert remote.tolist() == [(0 * 8 + 5) * 2, (0 * 8 + 5) * 2 + 1,
                               (1 * 8 + 5) * 2, (1 * 8 + 5) * 2 + 1]  # fmt: skip


@pytest.mark.parametrize(
    "src, dst, sh, dh",
    [
        (geo(heads=4), geo(heads=2), (0, 2), (0, 2)),  # an NHD head slice: not whole rows
        (geo(ps=4), geo(ps=8), (0, 4), (0, 4)),  # pages of another size
        # K and V side by side per token: no page of one plane is a block of bytes.
        (geo(layout=KVOrder("LPHNK")), geo(layout=KVOrder("LPHNK")), (0, 4), (0, 4)),
    ],
)
def test_pairings_page_units_cannot_carry_are_left_to_per_frame_descriptors(
    src, dst, sh, dh
) -> None:
    assert not can_use_page_units(src, dst, sh, dh)
    with pytest.raises(PlanError, match="page units"):
        flat_units(src, dst, np.array([[0, 0]]), [(0, 0)], sh, dh)


def test_a_whole_page_of_vllm_cpu_pages_is_one_unit_per_plane_and_head() -> None:
    # LPHKN: a page holds, per head, its K block then its V block; units are
    # (layer, page, head, K|V) in memory order, one page of tokens each.
    src = geo(layout=KVOrder("LPHKN"), heads=4)
    dst = geo(layout=KVOrder("LPHKN"), heads=2)
    local, remote = flat_units(src, dst, np.array([[3, 5]]), [(1, 0)], (2, 4), (0, 2))

    def unit(layer, page, head, kv, heads):  # the grid's order: K|V, then head
        return ((layer * 8 + page) * heads + head) * 2 + kv

    assert local.tolist() == [unit(1, 3, h, kv, 4) for kv in (0, 1) for h in (2, 3)]
    assert remote.tolist() == [unit(0, 5, h, kv, 2) for kv in (0, 1) for h in (0, 1)]


def test_whole_pages_of_vllm_cpu_pages_merge_per_layer_and_page_run() -> None:
    # K and V of a page follow each other there: a page of every head is one block.
    g = geo(layout=KVOrder("LPHKN"))
    table = check_moves_exactly(
        g, g, list(range(4, 16)), list(range(20, 32)), [(0, 0), (1, 1)], (0, 4), (0, 4)
    )
    assert len(table) == 2  # one descriptor per layer: three whole pages, both planes
    assert (table[:, 2] == 3 * 4 * 2 * 4 * 2 * 4).all()


def test_pools_of_different_orders_are_refused_naming_both() -> None:
    with pytest.raises(PlanError, match="ours HND, the peer's LPHKN"):
        check_geometries(geo(layout=KVLayout.HND), geo(layout=KVOrder("LPHKN")))


def test_page_units_outside_either_pool_are_refused() -> None:
    g = geo()
    with pytest.raises(PlanError, match="the peer's pages outside"):
        flat_units(g, g, np.array([[0, 8]]), [(0, 0)], (0, 4), (0, 4))
    with pytest.raises(PlanError, match="our layers outside"):
        flat_units(g, g, np.array([[0, 0]]), [(2, 0)], (0, 4), (0, 4))


@settings(max_examples=200, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4]),
    src_pages=st.permutations(range(6)),
    dst_pages=st.permutations(range(6)),
    num_pages=st.integers(1, 6),
    cut=st.sampled_from(["none", "head", "tail", "swap"]),
)
def test_whole_pages_is_split_runs_of_the_frames_runs(
    ps, src_pages, dst_pages, num_pages, cut
) -> None:
    """The whole-page fast path names the same page pairs as split_runs, or declines."""
    step = np.arange(ps)
    src = (np.asarray(src_pages[:num_pages])[:, None] * ps + step).ravel()
    dst = (np.asarray(dst_pages[:num_pages])[:, None] * ps + step).ravel()
    if cut == "head":  # a partial first page
        src, dst = src[1:], dst[1:]
    elif cut == "tail":  # a partial last page
        src, dst = src[:-1], dst[:-1]
    elif cut == "swap" and len(src) > 1:  # tokens of a page out of order
        src = src.copy()
        src[[0, 1]] = src[[1, 0]]
    pages, rest = split_runs(runs_of(src.tolist(), dst.tolist(), ps, ps), ps)
    got = whole_pages(src, dst, ps)
    if rest or len(src) == 0:
        assert got is None
    else:
        assert got is not None and got.tolist() == pages.tolist()


def test_whole_pages_declines_mismatched_or_empty_frames() -> None:
    assert whole_pages(np.arange(4), np.arange(4), 4).tolist() == [[0, 0]]
    assert whole_pages(np.arange(4), np.arange(8), 4) is None
    assert whole_pages(np.zeros(0, np.int64), np.zeros(0, np.int64), 4) is None
    assert whole_pages(np.arange(2, 6), np.arange(4), 4) is None  # not page-aligned


@settings(max_examples=100, deadline=None)
@given(
    layout=st.sampled_from([KVLayout.NHD, KVLayout.HND]),
    pages=st.permutations(range(8)),
    num_pages=st.integers(1, 8),
    cut=st.tuples(st.integers(0, 8), st.integers(0, 8)),
    heads=st.sampled_from([(0, 4), (1, 3)]),
)
def test_a_frame_cut_from_the_jobs_grid_names_the_units_it_would_plan(
    layout, pages, num_pages, cut, heads
) -> None:
    src, dst = geo(layout=layout), geo(layout=layout, layers=3)
    if not can_use_page_units(src, dst, heads, heads):
        return  # NHD head slices never move as page units
    job_pages = np.stack([np.asarray(pages[:num_pages]), np.arange(num_pages)[::-1]], axis=1)
    pairs = [(0, 2), (1, 0)]
    grid = page_unit_grid(src, dst, job_pages, pairs, heads, heads)
    p0, p1 = sorted(min(c, num_pages) for c in cut)
    local, remote = flat_units(src, dst, job_pages[p0:p1], pairs, heads, heads)
    assert frame_page_units(grid[0], p0, p1).tolist() == local.tolist()
    assert frame_page_units(grid[1], p0, p1).tolist() == remote.tolist()
    assert frame_page_units(grid[0], p0, p1).dtype == np.int32


def test_a_frame_outside_the_jobs_grid_is_refused() -> None:
    g = geo()
    grid = page_unit_grid(g, g, np.array([[0, 1], [2, 3]]), [(0, 0)], (0, 4), (0, 4))
    with pytest.raises(PlanError, match="outside the job"):
        frame_page_units(grid[0], 1, 3)


def test_whole_pages_reads_plain_lists_and_tuples_as_a_worker_builds_them() -> None:
    # token_slots gives lists; a job may carry any sequence.
    assert whole_pages([0, 1, 2, 3, 8, 9, 10, 11], (4, 5, 6, 7, 0, 1, 2, 3), 4).tolist() == [
        [0, 1],
        [2, 0],
    ]
    assert whole_pages([0, 1, 3, 2], [0, 1, 2, 3], 4) is None  # a page's tokens out of order


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
def test_a_grid_is_its_own_array_though_jobs_share_their_layers_bases(layout) -> None:
    g = geo(layout=layout)
    pages = np.array([[0, 1], [2, 3]])
    first, _ = page_unit_grid(g, g, pages, [(0, 0), (1, 1)], (0, 4), (0, 4))
    want = first.copy()
    first[...] = -1  # a caller scribbling on its grid
    again, _ = page_unit_grid(g, g, pages, [(0, 0), (1, 1)], (0, 4), (0, 4))
    assert again.tolist() == want.tolist() and again.dtype == np.int32
