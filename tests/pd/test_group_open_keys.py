"""A prefill room's opening reaches every rank of its group, whatever the prompt's
length up to the longest a room can hold.

`GroupOpen` carries the prompt's page keys (each rank checks decode's reused
pages against them, `prefix_reuse`). A message over `MAX_GROUP_BYTES` is
dropped by every follower, so a long prompt's room used to wait out its
deadline on every follower (58k pages and up). The keys now travel in the
open and, past what one message holds, in `GroupPageKeys` chunks after it;
a follower opens the room once it holds them all.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.pd.messages import MAX_PAGES_PER_ROOM
from pdcluster.runtime.pd.prompt_digest import prompt_id
from pdcluster.runtime.pd_worker.group import (
    MAX_GROUP_BYTES,
    PAGE_KEYS_PER_MESSAGE,
    GroupOpen,
    GroupPageKeys,
    GroupProtocolError,
    OpenAssembly,
    decode_group,
    encode_group,
    wire_messages,
)
from pdcluster.runtime.prefix_keys import KEY_BYTES


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(KEY_BYTES, "little") for i in range(n)]


def opening(num_pages: int, room: int = 7) -> GroupOpen:
    """A room of `num_pages` full pages (page size 1) and a last, partial token."""
    prompt = list(range(num_pages + 1))
    return GroupOpen(
        room, "rid-7", len(prompt), prompt=prompt_id(prompt), page_keys=keys(num_pages)
    )


def deliver(frames: list[bytes], assembly: OpenAssembly) -> list[GroupOpen]:
    """What a follower opens from these frames, in order."""
    opened = []
    for frame in frames:
        msg = decode_group(frame)
        assert isinstance(msg, GroupOpen | GroupPageKeys)
        done = assembly.take(msg)
        if done is not None:
            opened.append(done)
    return opened


@pytest.mark.parametrize(
    "num_pages",
    [0, 1, PAGE_KEYS_PER_MESSAGE, PAGE_KEYS_PER_MESSAGE + 1, 65_536, MAX_PAGES_PER_ROOM],
)
def test_every_frame_of_an_opening_fits_and_the_follower_gets_every_key(num_pages: int) -> None:
    msg = opening(num_pages)
    frames = [encode_group(m) for m in wire_messages(msg)]
    assert all(len(f) <= MAX_GROUP_BYTES for f in frames)
    (got,) = deliver(frames, OpenAssembly())
    assert got == msg
    assert got.leg().page_keys == tuple(keys(num_pages))


def test_a_room_of_64k_full_pages_opens_on_a_follower() -> None:
    """The reported case: page size 1, a 64k-token prompt (its open was 1.2 MB)."""
    (got,) = deliver([encode_group(m) for m in wire_messages(opening(64_000))], OpenAssembly())
    assert len(got.page_keys or ()) == 64_000


def test_a_message_over_the_limit_is_refused_when_encoded_not_dropped_downstream() -> None:
    too_many = GroupOpen(1, "r", 8, page_keys=keys(PAGE_KEYS_PER_MESSAGE * 2))
    with pytest.raises(GroupProtocolError, match="oversized"):
        encode_group(too_many)


def test_chunks_out_of_order_or_for_another_room_fail_the_assembly() -> None:
    first, *chunks = wire_messages(opening(3 * PAGE_KEYS_PER_MESSAGE))
    assembly = OpenAssembly()
    assert assembly.take(first) is None
    with pytest.raises(GroupProtocolError, match="page_keys_out_of_order"):
        assembly.take(chunks[1])
    assert assembly.num_pending == 0  # given up: the room fails on this rank
    with pytest.raises(GroupProtocolError, match="page_keys_unknown_room"):
        assembly.take(GroupPageKeys(room=99, index=0, keys=keys(1)))


def test_a_failed_room_drops_its_pending_keys_and_pending_rooms_are_bounded() -> None:
    assembly = OpenAssembly(max_pending=2)
    heads = [wire_messages(opening(PAGE_KEYS_PER_MESSAGE + 1, room=r))[0] for r in range(3)]
    assert assembly.take(heads[0]) is None and assembly.take(heads[1]) is None
    with pytest.raises(GroupProtocolError, match="page_keys_too_many_rooms"):
        assembly.take(heads[2])
    assembly.forget(0)
    assert assembly.num_pending == 1
    assert assembly.take(heads[2]) is None


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 3 * PAGE_KEYS_PER_MESSAGE + 5))
def test_splitting_then_assembling_gives_back_the_opening(num_pages: int) -> None:
    msg = opening(num_pages)
    wire = wire_messages(msg)
    assert len(wire) == 1 + max(0, -(-num_pages // PAGE_KEYS_PER_MESSAGE) - 1)
    assembly = OpenAssembly()
    results = [assembly.take(m) for m in wire]
    assert results[:-1] == [None] * (len(wire) - 1)
    assert results[-1] == msg
    assert assembly.num_pending == 0
