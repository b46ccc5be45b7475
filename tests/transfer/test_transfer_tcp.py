"""The tcp transport end to end: KVSender -> ZMQ on 127.0.0.1 -> KVReceiver -> pool."""

from __future__ import annotations

import itertools
import threading

import msgspec
import pytest
import torch

from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.spec import KVLayout
from pdcluster.runtime.transfer.endpoint import Endpoint
from pdcluster.runtime.transfer.frames import KVFrameHeader, encode_header
from pdcluster.runtime.transfer.job import TransferJob
from pdcluster.runtime.transfer.sender import KVSender, SenderConfig, plan_job_frames
from pdcluster.runtime.transfer.tcp import KVReceiver, TcpTransport
from tests.transfer.transfer_helpers import (
    SMALL_FRAMES,
    Link,
    Rooms,
    bits,
    expected_pool,
    frame_header,
    make_shape,
    next_id,
    random_pool,
    random_table,
    slots,
    whole_job,
)


def make_job(src_table, *, peer: str, room: int = 11, **kw) -> TransferJob:
    """A job over every layer and head of the test shape unless `kw` narrows them."""
    return whole_job(src_table, None, peer, "tcp", room=room, **kw)


def run_jobs(
    link: Link,
    src: KVPool,
    jobs: list[TransferJob],
    config: SenderConfig = SMALL_FRAMES,
    transport: TcpTransport | None = None,
) -> list[tuple[int, int, str]]:
    """Send every job, wait until each job's completion message arrived."""
    failures: list[tuple[int, int, str]] = []
    sender = KVSender(
        src,
        transport or TcpTransport(link.prefill),
        config,
        on_failure=lambda *args: failures.append(args),
    )
    sender.start()
    try:
        for job in jobs:
            assert sender.submit(job)
        for job in jobs:
            assert job.notify is not None
            link.inbox.wait_for(job.notify)
            assert sender.drain(job.room, timeout=5)
    finally:
        sender.close()
    return failures


def receiver_for(link: Link, dst: KVPool, rooms: Rooms, **kw) -> KVReceiver:
    receiver = KVReceiver(dst, rooms, **kw)
    link.decode.on_kv = receiver.on_kv
    return receiver


# ---- bit-identical round trips ------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("layouts", list(itertools.product(KVLayout, KVLayout)))
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_round_trip_is_bit_identical(link, dtype, layouts, page_size):
    src_shape = make_shape(num_pages=64, page_size=page_size, dtype=dtype, layout=layouts[0])
    dst_shape = make_shape(num_pages=64, page_size=page_size, dtype=dtype, layout=layouts[1])
    src, dst = random_pool(src_shape, seed=1), random_pool(dst_shape, seed=2)
    needed = -(-42 // page_size)
    src_table = random_table(needed, 64, seed=page_size)
    dst_table = random_table(needed, 64, seed=page_size + 100)
    rooms = Rooms()
    rooms.open(11, 0, dst_table)
    receiver = receiver_for(link, dst, rooms)
    # A chunk that starts and ends mid-page, over all layers and heads.
    job = make_job(src_table, page_size=page_size, tokens=(5, 42), peer=link.decode.address)
    want = expected_pool(
        src,
        dst,
        job.src_slots,
        slots(dst_table, 5, 42, page_size),
        (0, 1, 2),
        (0, 1, 2),
        (0, 4),
        (0, 4),
    )
    assert run_jobs(link, src, [job]) == []
    assert torch.equal(bits(dst.buffer), bits(want))
    progress = receiver.progress(11, 0)
    bytes_per_token = 3 * 2 * 4 * 8 * src.buffer.element_size()
    assert progress is not None
    assert progress.num_tokens == 37
    assert progress.nbytes == 37 * bytes_per_token
    assert progress.num_frames == len(plan_job_frames(job, src.shape, SMALL_FRAMES))
    assert progress.last_from == frozenset({0})


@pytest.mark.parametrize("layout", list(KVLayout))
def test_tp_split_sends_each_decode_rank_its_head_slice(link, layout):
    # prefill tp=1 holds 8 heads; decode tp=2 ranks hold 4 each.
    src = random_pool(make_shape(num_kv_heads=8, layout=layout), seed=3)
    dst_pools = [random_pool(make_shape(num_kv_heads=4, layout=layout), seed=4 + r) for r in (0, 1)]
    src_table = random_table(6, 32, seed=5)
    dst_tables = [random_table(6, 32, seed=6 + r) for r in (0, 1)]
    endpoints, wants, jobs = [], [], []
    try:
        for rank, dst in enumerate(dst_pools):
            rooms = Rooms()
            rooms.open(11, 0, dst_tables[rank])
            ep = Endpoint(on_kv=KVReceiver(dst, rooms).on_kv, on_control=link.inbox)
            ep.start()
            endpoints.append(ep)
            heads = (4 * rank, 4 * rank + 4)
            job = make_job(
                src_table,
                page_size=4,
                tokens=(0, 23),
                peer=ep.address,
                src_layers=(0, 1, 2),
                dst_layers=(0, 1, 2),
                src_heads=heads,
                dst_heads=(0, 4),
            )
            jobs.append(job)
            wants.append(
                expected_pool(
                    src, dst, job.src_slots, slots(dst_tables[rank], 0, 23, 4),
                    (0, 1, 2), (0, 1, 2), heads, (0, 4),
                )
            )  # fmt: skip
        assert run_jobs(link, src, jobs) == []
    finally:
        for ep in endpoints:
            ep.close()
    for dst, want in zip(dst_pools, wants, strict=True):
        assert torch.equal(bits(dst.buffer), bits(want))


@pytest.mark.parametrize("layout", list(KVLayout))
def test_tp_merge_fills_one_decode_rank_from_two_prefill_ranks(link, layout):
    # prefill tp=2 ranks hold 4 heads each; decode tp=1 holds all 8.
    srcs = [random_pool(make_shape(num_kv_heads=4, layout=layout), seed=10 + r) for r in (0, 1)]
    dst = random_pool(make_shape(num_kv_heads=8, layout=layout), seed=12)
    src_tables = [random_table(5, 32, seed=13 + r) for r in (0, 1)]
    dst_table = random_table(5, 32, seed=15)
    dst_slots = slots(dst_table, 0, 20, 4)
    rooms = Rooms()
    rooms.open(11, 3, dst_table)
    receiver = receiver_for(link, dst, rooms)
    want = dst.buffer
    for rank in (0, 1):
        job = make_job(
            src_tables[rank],
            page_size=4,
            tokens=(0, 20),
            generation=3,
            peer=link.decode.address,
            src_layers=(0, 1, 2),
            dst_layers=(0, 1, 2),
            src_heads=(0, 4),
            dst_heads=(4 * rank, 4 * rank + 4),
        )
        ref = KVPool(dst.shape)
        ref.buffer.copy_(want)
        want = expected_pool(
            srcs[rank], ref, job.src_slots, dst_slots,
            (0, 1, 2), (0, 1, 2), (0, 4), (4 * rank, 4 * rank + 4),
        )  # fmt: skip
        config = SenderConfig(src_rank=rank, max_frame_bytes=2048, min_frame_bytes=512)
        assert run_jobs(link, srcs[rank], [job], config) == []
    assert torch.equal(bits(dst.buffer), bits(want))
    progress = receiver.progress(11, 3)
    assert progress is not None and progress.last_from == frozenset({0, 1})


@pytest.mark.parametrize("layout", list(KVLayout))
def test_pp_stage_and_layer_by_layer_streaming_land_in_the_right_layers(link, layout):
    # prefill pp=2, this is stage 1 (global layers 2..3); decode pp=1 holds 4 layers.
    src = random_pool(make_shape(num_layers=2, layout=layout), seed=20)
    dst = random_pool(make_shape(num_layers=4, layout=layout), seed=21)
    src_table, dst_table = random_table(4, 32, seed=22), random_table(4, 32, seed=23)
    rooms = Rooms()
    rooms.open(11, 0, dst_table)
    receiver_for(link, dst, rooms)
    jobs = [
        make_job(
            src_table,
            page_size=4,
            tokens=(0, 16),
            peer=link.decode.address,
            src_layers=(layer,),
            dst_layers=(layer + 2,),
            src_heads=(0, 4),
            dst_heads=(0, 4),
            is_last=layer == 1,
        )
        for layer in (0, 1)
    ]
    want = expected_pool(
        src, dst, jobs[0].src_slots, slots(dst_table, 0, 16, 4), (0, 1), (2, 3), (0, 4), (0, 4)
    )
    assert run_jobs(link, src, jobs) == []
    assert torch.equal(bits(dst.buffer), bits(want))


# ---- frames that must never be written ----------------------------------------


def _simple_case(link, seed=30, **job_kw):
    src = random_pool(make_shape(), seed=seed)
    dst = random_pool(make_shape(), seed=seed + 1)
    src_table, dst_table = random_table(8, 32, seed=seed + 2), random_table(8, 32, seed=seed + 3)
    base = dict(page_size=4, tokens=(0, 30), peer=link.decode.address)
    base.update(job_kw)
    return src, dst, dst_table, make_job(src_table, **base)


def test_frames_for_a_cleared_room_are_dropped_and_never_written(link):
    src, dst, dst_table, job = _simple_case(link)
    rooms = Rooms()  # room 11 was never opened, or already cleared
    before = dst.buffer.clone()
    receiver = receiver_for(link, dst, rooms)
    assert run_jobs(link, src, [job]) == []
    assert torch.equal(bits(dst.buffer), bits(before))
    num_frames = len(plan_job_frames(job, src.shape, SMALL_FRAMES))
    assert receiver.stats == {"room_not_receiving": num_frames}
    assert receiver.progress(11, 0) is None


def test_frames_of_an_old_generation_never_touch_the_new_request(link):
    src, dst, dst_table, old_job = _simple_case(link, generation=1)
    rooms = Rooms()
    rooms.open(11, 2, dst_table)  # the room was retried: generation 2 owns the pages now
    before = dst.buffer.clone()
    receiver = receiver_for(link, dst, rooms)
    run_jobs(link, src, [old_job])
    assert torch.equal(bits(dst.buffer), bits(before))
    assert receiver.stats["room_not_receiving"] > 0
    new_job = TransferJob(**{**old_job.__dict__, "generation": 2, "notify": b"new-gen"})
    run_jobs(link, src, [new_job])
    assert receiver.progress(11, 2) is not None and receiver.progress(11, 1) is None
    assert not torch.equal(bits(dst.buffer), bits(before))


def test_a_room_cleared_mid_transfer_receives_no_later_frame(link):
    src, dst, dst_table, job = _simple_case(link)
    rooms = Rooms()
    rooms.open(11, 0, dst_table)
    before = dst.buffer.clone()
    # The control plane fails the room after the first frame landed.
    receiver = KVReceiver(dst, rooms, on_progress=lambda room, gen, p: rooms.clear(room))
    link.decode.on_kv = receiver.on_kv
    run_jobs(link, src, [job])
    first_end = plan_job_frames(job, src.shape, SMALL_FRAMES)[0][1]
    dst_slots = slots(dst_table, 0, 30, 4)
    before_pool = KVPool(dst.shape)
    before_pool.buffer.copy_(before)
    want = expected_pool(
        src, before_pool, job.src_slots[:first_end], dst_slots[:first_end],
        (0, 1, 2), (0, 1, 2), (0, 4), (0, 4),
    )  # fmt: skip
    assert torch.equal(bits(dst.buffer), bits(want))  # the first frame only
    assert receiver.stats["accepted"] == 1
    num_frames = len(plan_job_frames(job, src.shape, SMALL_FRAMES))
    assert receiver.stats["room_not_receiving"] == num_frames - 1


def test_quiesce_waits_for_a_write_already_past_resolve(link):
    src, dst, dst_table, job = _simple_case(link, tokens=(0, 4))
    entered, release = threading.Event(), threading.Event()
    rooms = Rooms()
    rooms.open(11, 0, dst_table)

    def slow_resolve(room: int, generation: int):
        table = rooms(room, generation)
        entered.set()
        release.wait(10)  # the write is between resolve and scatter
        return table

    receiver = receiver_for(link, dst, slow_resolve)  # type: ignore[arg-type]
    sender = KVSender(src, TcpTransport(link.prefill), SMALL_FRAMES)
    sender.start()
    sender.submit(job)
    assert entered.wait(5)
    rooms.clear(11)  # the control plane retires the room...
    assert not receiver.quiesce(11, timeout=0.1)  # ...but must wait for the write in flight
    assert receiver.quiesce(12, timeout=0.1)  # other rooms are not held up
    release.set()
    assert receiver.quiesce(11, timeout=5)
    link.inbox.wait_for(job.notify)
    sender.close()


# ---- checksums and malformed frames -----------------------------------------


class CorruptingTransport(TcpTransport):
    """Flips one byte of every frame after the checksum was computed."""

    def send_frame(self, job, header, payload, on_done):
        payload.view(-1)[0] += 1
        super().send_frame(job, header, payload, on_done)


def test_checksummed_frames_are_accepted(link):
    src, dst, dst_table, job = _simple_case(link, seed=40)
    rooms = Rooms()
    rooms.open(11, 0, dst_table)
    receiver = receiver_for(link, dst, rooms, require_checksum=True)
    config = SenderConfig(checksum=True, max_frame_bytes=2048, min_frame_bytes=512)
    assert run_jobs(link, src, [job], config) == []
    assert set(receiver.stats) == {"accepted"}


def test_a_corrupted_frame_fails_the_room_with_checksum_mismatch(link):
    src, dst, dst_table, job = _simple_case(link, seed=41)
    rooms = Rooms()
    rooms.open(11, 0, dst_table)
    failures: list[tuple[int, int, str]] = []
    receiver = receiver_for(link, dst, rooms, on_failure=lambda *a: failures.append(a))
    before = dst.buffer.clone()
    config = SenderConfig(checksum=True, max_frame_bytes=2048, min_frame_bytes=512)
    run_jobs(link, src, [job], config, CorruptingTransport(link.prefill))
    assert torch.equal(bits(dst.buffer), bits(before))
    assert failures and set(failures) == {(11, 0, "checksum_mismatch")}
    assert receiver.stats["checksum_mismatch"] == len(failures)


def test_a_missing_checksum_is_refused_when_required(link):
    src, dst, dst_table, job = _simple_case(link, seed=42)
    rooms = Rooms()
    rooms.open(11, 0, dst_table)
    failures: list[tuple[int, int, str]] = []
    receiver_for(link, dst, rooms, require_checksum=True, on_failure=lambda *a: failures.append(a))
    before = dst.buffer.clone()
    run_jobs(link, src, [job])
    assert torch.equal(bits(dst.buffer), bits(before))
    assert failures and failures[0] == (11, 0, "checksum_missing")


def _raw_frame(link, header: KVFrameHeader, nbytes: int) -> None:
    link.prefill.send_kv(link.decode.address, encode_header(header), bytes(nbytes))
    marker = b"raw-%d" % next_id()  # same connection, so it arrives after the frame
    link.prefill.send_control(link.decode.address, marker)
    link.inbox.wait_for(marker)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"token_start": 28, "token_end": 40, "shape": (3, 2, 12, 4, 8)}, "out_of_bounds"),
        ({"shape": (3, 2, 4, 4, 4)}, "bad_shape"),
        ({"layers": (0, 1, 5)}, "bad_layers"),
        ({"dtype": "float16"}, "dtype_mismatch"),
    ],
)
def test_a_malformed_frame_for_a_live_room_fails_it_without_writing(link, change, reason):
    dst = random_pool(make_shape(), seed=50)
    rooms = Rooms()
    rooms.open(11, 0, random_table(8, 32, seed=51))  # 32 tokens of capacity
    failures: list[tuple[int, int, str]] = []
    receiver = receiver_for(link, dst, rooms, on_failure=lambda *a: failures.append(a))
    before = dst.buffer.clone()
    header = msgspec.structs.replace(
        frame_header(11, 0, layers=(0, 1, 2), tokens=(0, 4), heads=(0, 4), head_dim=8), **change
    )
    nbytes = 4
    for dim in header.shape:
        nbytes *= dim
    _raw_frame(link, header, nbytes)
    assert torch.equal(bits(dst.buffer), bits(before))
    assert receiver.stats == {reason: 1}
    assert len(failures) == 1 and failures[0][:2] == (11, 0) and reason in failures[0][2]


def test_garbage_headers_are_counted_and_the_receiver_keeps_working(link):
    src, dst, dst_table, job = _simple_case(link, seed=60)
    rooms = Rooms()
    rooms.open(11, 0, dst_table)
    receiver = receiver_for(link, dst, rooms)
    for junk in (b"", b"\xc1", b"\x93\x01\x02\x03", b"\xff" * 100):
        link.prefill.send_kv(link.decode.address, junk, b"\x00" * 64)
    run_jobs(link, src, [job])
    assert receiver.stats["bad_header"] == 4
    assert receiver.stats["accepted"] > 0
