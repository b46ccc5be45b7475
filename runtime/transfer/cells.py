"""Copy granularity of a frame: how many tokens move per memcpy (pure, NumPy only).

A frame's tokens sit at arbitrary slots of a pool, so gather and scatter are
fancy-index copies of fixed-size *cells*. A cell of one token costs one small
memcpy per token and K/V plane (2 KiB for 8 heads × 128 × fp16); pages hold
runs of consecutive slots, so most frames can move whole runs instead, and
larger memcpys run close to memory bandwidth.

`cell_tokens(slots, num_slots)` is the largest c such that, for every k, the
tokens [k*c, (k+1)*c) of the frame sit at the consecutive slots
[s, s + c) with s = slots[k*c] a multiple of c, and c divides both the
frame length and `num_slots`. Then the pool's plane is an array of
num_slots / c cells, the frame's plane one of n / c cells, and frame cell k
is pool cell slots[k*c] // c.

Why it is the largest: a valid c must divide the frame length, `num_slots`,
every position where the slots stop being consecutive (else a cell would
straddle it) and the slot found there (the cell starts at it); the gcd of
those numbers is valid itself, so it is the maximum.

Invariant: the result is >= 1, and 1 (token by token) is always valid.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray


def cell_tokens(slots: NDArray[np.int64], num_slots: int) -> int:
    """The largest whole-run cell size (in tokens) for copying `slots`; see the module doc."""
    num_tokens = len(slots)
    if num_tokens == 0:
        raise ValueError("a frame holds at least one token")
    if num_slots <= 0:
        raise ValueError(f"num_slots must be > 0, got {num_slots}")
    cell = math.gcd(num_tokens, num_slots, int(slots[0]))
    if cell == 1 or num_tokens == 1:
        return cell
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1  # where a new run starts
    if breaks.size:
        cell = math.gcd(cell, int(np.gcd.reduce(breaks)), int(np.gcd.reduce(slots[breaks])))
    return cell


def is_valid_cell(slots: NDArray[np.int64], num_slots: int, cell: int) -> bool:
    """Whether cells of `cell` tokens copy `slots` correctly (the definition, spelled out)."""
    num_tokens = len(slots)
    if cell < 1 or num_tokens % cell or num_slots % cell:
        return False
    starts = slots[::cell]
    runs = starts[:, None] + np.arange(cell)[None, :]  # [n / cell, cell]
    return bool(np.all(starts % cell == 0) and np.array_equal(runs.reshape(-1), slots))
