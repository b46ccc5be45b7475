"""KVSender behaviour that does not depend on the transport: input checks,
failures, shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from pdcluster.runtime.ports import free_port
from pdcluster.runtime.transfer.endpoint import Endpoint
from pdcluster.runtime.transfer.job import TransferJob
from pdcluster.runtime.transfer.sender import KVSender, SenderConfig
from pdcluster.runtime.transfer.tcp import TcpTransport
from tests.transfer.transfer_helpers import Link, make_shape, random_pool, random_table, slots

# Frames of 256 KiB: above libzmq's copy threshold, so they are sent zero-copy
# and their staging buffers stay busy until libzmq lets go of them.
BIG = make_shape(num_layers=2, num_pages=64, page_size=16, num_kv_heads=8, head_dim=128)
BIG_FRAMES = SenderConfig(max_frame_bytes=256 * 1024, min_frame_bytes=64 * 1024)


def dead_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def big_job(peer: str, room: int, notify: bytes | None = None) -> TransferJob:
    table = random_table(32, 64, seed=room)
    return TransferJob(
        room=room,
        generation=1,
        peer=peer,
        src_slots=slots(table, 0, 512, 16),  # 512 tokens x 16 KiB = 8 MiB, 32 frames
        token_start=0,
        token_end=512,
        src_layers=(0, 1),
        dst_layers=(0, 1),
        src_heads=(0, 8),
        dst_heads=(0, 8),
        notify=notify,
    )


class Recorder:
    def __init__(self) -> None:
        self.failures: list[tuple[int, int, str]] = []
        self.completed: list[int] = []
        self.event = threading.Event()

    def on_failure(self, room: int, generation: int, reason: str) -> None:
        self.failures.append((room, generation, reason))
        self.event.set()

    def on_complete(self, job: TransferJob) -> None:
        self.completed.append(job.room)
        self.event.set()


@pytest.fixture
def endpoint():
    ep = Endpoint()
    ep.start()
    yield ep
    ep.close()


def make_sender(endpoint, rec: Recorder, config: SenderConfig = BIG_FRAMES) -> KVSender:
    sender = KVSender(
        random_pool(BIG, seed=1),
        TcpTransport(endpoint),
        config,
        on_failure=rec.on_failure,
        on_complete=rec.on_complete,
    )
    sender.start()
    return sender


def test_a_bad_job_is_refused_and_leaves_nothing_queued(endpoint):
    rec = Recorder()
    sender = make_sender(endpoint, rec)
    job = big_job(dead_address(), room=1)
    for bad in (
        TransferJob(**{**job.__dict__, "src_slots": job.src_slots[:-1]}),
        TransferJob(**{**job.__dict__, "dst_slots": job.src_slots}),  # tcp places on receipt
        TransferJob(**{**job.__dict__, "src_layers": (0, 2)}),
    ):
        with pytest.raises(ValueError):
            sender.submit(bad)
    assert sender.in_flight(1) == 0
    sender.close()
    assert rec.failures == [] and rec.completed == []


def test_submit_outside_the_running_state_is_an_error(endpoint):
    sender = KVSender(random_pool(BIG, seed=1), TcpTransport(endpoint), BIG_FRAMES)
    with pytest.raises(RuntimeError, match="new"):
        sender.submit(big_job(dead_address(), room=1))
    sender.start()
    with pytest.raises(RuntimeError, match="already"):
        sender.start()
    sender.close()
    with pytest.raises(RuntimeError, match="clos"):
        sender.submit(big_job(dead_address(), room=1))


def test_bad_frame_limits_are_refused_up_front(endpoint):
    with pytest.raises(ValueError, match="min_frame_bytes"):
        KVSender(
            random_pool(BIG, seed=1),
            TcpTransport(endpoint),
            SenderConfig(max_frame_bytes=1024, min_frame_bytes=4096),
        )


def test_close_never_hangs_on_a_peer_that_does_not_read(endpoint):
    rec = Recorder()
    sender = make_sender(
        endpoint,
        rec,
        SenderConfig(max_frame_bytes=256 * 1024, min_frame_bytes=65536, staging_buffers=1),
    )
    peer = dead_address()
    for room in (1, 2, 3):
        assert sender.submit(big_job(peer, room))
    time.sleep(0.2)  # the worker is now waiting for a staging buffer that never returns
    started = time.monotonic()
    sender.close(timeout=5)
    assert time.monotonic() - started < 2
    assert sorted(rec.failures) == [(r, 1, "sender_closed") for r in (1, 2, 3)]
    # Room 1's frame that waited for the peer is withdrawn, so the room drains.
    assert sender.drain(1, timeout=5)
    assert [sender.in_flight(r) for r in (1, 2, 3)] == [0, 0, 0]
    assert endpoint.stats["send_discarded"] >= 1


def test_a_peer_that_stops_reading_fails_the_room_with_staging_timeout(endpoint):
    rec = Recorder()
    config = SenderConfig(
        max_frame_bytes=256 * 1024, min_frame_bytes=65536, staging_buffers=2, staging_timeout=0.2
    )
    sender = make_sender(endpoint, rec, config)
    peer = dead_address()
    assert sender.submit(big_job(peer, room=5))
    assert rec.event.wait(5)
    assert rec.failures == [(5, 1, "staging_timeout")]
    assert not sender.submit(big_job(peer, room=5))  # the room is closed now
    endpoint.drop_peer(peer)  # frees the buffers libzmq held
    assert sender.drain(5, timeout=5)
    sender.close()


def test_dropping_the_peer_fails_its_rooms_with_peer_dropped(endpoint):
    rec = Recorder()
    sender = make_sender(
        endpoint, rec, SenderConfig(max_frame_bytes=256 * 1024, min_frame_bytes=65536)
    )
    peer = dead_address()
    assert sender.submit(big_job(peer, room=7))
    time.sleep(0.2)
    endpoint.drop_peer(peer)  # the control plane declared the peer dead
    assert sender.drain(7, timeout=5)
    assert rec.failures == [(7, 1, "peer_dropped")]
    sender.close()


def test_each_job_completes_once_and_callback_errors_do_not_stop_the_worker():
    link = Link.open()
    try:
        calls: list[int] = []

        def flaky(job: TransferJob) -> None:
            calls.append(job.room)
            if job.room == 1:
                raise RuntimeError("control-plane bug")

        sender = KVSender(
            random_pool(BIG, seed=1), TcpTransport(link.prefill), BIG_FRAMES, on_complete=flaky
        )
        sender.start()
        for room in (1, 2):
            sender.submit(big_job(link.decode.address, room, notify=b"n%d" % room))
        for room in (1, 2):
            link.inbox.wait_for(b"n%d" % room)
            assert sender.drain(room, timeout=5)
        sender.close()
        assert calls == [1, 2]
    finally:
        link.close()


def test_drain_of_an_unknown_room_returns_at_once(endpoint):
    sender = make_sender(endpoint, Recorder())
    started = time.monotonic()
    assert sender.drain(12345, timeout=5)
    assert time.monotonic() - started < 0.5
    sender.close()


def test_timing_counts_completed_jobs_bytes_and_the_time_they_were_moving():
    link = Link.open()
    try:
        sender = KVSender(random_pool(BIG, seed=1), TcpTransport(link.prefill), BIG_FRAMES)
        sender.start()
        assert sender.timing() == {"sent_jobs": 0, "sent_bytes": 0, "busy_us": 0}
        started = time.monotonic()
        for room in (1, 2):
            sender.submit(big_job(link.decode.address, room, notify=b"n%d" % room))
        for room in (1, 2):
            link.inbox.wait_for(b"n%d" % room)
            assert sender.drain(room, timeout=5)
        elapsed_us = (time.monotonic() - started) * 1e6
        timing = sender.timing()
        assert timing["sent_jobs"] == 2
        assert timing["sent_bytes"] == 2 * 512 * 16 * 1024  # 512 tokens of 16 KiB each
        # Overlapping jobs count once: never more than the wall time they spanned.
        assert 0 < timing["busy_us"] <= elapsed_us
        sender.close()
    finally:
        link.close()


def test_a_failed_job_adds_time_but_no_bytes(endpoint):
    rec = Recorder()
    sender = make_sender(endpoint, rec)
    peer = dead_address()
    assert sender.submit(big_job(peer, room=7))
    time.sleep(0.2)
    endpoint.drop_peer(peer)
    assert sender.drain(7, timeout=5)
    assert rec.failures == [(7, 1, "peer_dropped")]
    timing = sender.timing()
    assert timing["sent_jobs"] == 0 and timing["sent_bytes"] == 0
    assert timing["busy_us"] > 0  # the job was moving until its room failed
    sender.close()
