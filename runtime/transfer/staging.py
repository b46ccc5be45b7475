"""Reusable staging buffers and the gather that fills them.

A sender gathers a frame's pages into a staging buffer and hands that memory
to the transport without copying it again. Buffers come from a small pool
and go back only when the transport says it is done with them (libzmq
released the payload, or the one-sided write finished), so a buffer is never
refilled while its previous frame may still be read.

On a GPU pool the gather runs on the device into a scratch tensor and one
device-to-host copy lands it in pinned staging memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.spec import KVLayout


class StagingTimeout(TimeoutError):
    """No staging buffer came back in time: the transport is not draining."""


class StagingClosed(RuntimeError):
    """The pool was closed while waiting for a buffer."""


class StagingPool:
    """At most `max_buffers` byte buffers, reused across frames."""

    def __init__(self, max_buffers: int = 4, pin_memory: bool = False) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        self.max_buffers = max_buffers
        self.pin_memory = pin_memory
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._num_allocated = 0
        self._closed = False

    def acquire(self, nbytes: int, timeout: float) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` bytes (its first `nbytes` are yours)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise StagingClosed("staging pool closed")
                # Indices, not list.remove: tensors compare element-wise, not by identity.
                fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
                if fits:
                    return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                if self._num_allocated < self.max_buffers:
                    self._num_allocated += 1
                    break
                if self._free:
                    # Every idle buffer is too small: replace the smallest one.
                    sizes = [b.numel() for b in self._free]
                    self._free.pop(sizes.index(min(sizes)))
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingTimeout(f"no staging buffer returned within {timeout}s")
                self._cond.wait(left)
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        except BaseException:
            with self._cond:
                self._num_allocated -= 1
                self._cond.notify()
            raise

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            if not self._closed:
                self._free.append(buf)
            self._cond.notify()

    def close(self) -> None:
        """Wake every waiter with an error; buffers are freed when released."""
        with self._cond:
            self._closed = True
            self._free.clear()
            self._cond.notify_all()

    @property
    def num_allocated(self) -> int:
        return self._num_allocated


def frame_view(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The first bytes of a uint8 buffer seen as a contiguous tensor of `shape`."""
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return buf[:nbytes].view(dtype).view(tuple(shape))


def gather_into(
    pool: KVPool,
    layers: Sequence[int],
    slots: torch.Tensor,  # [n] int64, on the pool's device
    heads: slice,
    out: torch.Tensor,  # [len(layers), 2, n, h, D], contiguous
) -> None:
    """Same result as `pool.gather_tokens(layers, slots, heads)`, written into `out`.

    NHD gathers straight into `out` (one copy); HND needs an indexing
    temporary per layer because its slots are not rows of one matrix.
    """
    shape = pool.shape
    is_nhd = shape.layout == KVLayout.NHD
    if not is_nhd:
        pages, offsets = slots // shape.page_size, slots % shape.page_size
    for i, layer in enumerate(layers):
        for kv in (0, 1):
            dst = out[i, kv]  # [n, h, D]
            t = pool.buffer[layer, kv]
            if is_nhd:
                rows = t.view(-1, shape.num_kv_heads, shape.head_dim)  # [slots, H, D]
                if heads != slice(None):
                    rows = rows[:, heads]
                torch.index_select(rows, 0, slots, out=dst)
            else:
                dst.copy_(t[pages, heads, offsets])  # [n, h, D]
