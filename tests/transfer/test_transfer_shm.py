"""The shm transport: one-sided writes into a peer's shared-memory pool."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.spec import KVLayout
from pdcluster.runtime.transfer.job import TransferJob
from pdcluster.runtime.transfer.sender import KVSender
from pdcluster.runtime.transfer.shm import ShmTransport, copy_runs
from tests.transfer.transfer_helpers import (
    SMALL_FRAMES,
    bits,
    expected_pool,
    make_shape,
    next_id,
    random_pool,
    random_table,
    send_one_job,
    slots,
    wait_until,
    whole_job,
)


def shm_job(src_table, dst_table, link, **kw) -> TransferJob:
    return whole_job(src_table, dst_table, link.decode.address, "shm", **kw)


def decode_pool(tmp_path, shape, seed=2) -> KVPool:
    """The decode rank's pool, living in a shared-memory file."""
    return random_pool(shape, seed=seed, shm_path=str(tmp_path / f"kv-{next_id()}.pool"))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("layouts", list(itertools.product(KVLayout, KVLayout)))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_round_trip_is_bit_identical(link, tmp_path, dtype, layouts, page_size, path):
    src = random_pool(
        make_shape(num_pages=64, page_size=page_size, dtype=dtype, layout=layouts[0]), 1
    )
    dst_shape = make_shape(num_pages=64, page_size=page_size, dtype=dtype, layout=layouts[1])
    dst = decode_pool(tmp_path, dst_shape)
    needed = -(-41 // page_size)
    src_table = random_table(needed, 64, seed=3)
    dst_table = random_table(needed, 64, seed=4)
    job = shm_job(src_table, dst_table, link, page_size=page_size, tokens=(3, 41))
    want = expected_pool(
        src, dst, job.src_slots, job.dst_slots, (0, 1, 2), (0, 1, 2), (0, 4), (0, 4)
    )
    # min_run_bytes 0: copy run by run straight from the pool; huge: gather + scatter.
    transport = ShmTransport(link.prefill, min_run_bytes=0 if path == "direct" else 1 << 40)
    transport.register_peer(link.decode.address, dst.shm_path, dst_shape)
    assert send_one_job(link, src, transport, job, drain_s=5) == [job]
    assert torch.equal(bits(dst.buffer), bits(want))


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dst_layers", [(1, 2), (2, 0)])
@pytest.mark.parametrize("min_run_bytes", [0, 1 << 40])
def test_head_slices_and_layer_ranges_land_in_place(
    link, tmp_path, layout, dst_layers, min_run_bytes
):
    # prefill tp=1 (8 heads), pp stage holding global layers 1..2; decode tp=2 rank 1, pp=1.
    src = random_pool(make_shape(num_layers=2, num_kv_heads=8, layout=layout), 5)
    dst_shape = make_shape(num_layers=3, num_kv_heads=4, layout=layout)
    dst = decode_pool(tmp_path, dst_shape)
    src_table, dst_table = random_table(6, 32, 6), random_table(6, 32, 7)
    job = shm_job(
        src_table, dst_table, link, tokens=(0, 22),
        src_layers=(0, 1), dst_layers=dst_layers, src_heads=(4, 8), dst_heads=(0, 4),
    )  # fmt: skip
    want = expected_pool(src, dst, job.src_slots, job.dst_slots, (0, 1), dst_layers, (4, 8), (0, 4))
    transport = ShmTransport(link.prefill, min_run_bytes=min_run_bytes)
    transport.register_peer(link.decode.address, dst.shm_path, dst_shape)
    assert send_one_job(link, src, transport, job, drain_s=5) == [job]
    assert torch.equal(bits(dst.buffer), bits(want))


def test_the_completion_message_arrives_after_the_data_is_in_place(link, tmp_path):
    shape = make_shape()
    src, dst = random_pool(shape, 8), decode_pool(tmp_path, shape)
    job = shm_job(random_table(8, 32, 9), random_table(8, 32, 10), link)
    want = expected_pool(
        src, dst, job.src_slots, job.dst_slots, (0, 1, 2), (0, 1, 2), (0, 4), (0, 4)
    )
    seen: list[bool] = []
    done = threading.Event()

    def on_control(sender: str, data: bytes) -> None:
        if data == job.notify:
            seen.append(torch.equal(bits(dst.buffer), bits(want)))
            done.set()

    old = link.decode.on_control
    link.decode.on_control = on_control
    try:
        transport = ShmTransport(link.prefill)
        transport.register_peer(link.decode.address, dst.shm_path, shape)
        sender = KVSender(src, transport, SMALL_FRAMES)
        sender.start()
        sender.submit(job)
        assert done.wait(10)
        sender.close()
    finally:
        link.decode.on_control = old
    assert seen == [True]


# ---- registration and job checks ---------------------------------------------


def test_registering_a_missing_pool_file_is_refused(link, tmp_path):
    transport = ShmTransport(link.prefill)
    missing = tmp_path / "nope.pool"
    with pytest.raises(ValueError, match="No such file"):
        transport.register_peer(link.decode.address, str(missing), make_shape())
    assert not missing.exists()  # never created by the sender
    with pytest.raises(ValueError, match="no shared-memory pool"):
        transport.peer_pool(link.decode.address)


def test_registering_a_pool_of_another_size_is_refused(link, tmp_path):
    dst = decode_pool(tmp_path, make_shape(num_pages=16))
    transport = ShmTransport(link.prefill)
    with pytest.raises(ValueError, match="needs"):
        transport.register_peer(link.decode.address, dst.shm_path, make_shape(num_pages=32))
    with pytest.raises(ValueError, match="tcp://host:port"):
        transport.register_peer("somewhere", dst.shm_path, make_shape(num_pages=16))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dst_slots": None}, "needs dst_slots"),
        ({"dst_slots": list(range(29))}, "29 dst_slots"),
        ({"dst_slots": list(range(100, 130))}, "dst_slots outside"),
        ({"dst_heads": (2, 6)}, "exceeds"),
        ({"peer": "tcp://127.0.0.1:1"}, "no shared-memory pool"),
    ],
)
def test_jobs_the_destination_cannot_hold_are_refused(link, tmp_path, change, message):
    shape = make_shape(num_pages=8)
    dst = decode_pool(tmp_path, shape)
    transport = ShmTransport(link.prefill)
    transport.register_peer(link.decode.address, dst.shm_path, shape)
    src = random_pool(make_shape(), 11)
    sender = KVSender(src, transport, SMALL_FRAMES)
    sender.start()
    job = shm_job(random_table(8, 32, 12), random_table(8, 8, 13), link)
    before = dst.buffer.clone()
    with pytest.raises(ValueError, match=message):
        sender.submit(TransferJob(**{**job.__dict__, **change}))
    assert sender.in_flight(21) == 0
    sender.close()
    assert torch.equal(bits(dst.buffer), bits(before))


# ---- drain and cancel ---------------------------------------------------------


class GatedShm(ShmTransport):
    """Holds every frame write until the gate opens, as a slow copy would."""

    def __init__(self, endpoint):
        super().__init__(endpoint, min_run_bytes=0)  # always the direct pool-to-pool copy
        self.gate = threading.Event()
        self.entered = threading.Event()

    def copy_frame(self, job, header, pool, slots, on_done):
        self.entered.set()
        assert self.gate.wait(10)
        super().copy_frame(job, header, pool, slots, on_done)


def test_cancel_stops_a_room_and_drain_waits_for_its_write_in_flight(link, tmp_path):
    shape = make_shape()
    src, dst = random_pool(shape, 14), decode_pool(tmp_path, shape)
    before = dst.buffer.clone()
    transport = GatedShm(link.prefill)
    transport.register_peer(link.decode.address, dst.shm_path, shape)
    failures, completed = [], []
    sender = KVSender(
        src, transport, SMALL_FRAMES,
        on_failure=lambda *a: failures.append(a), on_complete=completed.append,
    )  # fmt: skip
    sender.start()
    src_table, dst_table = random_table(8, 32, 15), random_table(8, 32, 16)
    first = shm_job(src_table, dst_table, link, tokens=(0, 16))
    second = shm_job(src_table, dst_table, link, tokens=(16, 30))
    spare_page = next(p for p in range(32) if p not in dst_table)
    other = shm_job(random_table(2, 32, 17), [spare_page], link, room=22, tokens=(0, 4))
    for job in (first, second, other):
        assert sender.submit(job)
    assert transport.entered.wait(5)  # first frame of `first` is being written
    assert (sender.in_flight(21), sender.in_flight(22)) == (2, 1)
    assert not sender.drain(21, timeout=0.05)

    sender.cancel(21)
    assert sender.in_flight(21) == 1  # `second` dropped; `first` is mid-write
    assert not sender.submit(shm_job(src_table, dst_table, link, tokens=(0, 4)))
    drained = []
    waiter = threading.Thread(target=lambda: drained.append(sender.drain(21, timeout=5)))
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive()  # an abort may not be acked while the write is in flight
    transport.gate.set()
    waiter.join(5)
    assert drained == [True] and sender.in_flight(21) == 0
    link.inbox.wait_for(other.notify)
    sender.close()

    # Only the frame already being written landed; nothing after the cancel did.
    frame_tokens = 2048 // (3 * 2 * 4 * 8 * 4)
    done = expected_pool(
        src, dst.__class__(shape), first.src_slots[:frame_tokens], first.dst_slots[:frame_tokens],
        (0, 1, 2), (0, 1, 2), (0, 4), (0, 4),
    )  # fmt: skip
    written = torch.tensor(first.dst_slots[:frame_tokens])
    untouched = torch.tensor(first.dst_slots[frame_tokens:] + second.dst_slots)
    ref_before, ref_done = KVPool(shape), KVPool(shape)
    ref_before.buffer.copy_(before)
    ref_done.buffer.copy_(done)
    for layer in range(3):
        assert torch.equal(
            bits(dst.read(layer, written)[0]), bits(ref_done.read(layer, written)[0])
        )
        assert torch.equal(
            bits(dst.read(layer, untouched)[1]), bits(ref_before.read(layer, untouched)[1])
        )
    assert failures == []  # a cancel is the control plane's decision, not a failure
    assert completed == [other]
    assert sender.is_closed_room(21)


def test_a_failed_write_fails_the_room_once_and_refuses_more(link, tmp_path):
    shape = make_shape()
    src, dst = random_pool(shape, 18), decode_pool(tmp_path, shape)
    transport = GatedShm(link.prefill)
    transport.register_peer(link.decode.address, dst.shm_path, shape)
    failures: list[tuple[int, int, str]] = []
    sender = KVSender(src, transport, SMALL_FRAMES, on_failure=lambda *a: failures.append(a))
    sender.start()
    src_table, dst_table = random_table(8, 32, 19), random_table(8, 32, 20)
    for tokens in ((0, 16), (16, 30)):
        sender.submit(shm_job(src_table, dst_table, link, tokens=tokens, generation=4))
    assert transport.entered.wait(5)
    transport.unregister_peer(link.decode.address)  # e.g. the decode rank was declared dead
    transport.gate.set()
    assert sender.drain(21, timeout=5)
    assert failures == [(21, 4, "peer_unregistered")]
    transport.register_peer(link.decode.address, dst.shm_path, shape)
    assert not sender.submit(shm_job(src_table, dst_table, link, tokens=(0, 4)))
    sender.forget(21)  # the control plane retired the room; a new request may reuse it
    job = shm_job(src_table, dst_table, link, tokens=(0, 4))
    assert sender.submit(job)
    link.inbox.wait_for(job.notify)
    sender.close()
    wait_until(lambda: sender.in_flight(21) == 0)


# ---- copy runs ---------------------------------------------------------------


@given(
    src_page_size=st.sampled_from([1, 2, 4, 16]),
    dst_page_size=st.sampled_from([1, 2, 4, 16]),
    start=st.integers(0, 40),
    length=st.integers(0, 60),
    seed=st.integers(0, 1000),
)
def test_copy_runs_cover_tokens_in_order_within_pages(
    src_page_size, dst_page_size, start, length, seed
):
    capacity = start + length + 1
    src_table = random_table(-(-capacity // src_page_size), 4096, seed)
    dst_table = random_table(-(-capacity // dst_page_size), 4096, seed + 1)
    src = np.array(slots(src_table, start, start + length, src_page_size), dtype=np.int64)
    dst = np.array(slots(dst_table, start, start + length, dst_page_size), dtype=np.int64)
    runs = copy_runs(src, dst, src_page_size, dst_page_size)
    assert sum(n for _, _, n in runs) == length
    flat_src = [s + i for s, _, n in runs for i in range(n)]
    flat_dst = [d + i for _, d, n in runs for i in range(n)]
    assert flat_src == src.tolist() and flat_dst == dst.tolist()
    for s, d, n in runs:
        assert n > 0
        assert s // src_page_size == (s + n - 1) // src_page_size
        assert d // dst_page_size == (d + n - 1) // dst_page_size
    # Maximal: with equal page sizes and aligned tables, runs are exactly the pages touched.
    if src_page_size == dst_page_size and length:
        pages_touched = len({p for p in (src // src_page_size).tolist()})
        assert len(runs) == pages_touched
