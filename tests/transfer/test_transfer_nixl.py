"""The nixl transport: one-sided NIXL WRITEs into a peer's registered pool (two agents)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.spec import KVLayout
from pdcluster.runtime.transfer.job import TransferJob
from pdcluster.runtime.transfer.sender import KVSender, SenderConfig
from tests.transfer.nixl_helpers import need_nixl
from tests.transfer.transfer_helpers import (
    Link,
    bits,
    expected_pool,
    make_shape,
    random_pool,
    random_table,
    send_one_job,
    wait_until,
    whole_job,
)

SMALL_FRAMES = SenderConfig(max_frame_bytes=2048, min_frame_bytes=512)
_ids = itertools.count()


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    need_nixl()
    opened = Link.open()
    yield opened
    opened.close()


def agent(pool: KVPool):
    from pdcluster.runtime.transfer.nixl_agent import NixlAgent

    return NixlAgent(f"test-{next(_ids)}", pool)


def transport(link: Link, src: KVPool, dst: KVPool, **kw):
    """A prefill-side transport with the decode pool's agent registered."""
    from pdcluster.runtime.transfer.nixl import NixlTransport

    t = NixlTransport(link.prefill, agent(src), **kw)
    decode_agent = agent(dst)
    t.register_peer(link.decode.address, decode_agent.region(), dst.shape)
    t.decode_agent = decode_agent  # kept alive with the transport
    return t


def nixl_job(src_table, dst_table, link, **kw) -> TransferJob:
    return whole_job(src_table, dst_table, link.decode.address, "nixl", **kw)


def done_later(t) -> None:
    """Posted WRITEs report PROC (as over RDMA, where completion comes later), so they
    finish through the progress thread's `check_xfer_state`, never inside the post."""
    nx = t.agent.agent
    real = nx.transfer

    def posted(handle):
        state = real(handle)
        return "PROC" if state == "DONE" else state

    nx.transfer = posted


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("page_size", [1, 16])
def test_round_trip_is_bit_identical(link, dtype, layout, page_size):
    shape = make_shape(num_pages=64, page_size=page_size, dtype=dtype, layout=layout)
    src, dst = random_pool(shape, 1), random_pool(shape, 2)
    needed = -(-41 // page_size)
    job = nixl_job(
        random_table(needed, 64, seed=3), random_table(needed, 64, seed=4), link,
        page_size=page_size, tokens=(3, 41),
    )  # fmt: skip
    want = expected_pool(
        src, dst, job.src_slots, job.dst_slots, (0, 1, 2), (0, 1, 2), (0, 4), (0, 4)
    )
    t = transport(link, src, dst)
    completed = send_one_job(link, src, t, job, drain_s=10)
    t.close()
    assert completed == [job]
    assert torch.equal(bits(dst.buffer), bits(want))
    assert t.stats["writes"] >= 1 and t.stats["errors"] == 0


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dst_layers", [(1, 2), (2, 0)])
def test_head_slices_and_layer_ranges_land_in_place(link, layout, dst_layers):
    # prefill tp=1 (8 heads), pp stage holding global layers 1..2; decode tp=2 rank 1, pp=1.
    src = random_pool(make_shape(num_layers=2, num_kv_heads=8, layout=layout), 5)
    dst = random_pool(make_shape(num_layers=3, num_kv_heads=4, layout=layout), 6)
    job = nixl_job(
        random_table(6, 32, 6), random_table(6, 32, 7), link, tokens=(0, 22),
        src_layers=(0, 1), dst_layers=dst_layers, src_heads=(4, 8), dst_heads=(0, 4),
    )  # fmt: skip
    want = expected_pool(src, dst, job.src_slots, job.dst_slots, (0, 1), dst_layers, (4, 8), (0, 4))
    t = transport(link, src, dst)
    assert send_one_job(link, src, t, job, drain_s=10) == [job]
    t.close()
    assert torch.equal(bits(dst.buffer), bits(want))


class Calls:
    """Counts calls of the NIXL agent methods it wraps (the real ones still run)."""

    def __init__(self, nx, *names: str) -> None:
        self.count = dict.fromkeys(names, 0)
        for name in names:
            real = getattr(nx, name)

            def counted(*args, _name=name, _real=real, **kwargs):
                self.count[_name] += 1
                return _real(*args, **kwargs)

            setattr(nx, name, counted)


@pytest.mark.parametrize("layout", list(KVLayout))
def test_whole_pages_use_the_lists_prepared_at_registration(link, layout):
    """Frames of whole pages build no descriptor list: they name prepared page units."""
    shape = make_shape(num_pages=64, page_size=4, layout=layout)
    src, dst = random_pool(shape, 26), random_pool(shape, 27)
    t = transport(link, src, dst)
    calls = Calls(t.agent.agent, "prep_xfer_dlist", "initialize_xfer", "make_prepped_xfer")
    sender = KVSender(src, t, SenderConfig())  # frames cut at page boundaries
    sender.start()
    want = KVPool(shape)
    want.buffer.copy_(dst.buffer)
    for room, tokens in ((31, (0, 32)), (32, (4, 48)), (33, (2, 19))):
        job = nixl_job(
            random_table(12, 64, room), random_table(12, 64, room + 50), link,
            tokens=tokens, room=room,
        )  # fmt: skip
        layers, heads = (0, 1, 2), (0, 4)
        want.buffer.copy_(
            expected_pool(src, want, job.src_slots, job.dst_slots, layers, layers, heads, heads)
        )
        assert sender.submit(job)
        link.inbox.wait_for(job.notify)
        assert sender.drain(room, timeout=10)
        if tokens[0] % 4 == 0 and tokens[1] % 4 == 0:
            assert calls.count["initialize_xfer"] == 0, "per-frame descriptors for whole pages"
    sender.close()
    t.close()
    assert calls.count["prep_xfer_dlist"] == 0  # prepared at registration, not per frame
    assert calls.count["make_prepped_xfer"] >= 3
    assert calls.count["initialize_xfer"] >= 1  # room 33's partial pages
    assert t.stats["errors"] == 0
    assert torch.equal(bits(dst.buffer), bits(want.buffer))


def test_a_room_stays_in_flight_until_its_handles_report_done(link):
    """Success (and an abort's ack) wait for in_flight == 0: it must cover posted WRITEs."""
    shape = make_shape()
    src, dst = random_pool(shape, 8), random_pool(shape, 9)
    t = transport(link, src, dst)
    done_later(t)
    gate = threading.Event()
    original_check = t.agent.agent.check_xfer_state

    def held_check(handle):
        gate.wait(10)
        return original_check(handle)

    t.agent.agent.check_xfer_state = held_check
    completed: list[TransferJob] = []
    sender = KVSender(src, t, SMALL_FRAMES, on_complete=completed.append)
    sender.start()
    job = nixl_job(random_table(8, 32, 10), random_table(8, 32, 11), link)
    assert sender.submit(job)
    assert not sender.drain(21, timeout=0.3)  # posted, not reported done: still in flight
    assert completed == [] and sender.in_flight(21) == 1
    gate.set()
    assert sender.drain(21, timeout=10)
    assert completed == [job]
    sender.close()
    t.close()


def test_a_failed_handle_fails_the_room_with_the_backends_error(link):
    shape = make_shape()
    src, dst = random_pool(shape, 12), random_pool(shape, 13)
    t = transport(link, src, dst)
    done_later(t)
    t.agent.agent.check_xfer_state = lambda handle: "ERR"
    failures: list[tuple] = []
    sender = KVSender(src, t, SMALL_FRAMES, on_failure=lambda *a: failures.append(a))
    sender.start()
    assert sender.submit(nixl_job(random_table(8, 32, 14), random_table(8, 32, 15), link))
    assert sender.drain(21, timeout=10)
    sender.close()
    t.close()
    assert len(failures) == 1 and failures[0][:2] == (21, 0)
    assert failures[0][2].startswith("nixl_write_failed")


def test_a_region_of_another_size_or_geometry_is_refused(link):
    from pdcluster.runtime.transfer.nixl import NixlTransport

    shape = make_shape()
    src = random_pool(shape, 16)
    t = NixlTransport(link.prefill, agent(src))
    other = random_pool(make_shape(num_pages=shape.num_pages * 2), 17)
    with pytest.raises(ValueError, match="needs"):
        t.register_peer(link.decode.address, agent(other).region(), shape)
    hnd = random_pool(make_shape(layout=KVLayout.HND), 18)
    with pytest.raises(ValueError, match="layout differs"):
        t.register_peer(link.decode.address, agent(hnd).region(), hnd.shape)
    t.close()


def test_jobs_for_an_unregistered_peer_are_refused(link):
    from pdcluster.runtime.transfer.nixl import NixlTransport

    shape = make_shape()
    src = random_pool(shape, 19)
    t = NixlTransport(link.prefill, agent(src))
    sender = KVSender(src, t, SMALL_FRAMES)
    with pytest.raises(ValueError, match="no NIXL agent"):
        sender.submit(nixl_job(random_table(8, 32, 20), random_table(8, 32, 21), link))
    t.close()


def test_pages_reused_after_an_abort_never_receive_late_bytes(link):
    """Poison: cancel a room mid-transfer; once drain says nothing can move, decode reuses
    the pages (fills them with a poison pattern) and no byte of the room lands there again."""
    shape = make_shape(num_pages=64)
    src, dst = random_pool(shape, 22), random_pool(shape, 23)
    t = transport(link, src, dst)
    done_later(t)
    gate, entered = threading.Event(), threading.Event()
    original_check = t.agent.agent.check_xfer_state

    def held_check(handle):
        entered.set()
        gate.wait(10)
        return original_check(handle)

    t.agent.agent.check_xfer_state = held_check
    sender = KVSender(src, t, SMALL_FRAMES)
    sender.start()
    dst_table = random_table(16, 64, 25)
    job = nixl_job(random_table(16, 64, 24), dst_table, link, tokens=(0, 60))
    assert sender.submit(job)
    assert entered.wait(10)  # a WRITE is posted and not yet reported done
    sender.cancel(21)
    drained: list[bool] = []
    waiter = threading.Thread(target=lambda: drained.append(sender.drain(21, timeout=10)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # no ack while a handle of the room is unfinished
    gate.set()
    waiter.join(10)
    assert drained == [True]
    # Decode frees and reuses the room's pages: poison them, then give any late write time.
    pages = torch.tensor(sorted(set(dst_table)))
    dst.buffer[:, :, pages] = -7.0
    poisoned = dst.buffer.clone()
    time.sleep(0.5)
    assert not sender.submit(job)  # a stale job of the room is refused, never written
    time.sleep(0.2)
    sender.close()
    t.close()
    assert torch.equal(bits(dst.buffer), bits(poisoned))
    assert t.in_flight() == 0


def test_writes_done_at_post_need_no_progress_thread(link):
    """A WRITE NIXL reports DONE from `transfer` completes its frame on the posting
    thread: the room drains (and Success could go) while the progress thread is stuck."""
    shape = make_shape(num_pages=64)
    src, dst = random_pool(shape, 40), random_pool(shape, 41)
    t = transport(link, src, dst)
    nx = t.agent.agent
    real_transfer, real_check = nx.transfer, nx.check_xfer_state
    gate = threading.Event()

    def finished_transfer(handle):
        state = real_transfer(handle)
        while state == "PROC":  # report DONE only once it is (loopback may lag)
            state = real_check(handle)
        return state

    def stuck_check(handle):
        gate.wait(10)
        return real_check(handle)

    nx.transfer, nx.check_xfer_state = finished_transfer, stuck_check
    job = nixl_job(random_table(16, 64, 42), random_table(16, 64, 43), link, tokens=(0, 60))
    want = expected_pool(
        src, dst, job.src_slots, job.dst_slots, (0, 1, 2), (0, 1, 2), (0, 4), (0, 4)
    )
    completed: list[TransferJob] = []
    sender = KVSender(src, t, SMALL_FRAMES, on_complete=completed.append)
    sender.start()
    assert sender.submit(job)
    link.inbox.wait_for(job.notify)
    assert sender.drain(21, timeout=10)
    assert completed == [job] and t.in_flight() == 0
    assert t.stats["done_at_post"] == t.stats["writes"] > 1
    assert torch.equal(bits(dst.buffer), bits(want))
    gate.set()
    sender.close()
    t.close()


def test_a_notification_waits_for_the_writes_posted_before_it(link):
    shape = make_shape(num_pages=64)
    src, dst = random_pool(shape, 44), random_pool(shape, 45)
    t = transport(link, src, dst)
    done_later(t)
    gate = threading.Event()
    real_check = t.agent.agent.check_xfer_state
    t.agent.agent.check_xfer_state = lambda handle: gate.wait(10) and real_check(handle)
    job = nixl_job(random_table(16, 64, 46), random_table(16, 64, 47), link, tokens=(0, 60))
    want = expected_pool(
        src, dst, job.src_slots, job.dst_slots, (0, 1, 2), (0, 1, 2), (0, 4), (0, 4)
    )
    arrived: list[torch.Tensor] = []
    on_control = link.decode.on_control

    def snapshot(sender: str, data: bytes) -> None:
        if data == job.notify:  # what decode would read when told the pages are there
            arrived.append(dst.buffer.clone())
        on_control(sender, data)

    link.decode.on_control = snapshot
    sender = KVSender(src, t, SMALL_FRAMES)
    sender.start()
    try:
        assert sender.submit(job)
        wait_until(lambda: t.writes.num_held_notes() == 1, what="the notification held back")
        assert job.notify not in [d for _, d in link.inbox.messages]
        gate.set()
        link.inbox.wait_for(job.notify)
        assert sender.drain(21, timeout=10)
    finally:
        gate.set()
        link.decode.on_control = on_control
        sender.close()
        t.close()
    assert len(arrived) == 1 and torch.equal(bits(arrived[0]), bits(want))


def test_a_notification_behind_a_failed_write_is_dropped(link):
    shape = make_shape()
    src, dst = random_pool(shape, 48), random_pool(shape, 49)
    t = transport(link, src, dst)
    done_later(t)
    gate = threading.Event()
    t.agent.agent.check_xfer_state = lambda handle: gate.wait(10) and "ERR"
    failures: list[tuple] = []
    sender = KVSender(src, t, SMALL_FRAMES, on_failure=lambda *a: failures.append(a))
    sender.start()
    job = nixl_job(random_table(8, 32, 50), random_table(8, 32, 51), link)
    assert sender.submit(job)
    wait_until(lambda: t.writes.num_held_notes() == 1, what="the notification held back")
    gate.set()
    assert sender.drain(21, timeout=10)
    wait_until(lambda: not t.writes.num_held_notes(), what="the held notification handled")
    t.notify(link.decode.address, b"after-the-failed-room")  # same connection: a barrier
    link.inbox.wait_for(b"after-the-failed-room")
    sender.close()
    t.close()
    assert job.notify not in [d for _, d in link.inbox.messages]
    assert len(failures) == 1 and failures[0][2].startswith("nixl_write_failed")
