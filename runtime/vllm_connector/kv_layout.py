"""vLLM's paged KV cache seen as one of our pools: where each (layer, K|V, page, token, head) is.

vLLM allocates one buffer for every attention layer of a rank and hands the
connector one view per layer, `[blocks, heads, tokens, content]` with
`content` = K and V of one head (2 × head_size values). Where the layers,
blocks and heads lie is in the views' strides; how `content` splits into K
and V is the attention backend's own reading, which the strides cannot tell:

| backend | content of one (block, head) | our order | moves |
| --- | --- | --- | --- |
| `CPU_ATTN` | the block's K (transposed by its kernels), then its V | `LPHKN` | whole pages |
| `FLASH_ATTN`, `TRITON_ATTN` | per token, K then V | `LPHNK` (LBHNC) | token rows |

A backend that keeps a page's interior in a layout of its own (CPU_ATTN:
its `vec` kernels write a token's K as a column) moves in whole pages
(`KVPoolShape.whole_pages`, `transfer/page_span.py`); the page is then
opaque to us, so its format (the backend and its kernel ISA) is part of the
`kv_layout` both sides must share.

`describe_vllm_kv` turns the views' numbers and the backend's name into a
`KVPoolShape` whose order locates every row, and checks what our transports
need: one dense buffer (no padding between layers or pages), every view the
same, the layers evenly spaced. A backend missing from the table, or a
layout it cannot be read in, is refused with a message naming it: a wrong
guess would move garbage that decodes without an error.

Pure module (the connector reads the numbers off the tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from pdcluster.runtime.engine.kv_order import KVOrder
from pdcluster.runtime.engine.kv_shape import KVPoolShape

# How an attention backend reads the content of one (block, head) cell.
ContentSplit = Literal["planes", "per_token"]


@dataclass(frozen=True)
class PageFormat:
    split: ContentSplit
    # The interior of a page is the backend's own (not one row per token).
    whole_pages: bool


PAGE_FORMATS: Final[dict[str, PageFormat]] = {
    # [2 * tokens, head_size] viewed as K then V; the kernels transpose K inside.
    "CPU_ATTN": PageFormat("planes", whole_pages=True),
    # content[..., :head_size] is K, the rest V: one row per token and plane.
    "FLASH_ATTN": PageFormat("per_token", whole_pages=False),
    "TRITON_ATTN": PageFormat("per_token", whole_pages=False),
}

DTYPE_NAMES: Final = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class VllmLayoutError(ValueError):
    """vLLM's KV cache cannot be moved by our transports; the message says why."""


@dataclass(frozen=True)
class LayerView:
    """What the connector reads off one layer's KV tensor (elements, not bytes)."""

    shape: tuple[int, int, int, int]  # [blocks, heads, tokens, content]
    strides: tuple[int, int, int, int]
    address: int  # data pointer of element [0, 0, 0, 0], in bytes


@dataclass(frozen=True)
class VllmKV:
    """A rank's KV cache as one of our pools: its shape (with the axis order) and
    the address of its first byte."""

    shape: KVPoolShape
    address: int
    backend: str
    # The compatibility field both sides must share (`CompatInfo.kv_layout`).
    kv_layout: str

    @property
    def nbytes(self) -> int:
        return self.shape.nbytes


def describe_vllm_kv(
    views: Sequence[LayerView],
    *,
    backend: str,
    dtype: str,
    head_size: int,
    kernel: str | None = None,
) -> VllmKV:
    """Our description of a rank's layer views, in layer order; VllmLayoutError if
    the bytes cannot be addressed as one dense pool. `kernel`: the backend's
    kernel variant where it decides a page's interior (CPU_ATTN: its ISA)."""
    page = PAGE_FORMATS.get(backend)
    if page is None:
        raise VllmLayoutError(
            f"attention backend {backend} is not supported by the PDCluster connector "
            f"(supported: {', '.join(sorted(PAGE_FORMATS))}): how it reads K and V "
            "from a KV block is unknown, and a guess would move garbage"
        )
    split = page.split
    if dtype not in DTYPE_NAMES:
        raise VllmLayoutError(f"kv cache dtype {dtype} is not one of {sorted(DTYPE_NAMES)}")
    if not views:
        raise VllmLayoutError("vLLM registered no KV cache layer")
    first = views[0]
    for i, view in enumerate(views[1:], start=1):
        if view.shape != first.shape or view.strides != first.strides:
            raise VllmLayoutError(
                f"layer {i} has shape {view.shape} / strides {view.strides}, "
                f"layer 0 {first.shape} / {first.strides}: one pool needs equal layers"
            )
    blocks, heads, tokens, content = first.shape
    if content != 2 * head_size:
        raise VllmLayoutError(
            f"a KV cell holds {content} values, not K and V of head size {head_size} "
            "(quantized or packed caches are not supported)"
        )
    s_block, s_head, s_token, s_content = first.strides
    if s_content != 1:
        raise VllmLayoutError(f"a KV cell's values are {s_content} apart, not contiguous")
    item = DTYPE_NAMES[dtype]
    # One layer: nothing follows it, so it spans the whole buffer (outermost).
    layer_stride = (
        _layer_stride(views, item) if len(views) > 1 else blocks * heads * tokens * content
    )
    if split == "planes":
        if s_token != content:
            raise VllmLayoutError(
                f"{backend} reads a block's tokens as consecutive K rows then V rows, "
                f"but they are {s_token} values apart (a cell is {content})"
            )
        strides = {"L": layer_stride, "P": s_block, "H": s_head, "K": tokens * head_size}
        strides["N"] = head_size
    else:
        strides = {"L": layer_stride, "P": s_block, "H": s_head, "N": s_token, "K": head_size}
    # An axis of size 1 ties with its inner neighbour (vLLM strides it as if it
    # were longer): it takes its place in vLLM's usual order, so a rank with
    # one KV head per rank (TP = heads) names the same order as one with all.
    usual = "LPHKN" if split == "planes" else "LPHNK"
    axes = "".join(sorted(strides, key=lambda a: (-strides[a], usual.index(a))))
    order = KVOrder(axes)
    shape = KVPoolShape(
        num_layers=len(views),
        num_pages=blocks,
        page_size=tokens,
        num_kv_heads=heads,
        head_dim=head_size,
        dtype=dtype,
        layout=order,
        whole_pages=page.whole_pages,
    )
    sizes = {"L": len(views), "P": blocks, "H": heads, "N": tokens, "K": 2}
    dense = {a: s * head_size for a, s in shape.row_strides().items() if sizes[a] > 1}
    if {a: strides[a] for a in dense} != dense:
        raise VllmLayoutError(
            f"the KV cache is not one dense buffer in order {axes}: strides {strides}, "
            f"dense would be {dense} (padding between layers or blocks is not supported)"
        )
    kv_layout = order.name
    if page.whole_pages:
        kv_layout += f":{backend}" + (f"/{kernel}" if kernel else "")
    return VllmKV(shape, first.address, backend, kv_layout)


def _layer_stride(views: Sequence[LayerView], item: int) -> int:
    """Elements between consecutive layers; they must be evenly spaced upwards."""
    step = views[1].address - views[0].address
    for i in range(1, len(views)):
        if views[i].address - views[i - 1].address != step:
            raise VllmLayoutError("the layers' KV caches are not evenly spaced in one buffer")
    if step <= 0 or step % item:
        raise VllmLayoutError(f"layer 1 starts {step} bytes after layer 0: not one buffer")
    return step // item
