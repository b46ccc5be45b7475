"""Optional per-frame KV checksum (pure).

CRC-32 over the raw payload bytes, computed by the sender after gathering a
frame and verified by the receiver *before* anything is scattered, so a
corrupted frame never reaches the pool. A mismatch fails the room with the
reason `checksum_mismatch` (docs/design.md §8). This covers the wire only (tcp);
`page_checksum` covers the pages on both ends, on every transport.
"""

from __future__ import annotations

import zlib

CHECKSUM_MISMATCH = "checksum_mismatch"
CHECKSUM_MISSING = "checksum_missing"


def compute_checksum(data: bytes | bytearray | memoryview) -> int:
    """CRC-32 of the bytes (C-contiguous memoryviews are read without a copy)."""
    return zlib.crc32(data) & 0xFFFFFFFF


def is_checksum_valid(data: bytes | bytearray | memoryview, expected: int) -> bool:
    return compute_checksum(data) == expected
