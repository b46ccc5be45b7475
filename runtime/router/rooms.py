"""Request ids and bootstrap rooms, minted by the router.

Invariants:
- a rid is ``req-`` followed by exactly 32 lowercase hex digits, so every rid
  has the same width and no rid is a prefix of another (workers abort by
  exact rid, but a fixed width also keeps logs and prefix tools honest);
- one `RidMinter` never returns the same rid twice, whatever its random
  source yields: the low 64 bits are a per-minter counter, the high 64 bits
  are random so rids of different routers do not collide in practice;
- a room is in ``[1, 2**63 - 1]``: the top bit of 64 stays clear so it fits a
  positive signed int64 on every peer, and 0 is never used (peers may read 0
  as "no room");
- with ``dp_size > 1`` a room satisfies ``room % dp_size == dp_rank``, which
  is how the prefill instance routes the request to that dp group;
- a room already in use is never returned.

Pure module: the random source is injected (`random.Random` for seeded tests,
`secrets.SystemRandom` in production).
"""

from __future__ import annotations

import re
from collections.abc import Container
from typing import Protocol

RID_PREFIX = "req-"
RID_HEX_DIGITS = 32
RID_PATTERN = re.compile(rf"^{RID_PREFIX}[0-9a-f]{{{RID_HEX_DIGITS}}}$")
ROOM_BITS = 63
MAX_ROOM = (1 << ROOM_BITS) - 1
_COUNTER_BITS = 64
_COUNTER_MASK = (1 << _COUNTER_BITS) - 1
# A room drawn from 63 random bits collides with an in-use one with
# negligible probability; the bound only stops a broken source (one that
# always returns the same bits) from looping forever.
MAX_ROOM_DRAWS = 64


class RandomSource(Protocol):
    """What the minters need from a random generator."""

    def getrandbits(self, k: int, /) -> int: ...


class RoomExhaustedError(RuntimeError):
    """The random source kept producing rooms that are already in use."""


def is_valid_rid(rid: str) -> bool:
    return RID_PATTERN.fullmatch(rid) is not None


class RidMinter:
    """Mints fixed-width rids, unique for the lifetime of the minter."""

    def __init__(self, source: RandomSource) -> None:
        self._source = source
        self._counter = 0

    def mint(self) -> str:
        high = self._source.getrandbits(_COUNTER_BITS) & _COUNTER_MASK
        low = self._counter
        # 2**64 rids from one process is out of reach; wrapping would be the
        # only way to repeat, so refuse instead of wrapping silently.
        if low > _COUNTER_MASK:
            raise OverflowError("rid counter exhausted")
        self._counter += 1
        return f"{RID_PREFIX}{high:016x}{low:016x}"


def room_for_draw(draw: int, dp_size: int, dp_rank: int) -> int:
    """Map 63 random bits onto a room with ``room % dp_size == dp_rank``.

    Returns 0 when the draw lands on room 0, which callers treat as "draw
    again". The mapping is deterministic so it can be checked exhaustively.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    if not 0 <= draw <= MAX_ROOM:
        raise ValueError(f"draw must be a {ROOM_BITS}-bit non-negative int, got {draw}")
    # Largest multiple of dp_size whose rank slot still fits under MAX_ROOM.
    top_base = (MAX_ROOM - dp_rank) // dp_size * dp_size
    base = draw // dp_size * dp_size
    if base > top_base:
        base = top_base
    return base + dp_rank


def mint_room(
    source: RandomSource,
    *,
    dp_size: int = 1,
    dp_rank: int = 0,
    in_use: Container[int] = frozenset(),
) -> int:
    """Draw a fresh room for ``dp_rank`` of an instance with ``dp_size`` groups."""
    for _ in range(MAX_ROOM_DRAWS):
        room = room_for_draw(source.getrandbits(ROOM_BITS) & MAX_ROOM, dp_size, dp_rank)
        if room != 0 and room not in in_use:
            return room
    raise RoomExhaustedError(
        f"no free room after {MAX_ROOM_DRAWS} draws (dp_size={dp_size}, dp_rank={dp_rank}); "
        "the random source is not random"
    )
