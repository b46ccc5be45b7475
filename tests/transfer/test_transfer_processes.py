"""A decode rank in another process: tcp frames and shm one-sided writes."""

from __future__ import annotations

import multiprocessing
import time
from queue import Empty
from typing import Any

import pytest
import torch

from pdcluster.runtime.spec import KVLayout
from pdcluster.runtime.transfer.job import TransferJob
from pdcluster.runtime.transfer.sender import KVSender, SenderConfig
from pdcluster.runtime.transfer.shm import ShmTransport
from pdcluster.runtime.transfer.tcp import TcpTransport
from tests.transfer.transfer_helpers import (
    Link,
    bits,
    decode_rank_main,
    make_shape,
    random_pool,
    random_table,
    slots,
)

FRAMES = SenderConfig(max_frame_bytes=4096, min_frame_bytes=1024)
# A spawned child imports torch and the test helpers before it answers: on a
# loaded 2-core machine that alone took over a minute once.
CHILD_TIMEOUT_S = 300


def from_child(queue: Any, proc: Any) -> Any:
    """The child's next message; fails at once (with its exit code) if it died."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1)
        except Empty:
            if not proc.is_alive():
                raise AssertionError(f"decode rank process exited ({proc.exitcode})") from None
    raise AssertionError(f"no message from the decode rank process in {CHILD_TIMEOUT_S} s")


@pytest.mark.slow
def test_a_decode_rank_in_another_process_receives_over_tcp_and_shm(tmp_path):
    shape = make_shape(num_pages=64, page_size=4, dtype="bfloat16", layout=KVLayout.HND)
    src = random_pool(shape, seed=70)
    src_table = random_table(16, 64, seed=71)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(72)).tolist()
    tables = {b"tcp-done": order[:16], b"shm-done": order[16:32]}  # disjoint pages
    shm_path = str(tmp_path / "decode.pool")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=decode_rank_main, args=(shape, shm_path, tables, queue))
    proc.start()
    link = Link.open()
    received: dict[bytes, bytes] = {}
    try:
        address = from_child(queue, proc)
        jobs = {
            name: TransferJob(
                room=1 if name == b"tcp-done" else 2,
                generation=0,
                peer=address,
                src_slots=slots(src_table, 0, 64, 4),
                dst_slots=None if name == b"tcp-done" else slots(table, 0, 64, 4),
                token_start=0,
                token_end=64,
                src_layers=(0, 1, 2),
                dst_layers=(0, 1, 2),
                src_heads=(0, 4),
                dst_heads=(0, 4),
                notify=name,
            )
            for name, table in tables.items()
        }
        shm = ShmTransport(link.prefill)
        shm.register_peer(address, shm_path, shape)
        senders = [
            KVSender(src, TcpTransport(link.prefill), FRAMES),
            KVSender(src, shm, FRAMES),
        ]
        for sender, name in zip(senders, jobs, strict=True):
            sender.start()
            assert sender.submit(jobs[name])
        for _ in jobs:
            name, data = from_child(queue, proc)
            received[name] = data
        for sender in senders:
            sender.close()
    finally:
        link.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    want = bits(src.gather_tokens((0, 1, 2), torch.tensor(slots(src_table, 0, 64, 4))))
    assert received == {name: want.numpy().tobytes() for name in jobs}
    assert proc.exitcode == 0
