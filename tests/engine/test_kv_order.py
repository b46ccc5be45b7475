"""The physical order of a KV pool's axes, and pools in any order (vLLM's pages)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.engine.kv_order import AXES, HND_ORDER, NHD_ORDER, KVOrder
from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.spec import KVLayout

ALL_ORDERS = ["".join(p) for p in itertools.permutations(AXES)]


def test_our_layouts_are_orders_and_keep_their_names():
    assert NHD_ORDER == KVOrder("LKPNH") == KVOrder.of("NHD") == KVOrder.of(KVLayout.NHD)
    assert HND_ORDER == KVOrder("LKPHN") == KVOrder.of("HND")
    assert (NHD_ORDER.name, HND_ORDER.name, KVOrder("LPHKN").name) == ("NHD", "HND", "LPHKN")
    assert NHD_ORDER.layout is KVLayout.NHD and KVOrder("LPHKN").layout is None


@pytest.mark.parametrize("axes", ["LKPN", "LKPNHX", "LKPNN", "lkpnh", ""])
def test_an_order_names_each_axis_once(axes):
    with pytest.raises(ValueError, match="each of the axes"):
        KVOrder(axes)


@given(st.sampled_from(ALL_ORDERS), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4))
def test_row_strides_are_those_of_the_logical_view(axes, layers, pages, heads):
    order = KVOrder(axes)
    shape = KVPoolShape(layers, pages, 3, heads, 2, "float32", order)
    pool = KVPool(shape)
    strides = shape.row_strides()
    logical = pool.logical  # [L, K, P, N, H, D]
    assert logical.shape == (layers, 2, pages, 3, heads, 2)
    for axis, stride in zip(AXES, logical.stride()[:5], strict=True):
        assert stride == strides[axis] * 2  # rows of head_dim = 2 values


def test_vllm_cpu_pages_put_a_heads_k_block_before_its_v_block():
    # LPHKN, written out by hand: layer, page, head, then K|V, then token.
    shape = KVPoolShape(2, 3, 4, 2, 5, "float32", KVOrder("LPHKN"))
    pool = KVPool(shape)
    k = torch.arange(2 * 5, dtype=torch.float32).view(1, 2, 5) + 100  # token 0, heads 0..1
    v = -k
    pool.write(1, torch.tensor([2 * 4 + 3]), k, v)  # layer 1, page 2, offset 3
    flat = pool.buffer.reshape(-1)
    for head in range(2):
        row_k = (((1 * 3 + 2) * 2 + head) * 2 + 0) * 4 + 3
        row_v = (((1 * 3 + 2) * 2 + head) * 2 + 1) * 4 + 3
        assert torch.equal(flat[row_k * 5 : row_k * 5 + 5], k[0, head])
        assert torch.equal(flat[row_v * 5 : row_v * 5 + 5], v[0, head])
    assert int((flat != 0).sum()) == 2 * 2 * 5


@pytest.mark.parametrize("axes", ["LKPNH", "LKPHN", "LPHKN", "LPHNK", "PLHNK"])
def test_every_order_reads_back_what_it_wrote(axes):
    shape = KVPoolShape(3, 5, 4, 3, 2, "float32", KVOrder(axes))
    pool = KVPool(shape)
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])  # pages 0 and 3, whole
    k = torch.randn(8, 3, 2, generator=gen)
    v = torch.randn(8, 3, 2, generator=gen)
    pool.write(2, slots, k, v)
    got_k, got_v = pool.read(2, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    pages = pool.read_pages(2, torch.tensor([[3, 0]]))  # [2, 1, 2, page, H, D]
    assert torch.equal(pages[:, 0, 0], torch.stack([k[4:], v[4:]]))
    assert torch.equal(pages[:, 0, 1], torch.stack([k[:4], v[:4]]))
    frame = pool.gather_tokens([2], slots, slice(1, 3))  # [1, 2, n, 2, D]
    other = KVPool(shape)
    other.scatter_tokens([0], slots, frame, slice(0, 2))
    assert torch.equal(other.read(0, slots)[0][:, :2], k[:, 1:3])


def test_a_pool_over_foreign_memory_writes_into_it():
    shape = KVPoolShape(2, 4, 4, 2, 3, "float32", KVOrder("LPHKN"))
    memory = torch.zeros(shape.dims())
    pool = KVPool.over(memory, shape)
    pool.write(0, torch.tensor([9]), torch.ones(1, 2, 3), torch.full((1, 2, 3), 2.0))
    assert memory.sum() == 2 * 3 * (1 + 2)
    assert pool.rows.shape == (memory.numel() // 3, 3)


@pytest.mark.parametrize(
    ("memory", "match"),
    [
        (torch.zeros(2, 4, 2, 2, 4, 4), "dims"),
        (torch.zeros(2, 4, 2, 2, 4, 3, dtype=torch.float16), "dtype"),
        (torch.zeros(2, 4, 2, 2, 3, 4).transpose(-1, -2), "contiguous"),
    ],
)
def test_foreign_memory_of_another_shape_is_refused(memory, match):
    shape = KVPoolShape(2, 4, 4, 2, 3, "float32", KVOrder("LPHKN"))
    with pytest.raises(ValueError, match=match):
        KVPool.over(memory, shape)
