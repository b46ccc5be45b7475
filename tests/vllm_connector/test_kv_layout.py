"""vLLM's KV views read as one of our pools: every (layer, K|V, page, token, head) in its place."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.engine.kv_order import KVOrder
from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.vllm_connector.kv_layout import (
    LayerView,
    VllmLayoutError,
    describe_vllm_kv,
)

# What vLLM 0.32's CPU worker registered for a 2-layer model, 2 KV heads of
# 64, float32, 32-token blocks (its default LBHNC layout, 1 GiB of cache).
CPU_VIEWS = [
    LayerView((16384, 2, 32, 128), (8192, 4096, 128, 1), 139799910412352 + i * 536870912)
    for i in range(2)
]


def test_the_cpu_backend_pages_are_k_blocks_then_v_blocks_per_head():
    kv = describe_vllm_kv(
        CPU_VIEWS, backend="CPU_ATTN", dtype="float32", head_size=64, kernel="vec"
    )
    assert kv.shape.order == KVOrder("LPHKN")
    # Its kernels keep a page's interior their own way: pages move whole, and
    # both sides must share the backend and its kernel.
    assert kv.shape.whole_pages and kv.kv_layout == "LPHKN:CPU_ATTN/vec"
    assert (kv.shape.num_layers, kv.shape.num_pages, kv.shape.page_size) == (2, 16384, 32)
    assert (kv.shape.num_kv_heads, kv.shape.head_dim) == (2, 64)
    assert kv.address == CPU_VIEWS[0].address
    assert kv.nbytes == 2 * 536870912


def test_one_kv_head_per_rank_names_the_order_of_a_rank_with_all_heads():
    # vLLM TP2 over 2 KV heads: each rank's views hold one head.
    views = [LayerView((16384, 1, 32, 128), (4096, 4096, 128, 1), i * 268435456) for i in (0, 1)]
    kv = describe_vllm_kv(views, backend="CPU_ATTN", dtype="float32", head_size=64)
    assert kv.shape.order == KVOrder("LPHKN")


def test_flash_attention_reads_k_and_v_side_by_side_per_token():
    kv = describe_vllm_kv(CPU_VIEWS, backend="FLASH_ATTN", dtype="float32", head_size=64)
    assert kv.shape.order == KVOrder("LPHNK")
    assert not kv.shape.whole_pages and kv.kv_layout == "LPHNK"  # token rows: any run moves


def vllm_strides(order: str, dims: dict[str, int]) -> dict[str, int]:
    """Element strides of vLLM's logical axes L, B, H, N, C for a dense buffer in `order`."""
    strides, step = {}, 1
    for axis in reversed(order):
        strides[axis] = step
        step *= dims[axis]
    return strides


def views_for(order: str, layers: int, blocks: int, heads: int, tokens: int, dim: int):
    dims = {"L": layers, "B": blocks, "H": heads, "N": tokens, "C": 2 * dim}
    s = vllm_strides(order, dims)
    return [
        LayerView(
            (blocks, heads, tokens, 2 * dim), (s["B"], s["H"], s["N"], s["C"]), 4 * s["L"] * i
        )
        for i in range(layers)
    ]


VLLM_ORDERS = ["".join(p) + "C" for p in itertools.permutations("LBHN")]


@given(
    st.sampled_from(VLLM_ORDERS),
    st.integers(2, 3),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 3),
)
def test_every_vllm_layout_maps_to_our_order_of_its_axes(order, layers, blocks, heads, tokens, dim):
    views = views_for(order, layers, blocks, heads, tokens, dim)
    kv = describe_vllm_kv(views, backend="FLASH_ATTN", dtype="float32", head_size=dim)
    ours = order.replace("B", "P").replace("C", "K")  # content = K then V per token
    if blocks > 1 and heads > 1 and tokens > 1:  # size-1 axes are free to sort anywhere
        assert kv.shape.order == KVOrder(ours)
    if views[0].strides[2] == 2 * dim:  # a block's tokens are consecutive cells
        planes = describe_vllm_kv(views, backend="CPU_ATTN", dtype="float32", head_size=dim)
        if tokens > 1 and heads > 1:
            # A size-1 axis may sort anywhere (here a single block): leave it out.
            sizes = {"L": layers, "P": blocks, "H": heads}
            placed = "".join(a for a in planes.shape.order.axes if sizes.get(a, 2) > 1)
            assert placed.endswith("KN")
    else:
        with pytest.raises(VllmLayoutError, match="consecutive K rows"):
            describe_vllm_kv(views, backend="CPU_ATTN", dtype="float32", head_size=dim)


def cpu_backend_kv(layer_view: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V views vLLM hands its CPU kernels for one layer: [B, H, N, D] each."""
    b, h, n, _ = layer_view.shape
    key, value = layer_view.reshape(b, h, 2 * n, dim).chunk(2, dim=2)
    return key, value


def test_a_pool_over_vllm_cpu_memory_addresses_the_view_vllm_hands_its_kernels():
    layers, blocks, heads, tokens, dim = 3, 5, 2, 4, 3
    raw = torch.zeros(layers * blocks * heads * tokens * 2 * dim)
    per_layer = raw.view(layers, blocks, heads, tokens, 2 * dim)
    views = [
        LayerView(
            tuple(per_layer[i].shape),  # type: ignore[arg-type]
            per_layer[i].stride(),  # type: ignore[arg-type]
            per_layer[i].data_ptr(),
        )
        for i in range(layers)
    ]
    kv = describe_vllm_kv(views, backend="CPU_ATTN", dtype="float32", head_size=dim)
    gen = torch.Generator().manual_seed(0)
    for i in range(layers):
        key, value = cpu_backend_kv(per_layer[i], dim)
        key.copy_(torch.randn(key.shape, generator=gen))
        value.copy_(torch.randn(value.shape, generator=gen))
    pool = KVPool.over(raw.view(kv.shape.dims()), kv.shape)
    slots = torch.tensor([0, 3, 9, 17, 6])  # pages 0, 0, 2, 4, 1
    for i in range(layers):
        key, value = cpu_backend_kv(per_layer[i], dim)
        want_k = key[slots // tokens, :, slots % tokens]  # [n, H, D]
        want_v = value[slots // tokens, :, slots % tokens]
        got_k, got_v = pool.read(i, slots)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize(
    ("views", "kwargs", "match"),
    [
        (CPU_VIEWS, {"backend": "FLASHINFER"}, "FLASHINFER is not supported"),
        (CPU_VIEWS, {"head_size": 32}, "not K and V of head size 32"),
        (CPU_VIEWS, {"dtype": "fp8"}, "dtype fp8"),
        ([], {}, "no KV cache layer"),
        (
            [CPU_VIEWS[0], LayerView((16384, 2, 32, 128), (8192, 4096, 128, 1), 1)],
            {},
            "not one buffer",
        ),
        (
            [CPU_VIEWS[0], LayerView((8192, 2, 32, 128), (8192, 4096, 128, 1), 2)],
            {},
            "equal layers",
        ),
        (
            [
                LayerView((4, 2, 32, 128), (16384, 4096, 128, 1), 0 + i * 4 * 16384 * 4)
                for i in (0, 1)
            ],
            {},
            "not one dense buffer",
        ),
    ],
)
def test_caches_our_transports_cannot_address_are_refused_naming_why(views, kwargs, match):
    args = {"backend": "CPU_ATTN", "dtype": "float32", "head_size": 64} | kwargs
    with pytest.raises(VllmLayoutError, match=match):
        describe_vllm_kv(views, **args)
