"""Success from every source, but KV bytes missing: the room fails, loudly.

Over tcp every source sends Success after its frames on one connection, so
they were all placed when it arrives — unless the connection dropped and
came back in between (libzmq then loses messages without a word). Decode
counts the bytes it placed and fails the room with `incomplete_transfer`
rather than decode from pages nobody wrote. Real agent, real sockets.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdcluster.runtime.pd.kvpoll import KVPoll
from tests.faults.decode_rig import HEAD_DIM, HEADS, LAYERS, PAGE_SIZE, DecodeRig

TOKENS = 2 * PAGE_SIZE
FULL_BYTES = TOKENS * LAYERS * 2 * HEADS * HEAD_DIM * 4  # float32


@pytest.fixture
def rig() -> Iterator[DecodeRig]:
    opened = DecodeRig()
    yield opened
    opened.close()


def test_every_byte_placed_completes(rig: DecodeRig) -> None:
    meta = rig.open_room(5201, "rid-whole", [2, 5], num_tokens=TOKENS)
    rig.send_frame(meta, 0, PAGE_SIZE, 1.0)
    rig.send_frame(meta, PAGE_SIZE, TOKENS, 2.0)
    rig.send_status(meta, KVPoll.Success, first_token=3)
    _, rep = rig.wait_report(5201, "complete")
    assert rep.first_token == 3
    assert not rig.has_report(5201, "failed")


def test_a_lost_frame_fails_the_room_with_the_byte_count(rig: DecodeRig) -> None:
    meta = rig.open_room(5202, "rid-holey", [2, 5], num_tokens=TOKENS)
    rig.send_frame(meta, 0, PAGE_SIZE, 1.0)  # the second frame is lost on the way
    rig.send_status(meta, KVPoll.Success, first_token=3)
    _, rep = rig.wait_report(5202, "failed")
    assert rep.reason == f"incomplete_transfer: received {FULL_BYTES // 2} of {FULL_BYTES} KV bytes"
    assert not rig.has_report(5202, "complete")
    rig.wait_report(5202, "released")
    assert rig.agent.counts()["room_failed:incomplete_transfer"] == 1
