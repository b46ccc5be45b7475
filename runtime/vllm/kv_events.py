"""vLLM's prefix-cache events: the publisher's configuration and its wire format.

vLLM (`--kv-events-config`, `vllm/distributed/kv_events.py` in the 0.32
wheel) publishes every change of its prefix cache from the scheduler, one
batch per engine step that had any:

- a ZMQ PUB socket sends each batch as three frames: the topic, the batch's
  sequence number (8 bytes, big-endian, counting from 0 per process) and the
  msgpack payload `[ts, [event, ...], data_parallel_rank]`; an event is a map
  whose `type` names it: `BlockStored` (block hashes, the parent block's
  hash or nil for a prompt's first block, the blocks' token ids, block size,
  LoRA, medium, extra hash keys per block, KV cache group), `BlockRemoved`
  (block hashes, medium, group) or `AllBlocksCleared`;
- a ZMQ ROUTER socket replays the newest batches it kept (`buffer_steps`):
  a DEALER sends an empty delimiter and a start sequence number (8 bytes,
  big-endian) and gets back every kept batch numbered from there on, as
  `[b"", topic, seq, payload]`, then the end marker `[b"", b"", -1, b""]`.

A block hash is 32 bytes (sha256), or a 64-bit integer when vLLM runs with
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` (its default in 0.32); both are read.

`decode_frame` and `decode_replay_reply` turn frames into typed events or
raise `KVEventFrameError`, whose `reason` is a metric label; they never trust
a frame: counts, sizes, token ids and hashes are all checked, and the payload
is bounded before it is parsed. A batch with one bad event is refused whole,
so a reader never applies half of a step.

Pure module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "KV_EVENTS_TOPIC",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventFrame",
    "KVEvent",
    "KVEventFrameError",
    "decode_frame",
    "decode_replay_reply",
    "publisher_config",
    "replay_request",
]

# The topic our clusters publish on (vLLM's `topic`; a SUB socket filters by it).
KV_EVENTS_TOPIC = "pdcluster.kv"
# Batches vLLM keeps for replay (its `buffer_steps`, vLLM's default).
REPLAY_BUFFER_STEPS = 10_000
# A step's batch holds the token ids of the blocks it cached: a few bytes per
# token, so 16 MiB is far above a real batch and bounds what a bad peer costs.
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
_SEQ_BYTES = 8
_MAX_SEQ = 2**63 - 1
_END_SEQ = (-1).to_bytes(_SEQ_BYTES, "big", signed=True)
_MAX_HASH_BYTES = 64
_MAX_HASH_INT = 2**64 - 1
_MAX_TOKEN_ID = 2**32 - 1  # what the page-key scheme hashes (prefix_keys.py)
_MAX_BLOCK_SIZE = 1 << 16

BlockHash = bytes | int


def publisher_config(publish_port: int, replay_port: int, replay_host: str = "*") -> dict[str, Any]:
    """vLLM's `--kv-events-config`: a ZMQ publisher on `publish_port` (every
    interface: vLLM binds its PUB socket only for a wildcard address) and its
    replay socket on `replay_host:replay_port`."""
    for name, port in (("publish_port", publish_port), ("replay_port", replay_port)):
        if not 1 <= port <= 65535:
            raise ValueError(f"{name} must be in 1..65535, got {port}")
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{publish_port}",
        "replay_endpoint": f"tcp://{replay_host}:{replay_port}",
        "buffer_steps": REPLAY_BUFFER_STEPS,
        "topic": KV_EVENTS_TOPIC,
    }


class KVEventFrameError(ValueError):
    """A frame that is not a well-formed event batch; `reason` names the check it failed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that entered the cache: `block_hashes[i]` holds
    `token_ids[i * block_size : (i + 1) * block_size]`, chained after `parent`."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None  # None: the first block of a prompt
    token_ids: tuple[int, ...]
    block_size: int
    # Per block: whether its hash also covers more than its tokens (a LoRA
    # name, multimodal inputs, a cache salt, prompt embeddings).
    has_extra_keys: tuple[bool, ...]
    lora: str | None
    medium: str | None
    group: int | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    group: int | None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventFrame:
    """One published batch: its sequence number and its events, in order."""

    seq: int
    events: tuple[KVEvent, ...]


# ---- the payload, as vLLM's msgspec structs encode it ---------------------


class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[bytes | int]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(_Batch)


def _bad(message: str) -> KVEventFrameError:
    return KVEventFrameError("malformed", message)


def _hash(value: bytes | int) -> BlockHash:
    if isinstance(value, bytes):
        if not 0 < len(value) <= _MAX_HASH_BYTES:
            raise _bad(f"a block hash of {len(value)} bytes")
    elif not 0 <= value <= _MAX_HASH_INT:
        raise _bad(f"a block hash {value} outside 0..2^64-1")
    return value


def _hashes(values: list[bytes | int]) -> tuple[BlockHash, ...]:
    return tuple(_hash(v) for v in values)


def _stored(raw: _Stored) -> BlockStored:
    hashes = _hashes(raw.block_hashes)
    if not hashes:
        raise _bad("BlockStored without blocks")
    if not 0 < raw.block_size <= _MAX_BLOCK_SIZE:
        raise _bad(f"block_size {raw.block_size}")
    if len(raw.token_ids) != raw.block_size * len(hashes):
        raise _bad(f"{len(raw.token_ids)} token ids for {len(hashes)} blocks of {raw.block_size}")
    if any(not 0 <= t <= _MAX_TOKEN_ID for t in raw.token_ids):
        raise _bad("a token id outside 0..2^32-1")
    extra = raw.extra_keys
    if extra is not None and len(extra) != len(hashes):
        raise _bad(f"{len(extra)} extra_keys entries for {len(hashes)} blocks")
    lora = raw.lora_name if raw.lora_name is not None else raw.lora_id
    return BlockStored(
        block_hashes=hashes,
        parent=None if raw.parent_block_hash is None else _hash(raw.parent_block_hash),
        token_ids=tuple(raw.token_ids),
        block_size=raw.block_size,
        has_extra_keys=tuple(e is not None for e in extra) if extra else (False,) * len(hashes),
        lora=None if lora is None else str(lora),
        medium=raw.medium,
        group=raw.group_idx,
    )


def _event(raw: _Stored | _Removed | _Cleared) -> KVEvent:
    if isinstance(raw, _Stored):
        return _stored(raw)
    if isinstance(raw, _Removed):
        return BlockRemoved(_hashes(raw.block_hashes), raw.medium, raw.group_idx)
    return AllBlocksCleared()


def _seq(raw: bytes) -> int:
    if len(raw) != _SEQ_BYTES:
        raise KVEventFrameError("seq", f"a sequence number of {len(raw)} bytes, not 8")
    seq = int.from_bytes(raw, "big")
    if seq > _MAX_SEQ:
        raise KVEventFrameError("seq", f"sequence number {seq} out of range")
    return seq


def _payload(seq: int, payload: bytes, max_payload_bytes: int) -> EventFrame:
    if len(payload) > max_payload_bytes:
        raise KVEventFrameError(
            "oversized", f"a {len(payload)}-byte batch (the bound is {max_payload_bytes})"
        )
    try:
        batch = _DECODER.decode(payload)
    except msgspec.DecodeError as err:  # ValidationError included
        raise _bad(f"batch {seq}: {err}") from None
    return EventFrame(seq, tuple(_event(raw) for raw in batch.events))


def decode_frame(
    parts: Sequence[bytes],
    *,
    topic: bytes = KV_EVENTS_TOPIC.encode(),
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> EventFrame:
    """One message of the PUB socket (`[topic, seq, payload]`)."""
    if len(parts) != 3:
        raise KVEventFrameError("parts", f"a message of {len(parts)} frames, not 3")
    if parts[0] != topic:
        raise KVEventFrameError("topic", f"topic {bytes(parts[0])[:64]!r}, not {topic!r}")
    return _payload(_seq(parts[1]), parts[2], max_payload_bytes)


def decode_replay_reply(
    parts: Sequence[bytes],
    *,
    topic: bytes = KV_EVENTS_TOPIC.encode(),
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> EventFrame | None:
    """One message of the replay socket, as a DEALER receives it; None for the end marker."""
    if len(parts) != 4 or parts[0] != b"":
        raise KVEventFrameError("parts", f"a replay message of {len(parts)} frames, not 4")
    if parts[1] == b"" and parts[2] == _END_SEQ and parts[3] == b"":
        return None
    return decode_frame(parts[1:], topic=topic, max_payload_bytes=max_payload_bytes)


def replay_request(start_seq: int) -> tuple[bytes, bytes]:
    """What a DEALER sends to replay every kept batch numbered `start_seq` or later."""
    if not 0 <= start_seq <= _MAX_SEQ:
        raise ValueError(f"start_seq must be in 0..2^63-1, got {start_seq}")
    return b"", start_seq.to_bytes(_SEQ_BYTES, "big")
