"""vLLM's KV-event frames (runtime/vllm/kv_events.py): real frames written by
vLLM's own publisher (data/make_vllm_kv_frames.py made the file), and every
malformed frame refused with a reason, never half read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.vllm.kv_events import (
    KV_EVENTS_TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventFrameError,
    decode_frame,
    decode_replay_reply,
    publisher_config,
    replay_request,
)

FRAMES: dict[str, Any] = msgspec.msgpack.decode(
    (Path(__file__).parent / "data" / "vllm_kv_frames.msgpack").read_bytes()
)
TOPIC = KV_EVENTS_TOPIC.encode()
A, B, C = 0x1111_2222_3333_4444, 0xFFFF_0000_FFFF_0000, bytes(range(32))


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def test_vllms_own_frames_decode_to_their_events() -> None:
    frames = [decode_frame(parts) for parts in FRAMES["live"]]
    assert [f.seq for f in frames] == [0, 1, 2, 3]
    (first,) = frames[0].events
    assert first == BlockStored(
        block_hashes=(A, B),
        parent=None,
        token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
        block_size=4,
        has_extra_keys=(False, False),
        lora=None,
        medium="GPU",
        group=0,
    )
    (salted,) = frames[1].events
    assert salted.block_hashes == (C,) and salted.parent == B  # bytes and int hashes
    assert salted.has_extra_keys == (True,)
    assert frames[2].events == (BlockRemoved((B,), "GPU", 0),)
    lora, cleared = frames[3].events
    assert isinstance(lora, BlockStored) and lora.lora == "adapter" and lora.medium == "CPU"
    assert cleared == AllBlocksCleared()


def test_vllms_replay_answer_decodes_and_ends_with_its_marker() -> None:
    *batches, end = FRAMES["replay"]
    frames = [decode_replay_reply(parts) for parts in batches]
    assert [f.seq for f in frames if f is not None] == [2, 3]
    assert frames == [decode_frame(parts) for parts in FRAMES["live"][2:]]
    assert decode_replay_reply(end) is None


def _payload(index: int = 0) -> Any:
    """A real payload as plain msgpack values, to break one field at a time."""
    return msgspec.msgpack.decode(FRAMES["live"][index][2])


def _frame(payload: Any) -> list[bytes]:
    return [TOPIC, seq(0), msgspec.msgpack.encode(payload)]


def _stored(**change: Any) -> Any:
    payload = _payload()
    payload[1][0].update(change)
    return payload


MALFORMED_PAYLOADS = {
    "not msgpack": b"\xc1\xc1",
    "not an array": msgspec.msgpack.encode({"ts": 1.0}),
    "events not a list": msgspec.msgpack.encode([1.0, 5]),
    "unknown event": msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}]]),
    "untagged event": msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]),
    "too few tokens": msgspec.msgpack.encode(_stored(token_ids=[1, 2, 3])),
    "no blocks": msgspec.msgpack.encode(_stored(block_hashes=[], token_ids=[])),
    "block size 0": msgspec.msgpack.encode(_stored(block_size=0)),
    "negative token": msgspec.msgpack.encode(_stored(token_ids=[1, 2, 3, 4, 5, 6, 7, -1])),
    "token over 2^32": msgspec.msgpack.encode(_stored(token_ids=[1, 2, 3, 4, 5, 6, 7, 2**32])),
    "token a string": msgspec.msgpack.encode(_stored(token_ids=[1, 2, 3, 4, 5, 6, 7, "x"])),
    "empty hash": msgspec.msgpack.encode(_stored(block_hashes=[b"", 1])),
    "huge hash": msgspec.msgpack.encode(_stored(block_hashes=[b"x" * 65, 1])),
    "negative hash": msgspec.msgpack.encode(_stored(block_hashes=[-1, 1])),
    "negative parent": msgspec.msgpack.encode(_stored(parent_block_hash=-5)),
    "hash a float": msgspec.msgpack.encode(_stored(block_hashes=[1.5, 1])),
    "extra keys per block": msgspec.msgpack.encode(_stored(extra_keys=[None])),
    "removed bad hash": msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [-3], "medium": None}]]
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_PAYLOADS))
def test_a_malformed_payload_is_refused_whole(name: str) -> None:
    with pytest.raises(KVEventFrameError) as err:
        decode_frame([TOPIC, seq(5), MALFORMED_PAYLOADS[name]])
    assert err.value.reason == "malformed"


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ([TOPIC, seq(0)], "parts"),
        ([TOPIC, seq(0), b"", b""], "parts"),
        ([b"other", seq(0), FRAMES["live"][0][2]], "topic"),
        ([TOPIC, b"\x00" * 7, FRAMES["live"][0][2]], "seq"),
        ([TOPIC, b"\xff" * 8, FRAMES["live"][0][2]], "seq"),
        ([TOPIC, seq(0), b"\x90" * 100], "oversized"),
    ],
)
def test_a_malformed_message_names_why(parts: list[bytes], reason: str) -> None:
    with pytest.raises(KVEventFrameError) as err:
        decode_frame(parts, max_payload_bytes=64)
    assert err.value.reason == reason


@pytest.mark.parametrize(
    "parts",
    [
        [TOPIC, seq(0), FRAMES["live"][0][2]],  # a PUB message on the replay socket
        [b"x", TOPIC, seq(0), FRAMES["live"][0][2]],
        [b"", b"", seq(0), b""],  # an end marker with another number
    ],
)
def test_a_malformed_replay_message_is_refused(parts: list[bytes]) -> None:
    with pytest.raises(KVEventFrameError):
        decode_replay_reply(parts)


@given(st.binary(max_size=512), st.binary(max_size=12))
def test_no_payload_breaks_the_decoder_with_anything_but_its_error(
    payload: bytes, raw_seq: bytes
) -> None:
    try:
        frame = decode_frame([TOPIC, raw_seq, payload])
    except KVEventFrameError as err:
        assert err.reason in {"malformed", "seq", "oversized"}
    else:
        assert len(raw_seq) == 8 and frame.seq == int.from_bytes(raw_seq, "big")


@given(st.integers(0, len(FRAMES["live"][1][2]) - 1), st.integers(0, 255))
def test_a_flipped_byte_of_a_real_frame_decodes_checked_or_is_refused(at: int, value: int) -> None:
    payload = bytearray(FRAMES["live"][1][2])
    payload[at] = value
    try:
        frame = decode_frame([TOPIC, seq(1), bytes(payload)])
    except KVEventFrameError:
        return
    for event in frame.events:
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == event.block_size * len(event.block_hashes)


def test_replay_requests_and_publisher_configs_check_their_numbers() -> None:
    assert replay_request(2) == (b"", seq(2))
    with pytest.raises(ValueError, match="start_seq"):
        replay_request(-1)
    config = publisher_config(5557, 5558, replay_host="127.0.0.1")
    assert config["endpoint"] == "tcp://*:5557"
    assert config["replay_endpoint"] == "tcp://127.0.0.1:5558"
    assert config["topic"] == KV_EVENTS_TOPIC
    with pytest.raises(ValueError, match="replay_port"):
        publisher_config(5557, 70000)


def test_the_checked_in_frames_are_the_ones_the_script_describes() -> None:
    # The file must keep both sockets' answers (the script's docstring).
    assert set(FRAMES) == {"live", "replay"}
    assert all(parts[0] == TOPIC for parts in FRAMES["live"])
    assert FRAMES["replay"][-1] == [
        b"",
        b"",
        (-1).to_bytes(8, "big", signed=True),
        b"",
    ]
