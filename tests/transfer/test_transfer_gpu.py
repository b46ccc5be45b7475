"""Device pools: staging through pinned memory (tcp) and GPU -> shared-memory writes."""

from __future__ import annotations

import pytest
import torch

from pdcluster.runtime.engine.kv_pool import DTYPES, KVPool
from pdcluster.runtime.spec import KVLayout
from pdcluster.runtime.transfer.job import TransferJob
from pdcluster.runtime.transfer.sender import KVSender, SenderConfig
from pdcluster.runtime.transfer.shm import ShmTransport
from pdcluster.runtime.transfer.tcp import KVReceiver, TcpTransport
from tests.transfer.transfer_helpers import (
    Link,
    Rooms,
    bits,
    expected_pool,
    make_shape,
    random_pool,
    random_table,
    send_one_job,
    slots,
    whole_job,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FRAMES = SenderConfig(max_frame_bytes=64 * 1024, min_frame_bytes=16 * 1024)


def cuda_pool(shape, seed: int) -> KVPool:
    pool = KVPool(shape, device="cuda")
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(shape.dims(), generator=gen).to(DTYPES[shape.dtype]))
    return pool


@pytest.mark.parametrize("layout", list(KVLayout))
def test_tcp_between_gpu_pools_is_bit_identical(layout):
    # prefill tp=1 (8 heads) -> this decode rank owns heads 4..8 (decode tp=2).
    src = cuda_pool(make_shape(num_kv_heads=8, dtype="bfloat16", layout=layout), seed=1)
    dst = cuda_pool(make_shape(num_kv_heads=4, dtype="bfloat16", layout=layout), seed=2)
    src_table, dst_table = random_table(8, 32, 3), random_table(8, 32, 4)
    rooms = Rooms()
    rooms.open(5, 0, dst_table)
    link = Link.open()
    try:
        link.decode.on_kv = KVReceiver(dst, rooms).on_kv
        sender = KVSender(src, TcpTransport(link.prefill), FRAMES)
        sender.start()
        job = TransferJob(
            room=5, generation=0, peer=link.decode.address,
            src_slots=slots(src_table, 0, 29, 4), token_start=0, token_end=29,
            src_layers=(0, 1, 2), dst_layers=(0, 1, 2), src_heads=(4, 8), dst_heads=(0, 4),
            notify=b"gpu-tcp",
        )  # fmt: skip
        assert sender.submit(job)
        link.inbox.wait_for(b"gpu-tcp")
        assert sender.drain(5, timeout=10)
        sender.close()
    finally:
        link.close()
    want = src.gather_tokens((0, 1, 2), torch.tensor(job.src_slots, device="cuda"), slice(4, 8))
    got = dst.gather_tokens((0, 1, 2), torch.tensor(slots(dst_table, 0, 29, 4), device="cuda"))
    assert torch.equal(bits(got.cpu()), bits(want.cpu()))


def test_shm_from_a_gpu_pool_into_a_shared_memory_pool(tmp_path):
    shape = make_shape(dtype="float16", layout=KVLayout.HND)
    src = cuda_pool(shape, seed=5)
    dst = KVPool(shape, shm_path=str(tmp_path / "decode.pool"))
    src_table, dst_table = random_table(8, 32, 6), random_table(8, 32, 7)
    link = Link.open()
    try:
        transport = ShmTransport(link.prefill)
        transport.register_peer(link.decode.address, dst.shm_path, shape)
        sender = KVSender(src, transport, FRAMES)
        sender.start()
        job = TransferJob(
            room=6, generation=0, peer=link.decode.address,
            src_slots=slots(src_table, 2, 31, 4), dst_slots=slots(dst_table, 2, 31, 4),
            token_start=2, token_end=31, src_layers=(0, 1, 2), dst_layers=(0, 1, 2),
            src_heads=(0, 4), dst_heads=(0, 4), notify=b"gpu-shm",
        )  # fmt: skip
        assert sender.submit(job)
        link.inbox.wait_for(b"gpu-shm")
        sender.close()
    finally:
        link.close()
    want = src.gather_tokens((0, 1, 2), torch.tensor(job.src_slots, device="cuda")).cpu()
    got = dst.gather_tokens((0, 1, 2), torch.tensor(job.dst_slots))
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("dst_device", ["cuda", "cpu"])
def test_nixl_writes_from_a_gpu_pool_are_bit_identical(link, dst_device):
    # The pools register as VRAM (a cuda pool) or DRAM: prefill tp=1 (8 heads) ->
    # the decode rank of tp=2 that owns heads 4..8.
    from pdcluster.runtime.transfer.nixl import NixlTransport
    from pdcluster.runtime.transfer.nixl_agent import NixlAgent

    src = cuda_pool(make_shape(num_kv_heads=8, dtype="bfloat16"), seed=8)
    dst_shape = make_shape(num_kv_heads=4, dtype="bfloat16")
    dst = cuda_pool(dst_shape, seed=9) if dst_device == "cuda" else random_pool(dst_shape, 9)
    src_table, dst_table = random_table(8, 32, 10), random_table(8, 32, 11)
    job = whole_job(
        src_table, dst_table, link.decode.address, "gpu-nixl", tokens=(1, 29),
        src_heads=(4, 8), dst_heads=(0, 4),
    )  # fmt: skip
    want = expected_pool(
        host_copy(src), host_copy(dst), job.src_slots, job.dst_slots,
        (0, 1, 2), (0, 1, 2), (4, 8), (0, 4),
    )  # fmt: skip
    prefill_agent = NixlAgent(f"gpu-prefill-{dst_device}", src)
    decode_agent = NixlAgent(f"gpu-decode-{dst_device}", dst)
    assert prefill_agent.mem_type == "VRAM"
    assert decode_agent.mem_type == ("VRAM" if dst_device == "cuda" else "DRAM")
    transport = NixlTransport(link.prefill, prefill_agent)
    transport.register_peer(link.decode.address, decode_agent.region(), dst.shape)
    try:
        assert send_one_job(link, src, transport, job, drain_s=10) == [job]
    finally:
        transport.close()
        decode_agent.close()
        prefill_agent.close()
    assert torch.equal(bits(dst.buffer.cpu()), bits(want))
    assert transport.stats["writes"] >= 1 and transport.stats["errors"] == 0


def host_copy(pool: KVPool) -> KVPool:
    copy = KVPool(pool.shape)
    copy.buffer.copy_(pool.buffer.cpu())
    return copy


def test_a_nixl_write_waits_for_kv_the_stream_has_not_written_yet(link):
    # As in a prefill step: the chunk's KV is queued on the stream (here behind
    # ~50 ms of GPU sleep) when its job is submitted. The WRITE must read it
    # written, not what the pool held before.
    from pdcluster.runtime.transfer.nixl import NixlTransport
    from pdcluster.runtime.transfer.nixl_agent import NixlAgent

    shape = make_shape(num_kv_heads=4, dtype="bfloat16")
    src, dst = cuda_pool(shape, seed=12), cuda_pool(shape, seed=13)
    fresh = torch.randn(src.buffer.shape, device="cuda").to(src.buffer.dtype)
    src_table, dst_table = random_table(8, 32, 14), random_table(8, 32, 15)
    job = whole_job(src_table, dst_table, link.decode.address, "gpu-nixl-late", tokens=(0, 30))
    prefill_agent = NixlAgent("gpu-prefill-late", src)
    decode_agent = NixlAgent("gpu-decode-late", dst)
    transport = NixlTransport(link.prefill, prefill_agent)
    transport.register_peer(link.decode.address, decode_agent.region(), dst.shape)
    torch.cuda.synchronize()
    try:
        torch.cuda._sleep(100_000_000)  # about 50 ms of the device's clock
        src.buffer.copy_(fresh)  # the "forward": queued behind the sleep
        assert send_one_job(link, src, transport, job, drain_s=10) == [job]
    finally:
        transport.close()
        decode_agent.close()
        prefill_agent.close()
    torch.cuda.synchronize()
    want = expected_pool(
        host_copy(src), host_copy(dst), job.src_slots, job.dst_slots,
        (0, 1, 2), (0, 1, 2), (0, 4), (0, 4),
    )  # fmt: skip
    assert torch.equal(bits(dst.buffer.cpu()), bits(want))
