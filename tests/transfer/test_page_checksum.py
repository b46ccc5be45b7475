"""Page checksums catch a wrong page on either side, over tcp and shm.

The per-frame wire CRC passes in every case below: the bytes that travelled
are the bytes the sender gathered. Only a checksum computed from the source
pages (by the request's page table) and checked on the destination pages
(by the room's page table) sees that prefill read the wrong page or decode
wrote into the wrong one. Real sender, receiver, endpoints and shm pools.
"""

from __future__ import annotations

import pytest

from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.spec import KVLayout
from pdcluster.runtime.transfer.page_checksum import compute_kv_checksum, token_slots
from pdcluster.runtime.transfer.sender import KVSender, SenderConfig
from pdcluster.runtime.transfer.shm import ShmTransport
from pdcluster.runtime.transfer.tcp import KVReceiver, TcpTransport
from tests.transfer.transfer_helpers import (
    Link,
    Rooms,
    make_shape,
    next_id,
    random_pool,
    random_table,
    whole_job,
)

PAGE = 4
TOKENS = (0, 22)
# Every layer and head of the test shape: what `whole_job` moves.
LAYERS = (0, 1, 2)
HEADS = (0, 4)
FRAMES = SenderConfig(max_frame_bytes=2048, min_frame_bytes=512, checksum=True)


def transfer(
    link: Link,
    backend: str,
    src: KVPool,
    dst: KVPool,
    read_table: list[int],
    write_table: list[int],
) -> list[tuple[int, int, str]]:
    """Move TOKENS reading source pages `read_table`, writing destination pages
    `write_table` (what each side's transfer path was told)."""
    failures: list[tuple[int, int, str]] = []
    dst_table = write_table if backend == "shm" else None  # tcp places frames on receipt
    job = whole_job(
        read_table,
        dst_table,
        link.decode.address,
        "pc",
        page_size=PAGE,
        tokens=TOKENS,
        room=300 + next_id(),
    )
    if backend == "tcp":
        rooms = Rooms()
        rooms.open(job.room, 0, write_table)
        receiver = KVReceiver(
            dst, rooms, on_failure=lambda *a: failures.append(a), require_checksum=True
        )
        link.decode.on_kv = receiver.on_kv
        transport: TcpTransport | ShmTransport = TcpTransport(link.prefill)
    else:
        shm = ShmTransport(link.prefill)
        assert dst.shm_path is not None
        shm.register_peer(link.decode.address, dst.shm_path, dst.shape)
        transport = shm
    sender = KVSender(src, transport, FRAMES, on_failure=lambda *a: failures.append(a))
    sender.start()
    try:
        assert sender.submit(job)
        link.inbox.wait_for(job.notify)
        assert sender.drain(job.room, timeout=5)
    finally:
        sender.close()
    return failures


def checksums(
    src: KVPool, dst: KVPool, src_table: list[int], dst_table: list[int]
) -> tuple[int, int]:
    """(prefill's, decode's): each side over its own pages, by the request's table."""
    at_source = compute_kv_checksum(src, LAYERS, token_slots(src_table, *TOKENS, PAGE), HEADS)
    at_dest = compute_kv_checksum(dst, LAYERS, token_slots(dst_table, *TOKENS, PAGE), HEADS)
    return at_source, at_dest


def pools(tmp_path, backend: str, src_layout: KVLayout, dst_layout: KVLayout):  # type: ignore[no-untyped-def]
    src = random_pool(make_shape(num_pages=32, page_size=PAGE, layout=src_layout), seed=1)
    shm_path = str(tmp_path / f"pc-{next_id()}.pool") if backend == "shm" else None
    dst = random_pool(make_shape(num_pages=32, page_size=PAGE, layout=dst_layout), 2, shm_path)
    needed = -(-TOKENS[1] // PAGE)
    return src, dst, random_table(needed, 32, seed=3), random_table(needed, 32, seed=4)


def one_page_wrong(table: list[int]) -> list[int]:
    """The same table with its second entry pointing at a page outside it."""
    spare = next(p for p in range(32) if p not in table)
    return [table[0], spare, *table[2:]]


BACKENDS = ["tcp", "shm"]
LAYOUTS = [(KVLayout.NHD, KVLayout.NHD), (KVLayout.NHD, KVLayout.HND)]


@pytest.mark.parametrize("layouts", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_correct_transfer_matches(link, tmp_path, backend, layouts) -> None:  # type: ignore[no-untyped-def]
    src, dst, src_table, dst_table = pools(tmp_path, backend, *layouts)
    assert transfer(link, backend, src, dst, src_table, dst_table) == []
    at_source, at_dest = checksums(src, dst, src_table, dst_table)
    assert at_source == at_dest


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_reading_a_wrong_source_page_is_caught(link, tmp_path, backend) -> None:  # type: ignore[no-untyped-def]
    src, dst, src_table, dst_table = pools(tmp_path, backend, KVLayout.NHD, KVLayout.NHD)
    failures = transfer(link, backend, src, dst, one_page_wrong(src_table), dst_table)
    assert failures == []  # the wire checksum saw nothing wrong
    at_source, at_dest = checksums(src, dst, src_table, dst_table)
    assert at_source != at_dest


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_writing_a_wrong_destination_page_is_caught(link, tmp_path, backend) -> None:  # type: ignore[no-untyped-def]
    src, dst, src_table, dst_table = pools(tmp_path, backend, KVLayout.NHD, KVLayout.NHD)
    failures = transfer(link, backend, src, dst, src_table, one_page_wrong(dst_table))
    assert failures == []
    at_source, at_dest = checksums(src, dst, src_table, dst_table)
    assert at_source != at_dest


def test_the_checksum_runs_on_chunk_by_chunk() -> None:
    pool = random_pool(make_shape(num_pages=32, page_size=PAGE), seed=5)
    table = random_table(6, 32, seed=6)
    whole = compute_kv_checksum(pool, LAYERS, token_slots(table, 0, 22, PAGE), HEADS)
    crc = 0
    for a, b in [(0, 5), (5, 16), (16, 22)]:
        crc = compute_kv_checksum(pool, LAYERS, token_slots(table, a, b, PAGE), HEADS, crc)
    assert crc == whole
    assert compute_kv_checksum(pool, LAYERS, [], HEADS, crc) == crc
