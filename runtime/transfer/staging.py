"""Staging buffers, and the copies between them and a pool's pages.

A sender gathers a frame's pages into a staging buffer and hands that memory
to the transport without copying it again. Buffers come from a small pool
and go back only when the transport says it is done with them (libzmq
released the payload, or the one-sided write finished), so a buffer is never
refilled while its previous frame may still be read.

`scatter_bytes` is the receiving half: one frame's bytes into the pages of a
CPU pool in a single NumPy fancy-index assignment over fixed-size byte cells
(a token's heads in NHD, one head's row in any other order, located through
the pool's `row_strides`). On CPU, torch's
`index_copy_`/`index_put_` copy element by element, about seven times slower
than this memcpy-per-cell path; NumPy also releases the GIL while it copies.

With whole heads in NHD, both directions copy runs of `cells.cell_tokens`
tokens per cell (a page, or more) instead of one token: on 2 KiB token rows
the per-cell cost kept gather and scatter near 11 GiB/s; 32 KiB page cells
run at 20-30 GiB/s. The CPU gather then is one `np.take` into the staging
buffer (contiguous output: NumPy writes it in place, without buffering).

On a GPU pool the gather runs on the device into a scratch tensor and one
device-to-host copy lands it in pinned staging memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

from pdcluster.runtime.engine.kv_order import NHD_ORDER
from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.transfer.cells import cell_tokens


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

    One `index_select` over the whole frame through a flat row index: one
    copy, no temporary, and no per-layer call overhead (which dominated
    small frames). Rows are a token's heads (NHD) or one head's values (any
    other order, located by the pool's `row_strides`).
    """
    shape = pool.shape
    hs, he, _ = heads.indices(shape.num_kv_heads)
    nhd = shape.order == NHD_ORDER
    if pool.device.type == "cpu" and nhd and (hs, he) == (0, shape.num_kv_heads) and len(slots):
        _gather_runs(pool, layers, slots.numpy(), out)
        return
    dev = slots.device
    lay = torch.as_tensor(list(layers), dtype=torch.int64, device=dev)
    if nhd:
        planes = (lay[:, None] * 2 + torch.arange(2, device=dev)[None, :])[:, :, None]  # [l, 2, 1]
        num_slots = shape.num_pages * shape.page_size
        rows = pool.buffer.view(-1, shape.num_kv_heads, shape.head_dim)  # [L*2*slots, H, D]
        if (hs, he) != (0, shape.num_kv_heads):
            rows = rows[:, hs:he]
        index = planes * num_slots + slots[None, None, :]  # [l, 2, n]
        torch.index_select(rows, 0, index.reshape(-1), out=out.view(-1, he - hs, shape.head_dim))
        return
    kv = torch.arange(2, device=dev)
    index = _row_index(shape, lay, kv, slots, torch.arange(hs, he, device=dev))  # [l, 2, n, h]
    torch.index_select(pool.rows, 0, index.reshape(-1), out=out.view(-1, shape.head_dim))


_Index = TypeVar("_Index", torch.Tensor, np.ndarray)


def _row_index(
    shape: KVPoolShape, layers: _Index, kv: _Index, slots: _Index, heads: _Index
) -> _Index:
    """Row of each (layer, plane, slot, head), shaped [l, 2, n, h] (torch or NumPy)."""
    s = shape.row_strides()
    ps = shape.page_size
    planes = layers[:, None, None, None] * s["L"] + kv[None, :, None, None] * s["K"]
    tokens = (slots // ps) * s["P"] + (slots % ps) * s["N"]
    index: _Index = planes + tokens[None, None, :, None] + heads[None, None, None, :] * s["H"]
    return index


def scatter_bytes(
    pool: KVPool,
    layers: Sequence[int],
    slots: np.ndarray,  # [n] int64
    heads: tuple[int, int],
    data: np.ndarray,  # uint8 [len(layers), 2, n, h, head_dim * itemsize], contiguous
) -> None:
    """Write a frame's raw bytes into `slots` of a CPU pool: the inverse of gather_into."""
    shape = pool.shape
    if pool.device.type != "cpu":
        raise ValueError("scatter_bytes writes CPU pools; use KVPool.scatter_tokens on devices")
    head_bytes = shape.head_dim * pool.buffer.element_size()
    hs, he = heads
    raw = pool.buffer.view(torch.uint8).numpy()  # shares the pool's memory
    lay = np.asarray(layers, dtype=np.int64)[:, None, None]
    kv = np.arange(2)[None, :, None]
    nhd = shape.order == NHD_ORDER
    if nhd and (hs, he) == (0, shape.num_kv_heads) and len(slots):
        num_slots = shape.num_pages * shape.page_size
        tokens = cell_tokens(slots, num_slots)
        cell = np.dtype(f"V{tokens * shape.num_kv_heads * head_bytes}")
        dst = raw.reshape(shape.num_layers, 2, -1).view(cell)  # [L, 2, num_slots / tokens]
        src = data.reshape(*data.shape[:2], -1).view(cell)  # [l, 2, n / tokens]
        dst[lay, kv, slots[None, None, ::tokens] // tokens] = src
        return
    if nhd:
        # A cell is one token's heads [hs, he): contiguous inside its row.
        rows = raw.reshape(
            shape.num_layers, 2, shape.num_pages * shape.page_size, shape.num_kv_heads * head_bytes
        )[..., hs * head_bytes : he * head_bytes]
        cell = np.dtype(f"V{(he - hs) * head_bytes}")
        dst = rows.view(cell)[..., 0]  # [L, 2, slots]
        src = data.reshape(*data.shape[:3], -1).view(cell)[..., 0]  # [l, 2, n]
        dst[lay, kv, slots[None, None, :]] = src
        return
    # A cell is one head's row; `row_strides` locate it in any order.
    cell = np.dtype(f"V{head_bytes}")
    cells = raw.reshape(-1, head_bytes).view(cell)[:, 0]  # [rows]
    src = data.view(cell)[..., 0]  # [l, 2, n, h]
    index = _row_index(
        shape, np.asarray(layers, dtype=np.int64), np.arange(2), slots, np.arange(hs, he)
    )
    cells[index] = src


def _gather_runs(
    pool: KVPool,
    layers: Sequence[int],
    slots: np.ndarray,  # [n] int64
    out: torch.Tensor,  # [len(layers), 2, n, H, D], contiguous
) -> None:
    """Whole-row NHD gather on CPU: one `np.take` of run-sized cells into `out`."""
    shape = pool.shape
    num_slots = shape.num_pages * shape.page_size
    tokens = cell_tokens(slots, num_slots)
    cells_per_plane = num_slots // tokens
    lay = np.asarray(layers, dtype=np.int64)
    if len(lay) == 0 or lay.min() < 0 or lay.max() >= shape.num_layers:
        raise IndexError(f"layers {list(layers)} outside the pool's {shape.num_layers}")
    if slots.min() < 0 or slots.max() >= num_slots:
        raise IndexError(f"slots outside the pool's 0..{num_slots - 1}")
    planes = (lay[:, None] * 2 + np.arange(2)[None, :])[:, :, None]  # [l, 2, 1]
    index = planes * cells_per_plane + slots[None, None, ::tokens] // tokens  # [l, 2, n / tokens]
    cell = np.dtype(f"V{tokens * shape.num_kv_heads * shape.head_dim * pool.buffer.element_size()}")
    src = pool.buffer.view(-1).view(torch.uint8).numpy().view(cell)  # [L * 2 * cells_per_plane]
    dst = out.view(-1).view(torch.uint8).numpy().view(cell)  # [l * 2 * n / tokens]
    # Bounds were checked above; "clip" keeps NumPy from buffering the output.
    np.take(src, index.reshape(-1), out=dst, mode="clip")
