"""The shape of one rank's paged KV pool: what a transport needs to know of it.

Sizes (layers, pages, tokens per page, KV heads, head size), the dtype, and
where rows lie (`layout`: one of our layouts or any `KVOrder`); whether a
page's interior is the engine's own (`whole_pages`). The pool itself, the
torch tensor, is `kv_pool.KVPool`; this module is what pure code (NIXL
descriptor plans, the vLLM connector's layout check) reads without torch.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.runtime.engine.kv_order import KVOrder
from pdcluster.runtime.spec import KVDtype, KVLayout


@dataclass(frozen=True)
class KVPoolShape:
    num_layers: int  # layers held by this rank (its pp range)
    num_pages: int
    page_size: int
    num_kv_heads: int  # kv heads held by this rank (its tp slice)
    head_dim: int
    dtype: str = "float32"
    # One of our layouts, or any physical order of the axes (`kv_order.py`).
    layout: KVLayout | KVOrder = KVLayout.NHD
    # The engine keeps a page's interior in a layout of its own (rows are not
    # tokens): only whole pages may move (`transfer/page_span.py`).
    whole_pages: bool = False

    @property
    def order(self) -> KVOrder:
        return KVOrder.of(self.layout)

    def row_strides(self) -> dict[str, int]:
        """Rows of head_dim values between neighbours along each axis (`KVOrder.row_strides`)."""
        return self.order.row_strides(
            self.num_layers, self.num_pages, self.page_size, self.num_kv_heads
        )

    @property
    def numel(self) -> int:
        return (
            self.num_layers
            * 2
            * self.num_pages
            * self.page_size
            * self.num_kv_heads
            * self.head_dim
        )

    @property
    def nbytes(self) -> int:
        itemsize = KVDtype.itemsize_of(self.dtype)
        if itemsize is None:
            raise ValueError(f"kv dtype {self.dtype!r} is not one of {[str(d) for d in KVDtype]}")
        return self.numel * itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K+V for one token over all local layers and heads."""
        return self.nbytes // (self.num_pages * self.page_size)

    def dims(self) -> tuple[int, ...]:
        """The buffer's dims in physical order, head_dim last ([L, 2, P, ...] for our layouts)."""
        outer = self.order.sizes_in_order(
            self.num_layers, self.num_pages, self.page_size, self.num_kv_heads
        )
        return (*outer, self.head_dim)
