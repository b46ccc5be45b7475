"""Paged KV pool of one rank: the memory the transfer engine moves.

One contiguous tensor holds every local layer's K and V pages, so a transport
can address it as a single buffer (a shared-memory file for `shm`, one pinned
region for GPU staging). A *slot* is one token position inside one page:
`slot = page * page_size + offset`. Page tables (per request, owned by the
scheduler) map token position t to slot `page_table[t // page_size] *
page_size + t % page_size`.

Layouts (per layer, per K/V):
- NHD: [num_pages, page_size, num_kv_heads, head_dim]
- HND: [num_pages, num_kv_heads, page_size, head_dim]
Any other physical order of the axes (`kv_order.py`) describes memory laid
out by another engine (vLLM's KV cache, wrapped with `KVPool.over`); the
methods below read and write every order alike through `logical`.

Invariant: the pool never frees or reuses pages by itself; the page allocator
(pure, no torch) decides ownership, this module only reads and writes bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdcluster.runtime.engine.kv_order import NHD_ORDER
from pdcluster.runtime.engine.kv_shape import KVPoolShape as KVPoolShape

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


class KVPool:
    """The KV pages of one rank, as one contiguous tensor.

    `shm_path`: when given, the pool lives in that shared-memory file (created
    if missing) so a same-node peer can map it and write into it directly.
    `KVPool.over(buffer, shape)` wraps memory another engine owns instead.
    """

    def __init__(
        self,
        shape: KVPoolShape,
        device: str | torch.device = "cpu",
        shm_path: str | None = None,
        *,
        buffer: torch.Tensor | None = None,
    ) -> None:
        self.shape = shape
        self.device = torch.device(device) if buffer is None else buffer.device
        self.shm_path = shm_path
        dtype = DTYPES[shape.dtype]
        if buffer is not None:
            self.buffer = buffer
        elif shm_path is not None:
            if self.device.type != "cpu":
                raise ValueError("a shared-memory KV pool must live on the CPU")
            flat = torch.from_file(shm_path, shared=True, size=shape.numel, dtype=dtype)
            self.buffer = flat.view(shape.dims())  # physical order, [L, 2, P, ...] for ours
        else:
            self.buffer = torch.zeros(shape.dims(), dtype=dtype, device=self.device)
        self.order = shape.order
        # The same memory seen as [L, 2, P, page, H, D] whatever the order (a view).
        self.logical = self.buffer.permute(self.order.logical_permutation())

    @classmethod
    def over(cls, buffer: torch.Tensor, shape: KVPoolShape) -> KVPool:
        """A pool over memory another engine allocated and keeps writing.

        `buffer` must be one contiguous tensor of `shape.dims()` and its dtype:
        the transports address it as one region (NIXL registers it whole).
        """
        if tuple(buffer.shape) != shape.dims():
            raise ValueError(f"buffer dims {tuple(buffer.shape)} != the shape's {shape.dims()}")
        if buffer.dtype != DTYPES[shape.dtype]:
            raise ValueError(f"buffer dtype {buffer.dtype} != the shape's {shape.dtype}")
        if not buffer.is_contiguous():
            raise ValueError("a KV pool's buffer must be one contiguous tensor")
        return cls(shape, buffer=buffer)

    @property
    def rows(self) -> torch.Tensor:
        """The whole pool as [num_rows, head_dim]: row r = `row_strides` coordinates."""
        return self.buffer.view(-1, self.shape.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of n tokens. slots: [n] int64; k, v: [n, H, D]."""
        for kv, src in ((0, k), (1, v)):
            self._scatter(layer, kv, slots, src.to(self.dtype), slice(None))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots: each [n, H, D]."""
        return (
            self._gather(layer, 0, slots, slice(None)),
            self._gather(layer, 1, slots, slice(None)),
        )

    def read_pages(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """K and V of whole pages (`pages`: any shape S) in one gather.

        Returns [2, *S, page_size, H, D] in any order (a view of the gathered
        copy: token-major, as attention reads a context).
        """
        if self.order == NHD_ORDER:
            return self.buffer[layer][:, pages]  # [2, *S, page, H, D]
        return self.logical[layer][:, pages]

    def gather_tokens(
        self, layers: Sequence[int], slots: torch.Tensor, heads: slice = slice(None)
    ) -> torch.Tensor:
        """Copy K/V of `slots` for `layers` and a head slice into one new tensor.

        Returns [len(layers), 2, n, h, D], contiguous: the frame a transport sends.
        """
        parts = [
            torch.stack([self._gather(layer, kv, slots, heads) for kv in (0, 1)])
            for layer in layers
        ]
        return torch.stack(parts).contiguous()

    def scatter_tokens(
        self,
        layers: Sequence[int],
        slots: torch.Tensor,
        frame: torch.Tensor,
        heads: slice = slice(None),
    ) -> None:
        """Inverse of gather_tokens: frame [len(layers), 2, n, h, D] into slots."""
        for i, layer in enumerate(layers):
            for kv in (0, 1):
                self._scatter(layer, kv, slots, frame[i, kv].to(self.dtype), heads)

    def _gather(self, layer: int, kv: int, slots: torch.Tensor, heads: slice) -> torch.Tensor:
        if self.order == NHD_ORDER:
            flat = self.buffer[layer, kv].view(-1, self.shape.num_kv_heads, self.shape.head_dim)
            return flat[slots][:, heads]
        ps = self.shape.page_size
        t = self.logical[layer, kv]  # [P, page, H, D], strided
        return t[slots // ps, slots % ps][:, heads]  # [n, h, D]

    def _scatter(
        self, layer: int, kv: int, slots: torch.Tensor, src: torch.Tensor, heads: slice
    ) -> None:
        if self.order == NHD_ORDER:
            flat = self.buffer[layer, kv].view(-1, self.shape.num_kv_heads, self.shape.head_dim)
            if heads == slice(None):
                flat.index_copy_(0, slots, src)
            else:
                flat[slots, heads] = src
            return
        ps = self.shape.page_size
        # Writes through the strided view into the pool's memory: [n, h, D].
        self.logical[layer, kv][slots // ps, slots % ps, heads] = src


def slots_for_positions(
    page_table: Sequence[int], positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Map token positions to slots through a request's page table."""
    table = torch.as_tensor(page_table, dtype=torch.int64)
    return table[positions // page_size] * page_size + positions % page_size
