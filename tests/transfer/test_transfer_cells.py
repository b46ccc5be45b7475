"""Copy granularity (cells.py) and the run-sized gather/scatter built on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.spec import KVLayout
from pdcluster.runtime.transfer.cells import cell_tokens, is_valid_cell
from pdcluster.runtime.transfer.staging import frame_view, gather_into, scatter_bytes
from tests.transfer.transfer_helpers import bits, make_shape, random_pool, random_table, slots


@st.composite
def paged_slots(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """Slots of a token range through a shuffled page table, as requests have them."""
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_pages = draw(st.integers(1, 24))
    table = draw(st.permutations(range(num_pages)))
    # Sometimes neighbouring table entries are consecutive pages (a fresh allocator).
    if draw(st.booleans()):
        table = sorted(table)
    start = draw(st.integers(0, num_pages * page_size - 1))
    end = draw(st.integers(start + 1, num_pages * page_size))
    positions = np.arange(start, end)
    pages = np.asarray(table, dtype=np.int64)[positions // page_size]
    return pages * page_size + positions % page_size, num_pages * page_size


@st.composite
def any_slots(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    num_slots = draw(st.integers(1, 64))
    chosen = draw(st.lists(st.integers(0, num_slots - 1), min_size=1, max_size=64, unique=True))
    return np.asarray(chosen, dtype=np.int64), num_slots


@given(st.one_of(paged_slots(), any_slots()))
def test_cell_is_the_largest_valid_one(case):
    frame_slots, num_slots = case
    cell = cell_tokens(frame_slots, num_slots)
    assert is_valid_cell(frame_slots, num_slots, cell)
    for larger in range(cell + 1, len(frame_slots) + 1):
        assert not is_valid_cell(frame_slots, num_slots, larger)


@pytest.mark.parametrize(
    ("table", "tokens", "expected"),
    [
        ([5, 2, 7, 0], (0, 16), 4),  # whole pages of 4, shuffled: one page per cell
        ([5, 2, 7, 0], (0, 6), 2),  # one page and a half
        ([5, 2, 7, 0], (1, 9), 1),  # starts mid-page: token by token
        ([2, 3, 4, 5], (0, 16), 8),  # one run of 16 slots, but cells start at multiples
        ([4, 5, 6, 7], (0, 16), 16),  # ... of their size: this one is a single cell
        ([2, 3, 9, 5], (0, 16), 4),
        ([0, 1], (0, 8), 8),
    ],
)
def test_cell_of_typical_frames(table, tokens, expected):
    frame_slots = np.asarray(slots(table, *tokens, page_size=4), dtype=np.int64)
    assert cell_tokens(frame_slots, num_slots=64) == expected


def test_a_cell_never_exceeds_what_divides_the_pool():
    # 12 consecutive slots, but cells of 8 or 12 would not tile a pool of 20.
    assert cell_tokens(np.arange(4, 16, dtype=np.int64), num_slots=20) == 4


@pytest.mark.parametrize(("frame_slots", "num_slots"), [([], 8), ([1], 0)])
def test_cell_rejects_bad_arguments(frame_slots, num_slots):
    with pytest.raises(ValueError):
        cell_tokens(np.asarray(frame_slots, dtype=np.int64), num_slots)


# ---- the copies that use it ---------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(list(KVLayout)),
    page_size=st.sampled_from([1, 4, 8]),
    seed=st.integers(0, 1000),
    tokens=st.tuples(st.integers(0, 40), st.integers(1, 40)),
    layers=st.sampled_from([(0, 1, 2), (2, 0), (1,)]),
    heads=st.sampled_from([(0, 4), (1, 3), (0, 1)]),
    sorted_table=st.booleans(),
)
def test_gather_then_scatter_moves_exactly_the_frame(
    layout, page_size, seed, tokens, layers, heads, sorted_table
):
    shape = make_shape(layout=layout, page_size=page_size, num_pages=48 // page_size)
    start, length = tokens[0], min(tokens[1], 48 - tokens[0])
    if length <= 0:
        return
    needed = -(-(start + length) // page_size)
    src_table = random_table(needed, shape.num_pages, seed=seed)
    dst_table = random_table(needed, shape.num_pages, seed=seed + 1)
    if sorted_table:
        src_table, dst_table = sorted(src_table), sorted(dst_table)
    src_idx = torch.tensor(slots(src_table, start, start + length, page_size))
    dst_idx = torch.tensor(slots(dst_table, start, start + length, page_size))
    src = random_pool(shape, seed=seed)
    want = src.gather_tokens(layers, src_idx, slice(*heads))  # [l, 2, n, h, D]
    buf = torch.full((want.numel() * want.element_size() + 8,), 0xCD, dtype=torch.uint8)
    out = frame_view(buf, src.dtype, want.shape)
    gather_into(src, layers, src_idx, slice(*heads), out)
    assert torch.equal(bits(out), bits(want))
    assert torch.all(buf[want.numel() * want.element_size() :] == 0xCD)

    got, ref = random_pool(shape, seed=seed + 2), random_pool(shape, seed=seed + 2)
    ref.scatter_tokens(layers, dst_idx, want, slice(*heads))
    scatter_bytes(got, layers, dst_idx.numpy(), heads, out.view(torch.uint8).numpy())
    assert torch.equal(bits(got.buffer), bits(ref.buffer))  # nothing outside the frame's slots


def test_gather_refuses_slots_outside_the_pool():
    shape = make_shape(page_size=4, num_pages=4)
    pool = random_pool(shape, seed=0)
    buf = torch.empty(4 * 3 * 2 * 4 * 8 * 4, dtype=torch.uint8)
    out = frame_view(buf, pool.dtype, (3, 2, 4, 4, 8))
    with pytest.raises(IndexError, match="slots"):
        gather_into(pool, (0, 1, 2), torch.arange(14, 18), slice(None), out)
    with pytest.raises(IndexError, match="layers"):
        gather_into(pool, (0, 1, 3), torch.arange(0, 4), slice(None), out)
