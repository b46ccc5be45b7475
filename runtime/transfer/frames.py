"""KV frame headers, frame planning and header validation (pure).

A KV *frame* carries the K and V of a contiguous range of destination token
positions for a set of layers and one head slice, as one contiguous block
`[num_layers, 2, num_tokens, num_heads, head_dim]` in the sender's dtype.
The header names everything in the *receiver's* coordinates (dst-local layer
ids, dst-local head slice, dst token positions), so the receiver never needs
to know the sender's topology to place the bytes.

Invariants:
- a header is only trusted after `validate_header` accepted it against the
  receiver's pool geometry and the payload size; `validate_target` then
  bounds its token range by the room's page table;
- `plan_frames` covers `[0, num_tokens)` exactly with contiguous, non-empty,
  ordered frames of even size, each at most `max_frame_bytes`; when there is
  more than one frame, each holds at least min(min_frame_bytes,
  max_frame_bytes / 2) give or take one block, so pages are never sent one
  by one. With `align_tokens` = a (a page), every cut between two frames
  falls on an absolute position `first_token + cut` that is a multiple of a
  (unless a page exceeds `max_frame_bytes`), so each frame holds whole pages
  and is copied page by page rather than token by token; sizes then differ
  by at most one block of a tokens (a = 1: one token).

No I/O, no torch: the receiver and sender I/O loops call into this module.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from pdcluster.runtime.spec import KVDtype

FRAME_VERSION = 1
MiB = 1 << 20
DEFAULT_MAX_FRAME_BYTES = 16 * MiB
DEFAULT_MIN_FRAME_BYTES = 1 * MiB
# Enough frames in flight that gather, send, receive and scatter overlap.
DEFAULT_PIPELINE_DEPTH = 4
MAX_HEADER_BYTES = 64 * 1024
MAX_ROOM = (1 << 63) - 1


class FrameError(ValueError):
    """A frame or header was rejected. `reason` is a short label for stats."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class KVFrameHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Describes one KV frame, in the receiver's coordinates."""

    room: int
    generation: int
    src_rank: int
    layers: tuple[int, ...]  # dst-local layer ids, in payload order
    token_start: int  # dst token positions [token_start, token_end)
    token_end: int
    head_start: int  # dst-local kv heads [head_start, head_end)
    head_end: int
    dtype: str
    shape: tuple[int, ...]  # [len(layers), 2, tokens, heads, head_dim]
    checksum: int | None = None  # crc32 of the payload bytes when enabled
    is_last: bool = False  # last frame of the sender's last job for this room
    version: int = FRAME_VERSION

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


class PoolGeometry(Protocol):
    """What validation needs to know about the receiver's pool (KVPoolShape fits)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVFrameHeader)


def encode_header(header: KVFrameHeader) -> bytes:
    return _encoder.encode(header)


def decode_header(data: bytes | memoryview) -> KVFrameHeader:
    """Parse a header; garbage, oversize and unknown versions raise FrameError."""
    if len(data) > MAX_HEADER_BYTES:
        raise FrameError("oversized", f"header of {len(data)} bytes > {MAX_HEADER_BYTES}")
    try:
        header = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise FrameError("bad_header", str(exc)) from None
    if header.version != FRAME_VERSION:
        raise FrameError(
            "bad_version", f"frame version {header.version}, this node speaks {FRAME_VERSION}"
        )
    return header


def frame_nbytes(header: KVFrameHeader) -> int:
    """Payload bytes the header announces (0 when its dtype is unknown)."""
    size = KVDtype.itemsize_of(header.dtype) or 0
    for dim in header.shape:
        size *= dim
    return size


def validate_header(header: KVFrameHeader, pool: PoolGeometry, payload_nbytes: int) -> None:
    """Check a received header against the receiver's pool and the payload size.

    Raises FrameError naming the first problem; returns None when the frame
    can be scattered into a page table that covers its token range.
    """
    if not 0 <= header.room <= MAX_ROOM:
        raise FrameError("bad_room", f"room {header.room} is not a positive int64")
    if header.generation < 0 or header.src_rank < 0:
        raise FrameError("bad_header", "generation and src_rank must be >= 0")
    if header.dtype != pool.dtype:
        raise FrameError(
            "dtype_mismatch", f"frame dtype {header.dtype!r}, receiver pool {pool.dtype!r}"
        )
    layers = header.layers
    if not layers:
        raise FrameError("bad_layers", "frame names no layers")
    if len(set(layers)) != len(layers):
        raise FrameError("bad_layers", f"duplicate layer ids {list(layers)}")
    if min(layers) < 0 or max(layers) >= pool.num_layers:
        raise FrameError(
            "bad_layers", f"layers {list(layers)} outside receiver's 0..{pool.num_layers - 1}"
        )
    if not 0 <= header.head_start < header.head_end <= pool.num_kv_heads:
        raise FrameError(
            "bad_heads",
            f"heads [{header.head_start}, {header.head_end}) outside receiver's "
            f"0..{pool.num_kv_heads}",
        )
    if not 0 <= header.token_start < header.token_end:
        raise FrameError(
            "bad_tokens", f"token range [{header.token_start}, {header.token_end}) is empty"
        )
    expected = (len(layers), 2, header.num_tokens, header.num_heads, pool.head_dim)
    if tuple(header.shape) != expected:
        raise FrameError("bad_shape", f"shape {list(header.shape)}, expected {list(expected)}")
    if frame_nbytes(header) != payload_nbytes:
        raise FrameError(
            "payload_size",
            f"payload of {payload_nbytes} bytes, header announces {frame_nbytes(header)}",
        )


def validate_target(header: KVFrameHeader, num_table_pages: int, page_size: int) -> None:
    """Check that a room's page table covers the frame's token range."""
    capacity = num_table_pages * page_size
    if header.token_end > capacity:
        raise FrameError(
            "out_of_bounds",
            f"tokens up to {header.token_end} but room {header.room} holds {capacity}",
        )


def plan_frames(
    num_tokens: int,
    bytes_per_token: int,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    min_frame_bytes: int = DEFAULT_MIN_FRAME_BYTES,
    pipeline_depth: int = DEFAULT_PIPELINE_DEPTH,
    *,
    align_tokens: int = 1,
    first_token: int = 0,
) -> list[tuple[int, int]]:
    """Split tokens [0, num_tokens) into frames of even size.

    Uses the fewest frames that respect `max_frame_bytes`, then splits further
    (up to `pipeline_depth` frames) while every frame stays at least
    `min_frame_bytes`, so a medium transfer still overlaps its stages.

    Frames are cut only where `first_token + cut` is a multiple of
    `align_tokens`: the tokens are seen as *blocks* (a partial block before the
    first such position, whole blocks of `align_tokens`, a partial last one)
    and whole blocks are dealt to frames, the first frames taking one more
    when they do not divide evenly.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
    if not 0 < min_frame_bytes <= max_frame_bytes:
        raise ValueError(
            f"need 0 < min_frame_bytes ({min_frame_bytes}) <= max_frame_bytes ({max_frame_bytes})"
        )
    if pipeline_depth < 1:
        raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
    if align_tokens < 1 or first_token < 0:
        raise ValueError(
            f"need align_tokens >= 1 and first_token >= 0, got {align_tokens}, {first_token}"
        )
    if bytes_per_token > max_frame_bytes:
        raise ValueError(
            f"one token's KV ({bytes_per_token} bytes) exceeds max_frame_bytes ({max_frame_bytes})"
        )
    if num_tokens == 0:
        return []
    max_tokens = max_frame_bytes // bytes_per_token
    if align_tokens > max_tokens:
        align_tokens = 1  # a whole block would not fit in a frame: cut anywhere
    # Block k (k >= 1) starts at token `first_cut + (k - 1) * align_tokens`.
    first_cut = (-first_token) % align_tokens or align_tokens
    if first_cut >= num_tokens:
        num_blocks = 1
    else:
        num_blocks = 1 + -(-(num_tokens - first_cut) // align_tokens)
    max_blocks = max_tokens // align_tokens  # blocks per frame, each at most align_tokens
    num_frames = -(-num_blocks // max_blocks)
    # Extra frames only when each (floor-sized) frame still holds min_frame_bytes.
    while (
        num_frames < min(pipeline_depth, num_blocks)
        and (num_blocks // (num_frames + 1)) * align_tokens * bytes_per_token >= min_frame_bytes
    ):
        num_frames += 1
    base, extra = divmod(num_blocks, num_frames)
    frames: list[tuple[int, int]] = []
    start = 0
    block = 0
    for i in range(num_frames):
        block += base + (1 if i < extra else 0)
        end = num_tokens if block == num_blocks else first_cut + (block - 1) * align_tokens
        frames.append((start, end))
        start = end
    return frames
