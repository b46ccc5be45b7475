"""Staging buffers and the gather that fills them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdcluster.runtime.engine.kv_order import KVOrder
from pdcluster.runtime.spec import KVLayout
from pdcluster.runtime.transfer.staging import (
    StagingPool,
    StagingTimeout,
    frame_view,
    gather_into,
    scatter_bytes,
)
from tests.transfer.transfer_helpers import bits, make_shape, random_pool, random_table, slots

# Our layouts, and the orders of vLLM's KV pages (CPU: K block then V block per
# head; FlashAttention-style: K and V side by side per token).
ORDERS = [*KVLayout, KVOrder("LPHKN"), KVOrder("LPHNK")]


@pytest.mark.parametrize("layout", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize(
    ("layers", "heads"),
    [((0, 1, 2), slice(None)), ((2,), slice(1, 3)), ((1, 0), slice(0, 1)), ((0, 2), slice(3, 4))],
)
def test_gather_into_matches_the_pool_gather(layout, dtype, layers, heads):
    shape = make_shape(layout=layout, dtype=dtype, page_size=4)
    pool = random_pool(shape, seed=1)
    table = random_table(5, shape.num_pages, seed=2)
    idx = torch.tensor(slots(table, 3, 19, shape.page_size))
    want = pool.gather_tokens(layers, idx, heads)
    buf = torch.full((want.numel() * want.element_size() + 16,), 0xAB, dtype=torch.uint8)
    out = frame_view(buf, pool.dtype, want.shape)
    gather_into(pool, layers, idx, heads, out)
    assert torch.equal(bits(out), bits(want))
    assert torch.all(buf[want.numel() * want.element_size() :] == 0xAB)  # nothing past the frame


def test_buffers_are_reused_not_reallocated():
    pool = StagingPool(max_buffers=2)
    first = pool.acquire(1000, timeout=1)
    pool.release(first)
    again = pool.acquire(800, timeout=1)
    assert again.data_ptr() == first.data_ptr()
    assert pool.num_allocated == 1


def test_a_too_small_idle_buffer_is_replaced_by_a_bigger_one():
    pool = StagingPool(max_buffers=1)
    small = pool.acquire(100, timeout=1)
    pool.release(small)
    big = pool.acquire(10_000, timeout=1)
    assert big.numel() >= 10_000
    assert pool.num_allocated == 1


def test_acquire_waits_for_a_release_then_times_out():
    pool = StagingPool(max_buffers=1)
    held = pool.acquire(100, timeout=1)
    started = time.monotonic()
    with pytest.raises(StagingTimeout):
        pool.acquire(100, timeout=0.1)
    assert time.monotonic() - started >= 0.1
    threading.Timer(0.05, pool.release, args=(held,)).start()
    assert pool.acquire(100, timeout=2).data_ptr() == held.data_ptr()


def test_close_wakes_a_waiter_with_an_error():
    pool = StagingPool(max_buffers=1)
    pool.acquire(100, timeout=1)
    errors: list[Exception] = []

    def waiter() -> None:
        try:
            pool.acquire(100, timeout=30)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    pool.close()
    thread.join(2)
    assert not thread.is_alive()
    assert errors and "closed" in str(errors[0])


def test_pool_needs_at_least_one_buffer():
    with pytest.raises(ValueError, match="max_buffers"):
        StagingPool(max_buffers=0)


def test_the_smallest_idle_buffer_that_fits_is_used():
    pool = StagingPool(max_buffers=3)
    held = [pool.acquire(n, timeout=1) for n in (4000, 1000, 2000)]
    for buf in held:
        pool.release(buf)
    got = pool.acquire(1500, timeout=1)
    assert got.data_ptr() == held[2].data_ptr()  # 2000 bytes: the tightest fit
    assert pool.acquire(3000, timeout=1).data_ptr() == held[0].data_ptr()
    assert pool.acquire(10, timeout=1).data_ptr() == held[1].data_ptr()
    assert pool.num_allocated == 3


@pytest.mark.parametrize("layout", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize(
    ("layers", "heads"), [((0, 1, 2), (0, 4)), ((2, 0), (1, 3)), ((1,), (3, 4))]
)
def test_scatter_bytes_matches_the_pool_scatter(layout, dtype, layers, heads):
    shape = make_shape(layout=layout, dtype=dtype, page_size=4)
    want, got = random_pool(shape, seed=3), random_pool(shape, seed=3)
    idx = torch.tensor(slots(random_table(6, shape.num_pages, seed=4), 2, 23, shape.page_size))
    frame = random_pool(shape, seed=5).gather_tokens(layers, idx, slice(*heads))  # [l,2,n,h,D]
    want.scatter_tokens(layers, idx, frame, slice(*heads))
    data = frame.view(torch.uint8).numpy()  # [l, 2, n, h, D * itemsize]
    scatter_bytes(got, layers, idx.numpy(), heads, data)
    assert torch.equal(bits(got.buffer), bits(want.buffer))
