"""`transfer.checksum` on a real decode agent: the pages are checked, not the wire.

Each source's Success carries a checksum of the KV it read from its own
pages; decode computes the same over its pages, by the room's page table,
once everything landed. A frame that went into the wrong page passes the
wire CRC but fails the room with `checksum_mismatch`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest
import torch

from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.transfer.checksum import CHECKSUM_MISMATCH, CHECKSUM_MISSING
from tests.faults.decode_rig import HEAD_DIM, HEADS, LAYERS, PAGE_SIZE, DecodeRig

TOKENS = 2 * PAGE_SIZE


@pytest.fixture
def rig() -> Iterator[DecodeRig]:
    opened = DecodeRig(checksum=True)
    yield opened
    opened.close()


def prompt_kv(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((LAYERS, 2, TOKENS, HEADS, HEAD_DIM), generator=gen)  # [L, 2, n, H, D]


def source_checksum(kv: torch.Tensor) -> int:
    """What prefill computes from its pages: token-major CRC-32."""
    data = kv.permute(2, 0, 1, 3, 4).contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(data.numpy().tobytes())


def run_room(rig: DecodeRig, room: int, pages: list[int], checksum: int | None) -> None:
    kv = prompt_kv(room)
    meta = rig.open_room(room, f"rid-{room}", pages, num_tokens=TOKENS)
    rig.send_frame(meta, 0, TOKENS, kv)
    rig.send_status(meta, KVPoll.Success, first_token=1, checksum=checksum)


def test_matching_pages_complete(rig: DecodeRig) -> None:
    run_room(rig, 7101, [4, 6], source_checksum(prompt_kv(7101)))
    rig.wait_report(7101, "complete")
    assert not rig.has_report(7101, "failed")


def test_a_frame_scattered_into_a_wrong_page_fails_the_room(rig: DecodeRig) -> None:
    real = rig.agent._resolve

    def wrong_page(room: int, generation: int) -> tuple[int, ...] | None:
        table = real(room, generation)
        return None if table is None else (table[0], 11)  # the second page misplaced

    rig.agent.receiver.resolve = wrong_page
    run_room(rig, 7102, [4, 6], source_checksum(prompt_kv(7102)))
    _, rep = rig.wait_report(7102, "failed")
    assert rep.reason == CHECKSUM_MISMATCH
    assert not rig.has_report(7102, "complete")
    assert rig.agent.receiver.stats.get(CHECKSUM_MISMATCH, 0) == 0  # the wire was fine
    rig.wait_report(7102, "released")
    assert rig.agent.counts()["room_failed:checksum_mismatch"] == 1


def test_a_source_that_read_a_wrong_page_fails_the_room(rig: DecodeRig) -> None:
    # What prefill sent differs from what its pages held when it hashed them.
    sent_from_wrong_page = prompt_kv(7103)
    sent_from_wrong_page[:, :, PAGE_SIZE:] = prompt_kv(9999)[:, :, PAGE_SIZE:]
    kv = prompt_kv(7103)
    meta = rig.open_room(7103, "rid-7103", [4, 6], num_tokens=TOKENS)
    rig.send_frame(meta, 0, TOKENS, sent_from_wrong_page)
    rig.send_status(meta, KVPoll.Success, first_token=1, checksum=source_checksum(kv))
    _, rep = rig.wait_report(7103, "failed")
    assert rep.reason == CHECKSUM_MISMATCH


def test_success_without_a_checksum_fails_when_checksums_are_on(rig: DecodeRig) -> None:
    run_room(rig, 7104, [4, 6], None)
    _, rep = rig.wait_report(7104, "failed")
    assert rep.reason == CHECKSUM_MISSING
