"""Where a paged KV pool keeps each element: the physical order of its axes.

A pool holds one row of `head_dim` values for every (layer, K|V plane, page,
token within the page, kv head); a row's values are contiguous. The five
outer axes may lie in any order in memory, outermost first:

    L  layer            K  the K|V plane (0 = K, 1 = V)
    P  page             N  token within its page
    H  kv head

| order | who lays pages out this way |
| --- | --- |
| `LKPNH` | our engine, `kvCache.layout: NHD` |
| `LKPHN` | our engine, `kvCache.layout: HND` |
| `LPHKN` | vLLM's CPU attention: per page and head, the K block then the V block |
| `LPHNK` | vLLM's FlashAttention-style backends: K and V side by side per token |

Every transfer path (gather into a frame, scatter from one, NIXL
descriptors, shared-memory copies, checksums) addresses rows through
`row_strides`, so a pool of any order moves byte for byte into a pool of the
same order; pools of different orders are refused at the handshake (the
order is the `kv_layout` compatibility field), never transposed in flight.

Invariant: a pool is dense: its rows tile `[0, num_rows)` with no gap, so a
row's index is the sum of its coordinates times their strides.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from pdcluster.runtime.spec import KVLayout

AXES: Final = "LKPNH"

_NAMED: Final = {KVLayout.NHD: "LKPNH", KVLayout.HND: "LKPHN"}


@dataclass(frozen=True)
class KVOrder:
    """The physical order of a pool's outer axes, outermost first (see the module doc)."""

    axes: str

    def __post_init__(self) -> None:
        if len(self.axes) != len(AXES) or sorted(self.axes) != sorted(AXES):
            raise ValueError(
                f"a KV order names each of the axes {AXES!r} once, outermost first; "
                f"got {self.axes!r}"
            )

    @classmethod
    def of(cls, value: KVLayout | KVOrder | str) -> KVOrder:
        """The order of one of our layouts, an order, or its name (`NHD`, `HND`, `LPHKN`…)."""
        if isinstance(value, KVOrder):
            return value
        if isinstance(value, KVLayout):
            return cls(_NAMED[value])
        named = {str(layout): axes for layout, axes in _NAMED.items()}
        return cls(named.get(value, value))

    @property
    def name(self) -> str:
        """`NHD` or `HND` for our engine's layouts, else the axes (the `kv_layout` field)."""
        for layout, axes in _NAMED.items():
            if axes == self.axes:
                return str(layout)
        return self.axes

    @property
    def layout(self) -> KVLayout | None:
        """Our engine's layout with this order, if there is one."""
        for layout, axes in _NAMED.items():
            if axes == self.axes:
                return layout
        return None

    @property
    def tokens_innermost(self) -> bool:
        """A page's tokens of one (layer, plane, head) are consecutive rows (e.g. HND)."""
        return self.axes[-1] == "N"

    @property
    def heads_within_tokens(self) -> bool:
        """A token's heads are consecutive rows and the page's tokens follow each
        other (e.g. NHD): a page of one (layer, plane) is one block of rows."""
        return self.axes.endswith("NH")

    def row_strides(
        self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int
    ) -> dict[str, int]:
        """Rows between neighbours along each axis, for a dense pool of these sizes."""
        sizes = {"L": num_layers, "K": 2, "P": num_pages, "N": page_size, "H": num_kv_heads}
        strides: dict[str, int] = {}
        step = 1
        for axis in reversed(self.axes):
            strides[axis] = step
            step *= sizes[axis]
        return strides

    def sizes_in_order(
        self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int
    ) -> tuple[int, ...]:
        """The pool's outer dims in physical order (head_dim follows them)."""
        sizes = {"L": num_layers, "K": 2, "P": num_pages, "N": page_size, "H": num_kv_heads}
        return tuple(sizes[axis] for axis in self.axes)

    def logical_permutation(self) -> tuple[int, ...]:
        """Dims of a physical-order tensor `[*outer, D]` that give `[L, K, P, N, H, D]`."""
        return (*(self.axes.index(axis) for axis in AXES), len(AXES))


NHD_ORDER: Final = KVOrder.of(KVLayout.NHD)
HND_ORDER: Final = KVOrder.of(KVLayout.HND)
