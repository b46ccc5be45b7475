"""Staging buffers, and the copies between them and a pool's pages.

A sender gathers a frame's pages into a staging buffer and hands that memory
to the transport without copying it again. Buffers come from a small pool
and go back only when the transport says it is done with them (libzmq
released the payload, or the one-sided write finished), so a buffer is never
refilled while its previous frame may still be read.

`scatter_bytes` is the receiving half: one frame's bytes into the pages of a
CPU pool in a single NumPy fancy-index assignment over fixed-size byte cells
(a token's heads in NHD, one head's row in HND). On CPU, torch's
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

import numpy as np
import torch

from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.spec import KVLayout
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
    small frames). Rows are a token's heads (NHD) or one head's values (HND).
    """
    shape = pool.shape
    hs, he, _ = heads.indices(shape.num_kv_heads)
    if (
        pool.device.type == "cpu"
        and shape.layout == KVLayout.NHD
        and (hs, he) == (0, shape.num_kv_heads)
        and len(slots)
    ):
        _gather_runs(pool, layers, slots.numpy(), out)
        return
    dev = slots.device
    lay = torch.as_tensor(list(layers), dtype=torch.int64, device=dev)
    planes = (lay[:, None] * 2 + torch.arange(2, device=dev)[None, :])[:, :, None]  # [l, 2, 1]
    num_slots = shape.num_pages * shape.page_size
    if shape.layout == KVLayout.NHD:
        rows = pool.buffer.view(-1, shape.num_kv_heads, shape.head_dim)  # [L*2*slots, H, D]
        if (hs, he) != (0, shape.num_kv_heads):
            rows = rows[:, hs:he]
        index = planes * num_slots + slots[None, None, :]  # [l, 2, n]
        torch.index_select(rows, 0, index.reshape(-1), out=out.view(-1, he - hs, shape.head_dim))
        return
    # HND: row of [layer, kv, page, head, offset] in the pool seen as [rows, D].
    token_rows = (slots // shape.page_size) * shape.num_kv_heads * shape.page_size
    token_rows = token_rows + slots % shape.page_size  # [n]
    head_rows = torch.arange(hs, he, device=dev) * shape.page_size  # [h]
    index = (planes * num_slots * shape.num_kv_heads)[..., None] + (
        token_rows[None, None, :, None] + head_rows[None, None, None, :]
    )  # [l, 2, n, h]
    rows = pool.buffer.view(-1, shape.head_dim)
    torch.index_select(rows, 0, index.reshape(-1), out=out.view(-1, shape.head_dim))


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
    if shape.layout == KVLayout.NHD and (hs, he) == (0, shape.num_kv_heads) and len(slots):
        num_slots = shape.num_pages * shape.page_size
        tokens = cell_tokens(slots, num_slots)
        cell = np.dtype(f"V{tokens * shape.num_kv_heads * head_bytes}")
        dst = raw.reshape(shape.num_layers, 2, -1).view(cell)  # [L, 2, num_slots / tokens]
        src = data.reshape(*data.shape[:2], -1).view(cell)  # [l, 2, n / tokens]
        dst[lay, kv, slots[None, None, ::tokens] // tokens] = src
        return
    if shape.layout == KVLayout.NHD:
        # A cell is one token's heads [hs, he): contiguous inside its row.
        rows = raw.reshape(
            shape.num_layers, 2, shape.num_pages * shape.page_size, shape.num_kv_heads * head_bytes
        )[..., hs * head_bytes : he * head_bytes]
        cell = np.dtype(f"V{(he - hs) * head_bytes}")
        dst = rows.view(cell)[..., 0]  # [L, 2, slots]
        src = data.reshape(*data.shape[:3], -1).view(cell)[..., 0]  # [l, 2, n]
        dst[lay, kv, slots[None, None, :]] = src
        return
    cell = np.dtype(f"V{head_bytes}")
    cells = raw.reshape(
        shape.num_layers, 2, shape.num_pages, shape.num_kv_heads, shape.page_size, head_bytes
    ).view(cell)[..., 0]  # [L, 2, P, H, page]
    src = data.view(cell)[..., 0]  # [l, 2, n, h]
    pages = (slots // shape.page_size)[None, None, :, None]
    offsets = (slots % shape.page_size)[None, None, :, None]
    head_ids = np.arange(hs, he)[None, None, None, :]
    cells[lay[..., None], kv[..., None], pages, head_ids, offsets] = src


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
