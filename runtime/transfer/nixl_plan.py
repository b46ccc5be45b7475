"""Descriptor planning for the `nixl` backend (pure: numpy only, no NIXL, no torch).

A NIXL WRITE moves a list of (source offset, destination offset, bytes)
descriptors from this rank's registered pool into the peer's. This module
turns what a frame moves (token runs, layer pairs, a head slice) into that
list for two pools of known geometry:

- token runs are `(src_slot, dst_slot, length)`, consecutive on both sides
  and inside one page on each (`shm.copy_runs` cuts them), so a run is
  contiguous per (layer, K|V, head) where tokens are the innermost axis
  (HND, vLLM's CPU pages), per (layer, K|V) with every head in NHD, and one
  row per token and head in any other order (`engine/kv_order.py`);
- heterogeneous TP is the head slice (`src_heads` of ours land in the
  peer's `dst_heads`), PP the layer pairs, CP the token positions the runs
  already carry;
- descriptors that follow each other on both sides are merged, so whole
  pages (or whole runs of pages) move as one descriptor when heads and
  layouts allow.

Invariants: every descriptor lies inside both pools (`[0, nbytes)`), the
bytes written are exactly those of the named tokens, layers and heads, and
two geometries that cannot be paired byte for byte (dtype, head_dim,
axis order) are refused by `check_geometries` before any room uses them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdcluster.runtime.engine.kv_order import KVOrder
from pdcluster.runtime.spec import KVLayout

ITEM_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class PlanError(ValueError):
    """Two pools, or a frame, that NIXL descriptors cannot express; the message says why."""


@dataclass(frozen=True)
class RegionGeometry:
    """How a rank's KV pool lies in its registered region: one dense buffer
    starting at offset 0, its axes in `layout`'s order ([L, 2, P, ps, H, D]
    for NHD, [L, 2, P, H, ps, D] for HND, any order `KVOrder` names)."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: KVLayout | KVOrder

    @property
    def order(self) -> KVOrder:
        return KVOrder.of(self.layout)

    @functools.cached_property
    def byte_strides(self) -> dict[str, int]:
        """Bytes between neighbours along each axis (L, K, P, N, H)."""
        row = self.head_dim * self.item_size
        rows = self.order.row_strides(
            self.num_layers, self.num_pages, self.page_size, self.num_kv_heads
        )
        return {axis: stride * row for axis, stride in rows.items()}

    def __post_init__(self) -> None:
        if self.dtype not in ITEM_SIZES:
            raise PlanError(f"kv dtype {self.dtype!r} is not one of {sorted(ITEM_SIZES)}")
        for name in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def item_size(self) -> int:
        return ITEM_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return (
            self.num_layers
            * 2
            * self.num_pages
            * self.page_size
            * self.num_kv_heads
            * self.head_dim
            * self.item_size
        )

    def offsets(
        self,
        layer: np.ndarray,
        kv: np.ndarray,
        slot: np.ndarray,
        head: np.ndarray,
    ) -> np.ndarray:
        """Byte offsets of element (layer, kv, slot, head, 0); arrays broadcast."""
        page, tok = np.divmod(slot, self.page_size)
        s = self.byte_strides
        out: np.ndarray = (
            layer * s["L"] + kv * s["K"] + page * s["P"] + tok * s["N"] + head * s["H"]
        )
        return out


def check_geometries(src: RegionGeometry, dst: RegionGeometry) -> None:
    """Raise PlanError if no descriptor list can pair these pools byte for byte."""
    if src.dtype != dst.dtype:
        raise PlanError(f"kv dtype differs: ours {src.dtype}, the peer's {dst.dtype}")
    if src.head_dim != dst.head_dim:
        raise PlanError(f"head_dim differs: ours {src.head_dim}, the peer's {dst.head_dim}")
    if src.order != dst.order:
        raise PlanError(
            f"kv layout differs: ours {src.order.name}, the peer's {dst.order.name} "
            "(a WRITE copies bytes; it cannot transpose pages)"
        )


def plan_descriptors(
    src: RegionGeometry,
    dst: RegionGeometry,
    runs: Sequence[tuple[int, int, int]],
    layer_pairs: Sequence[tuple[int, int]],
    src_heads: tuple[int, int],
    dst_heads: tuple[int, int],
) -> np.ndarray:
    """[n, 3] int64 (src_offset, dst_offset, nbytes), merged, in source order.

    `runs`: (src_slot, dst_slot, length) token runs, each inside one page on
    both sides; `layer_pairs`: (our layer, the peer's layer); heads
    `[start, end)` on each side, of equal size.
    """
    check_geometries(src, dst)
    num_heads = src_heads[1] - src_heads[0]
    if num_heads < 1 or dst_heads[1] - dst_heads[0] != num_heads:
        raise PlanError(f"head slices {src_heads} and {dst_heads} differ in size or are empty")
    if src_heads[0] < 0 or src_heads[1] > src.num_kv_heads:
        raise PlanError(f"our heads {src_heads} outside 0..{src.num_kv_heads}")
    if dst_heads[0] < 0 or dst_heads[1] > dst.num_kv_heads:
        raise PlanError(f"the peer's heads {dst_heads} outside 0..{dst.num_kv_heads}")
    if not layer_pairs:
        raise PlanError("no layers to move")
    lp = np.asarray(layer_pairs, dtype=np.int64).reshape(-1, 2)
    if lp[:, 0].min() < 0 or lp[:, 0].max() >= src.num_layers:
        raise PlanError(f"our layers {lp[:, 0].tolist()} outside 0..{src.num_layers - 1}")
    if lp[:, 1].min() < 0 or lp[:, 1].max() >= dst.num_layers:
        raise PlanError(f"the peer's layers {lp[:, 1].tolist()} outside 0..{dst.num_layers - 1}")
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    if len(r) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    _check_runs(r, src, "our")
    _check_runs(r[:, [1, 0, 2]], dst, "the peer's")

    whole_rows = num_heads == src.num_kv_heads == dst.num_kv_heads
    row_bytes = src.head_dim * src.item_size
    order = src.order
    if order.heads_within_tokens and whole_rows:
        # A run's tokens carry every head: the run is one block per (layer, K|V).
        heads = np.zeros(1, dtype=np.int64)
        src_slot, dst_slot = r[:, 0:1], r[:, 1:2]  # [runs, 1]
        nbytes = r[:, 2:3] * num_heads * row_bytes
    elif order.tokens_innermost:
        # HND-like: a run is contiguous per head.
        heads = np.arange(num_heads, dtype=np.int64)
        src_slot, dst_slot = r[:, 0:1], r[:, 1:2]  # [runs, 1] x heads
        nbytes = np.broadcast_to(r[:, 2:3] * row_bytes, (len(r), num_heads))
    else:
        # Token by token: a head slice of NHD is contiguous per token; any other
        # order is one row per (token, head), merged below where rows follow.
        lengths = r[:, 2]
        within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        src_slot = (np.repeat(r[:, 0], lengths) + within)[:, None]  # [tokens, 1]
        dst_slot = (np.repeat(r[:, 1], lengths) + within)[:, None]
        if order.heads_within_tokens:
            heads = np.zeros(1, dtype=np.int64)
            nbytes = np.full_like(src_slot, num_heads * row_bytes)
        else:
            heads = np.arange(num_heads, dtype=np.int64)
            nbytes = np.full((len(src_slot), num_heads), row_bytes, dtype=np.int64)
    sl = lp[:, 0][:, None, None, None]
    dl = lp[:, 1][:, None, None, None]
    kv = np.arange(2, dtype=np.int64)[None, :, None, None]
    s_off = src.offsets(sl, kv, src_slot[None, None], src_heads[0] + heads[None, None, None])
    d_off = dst.offsets(dl, kv, dst_slot[None, None], dst_heads[0] + heads[None, None, None])
    size = np.broadcast_to(nbytes[None, None], s_off.shape)
    table = np.stack([s_off.ravel(), d_off.ravel(), size.ravel()], axis=1)
    if order.layout is None:
        # The rows above go layer pair, K|V, run (or token), head: our layouts'
        # memory order. In another order (vLLM's pages put K|V inside a page)
        # rows that follow each other sit apart there: sort to merge them.
        table = table[np.argsort(table[:, 0], kind="stable")]
    return merge_descriptors(table)


def merge_descriptors(table: np.ndarray) -> np.ndarray:
    """Merge consecutive rows that continue each other on both sides."""
    if len(table) < 2:
        return table.astype(np.int64, copy=True)
    src, dst, size = table[:, 0], table[:, 1], table[:, 2]
    follows = (src[:-1] + size[:-1] == src[1:]) & (dst[:-1] + size[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    merged = np.stack([src[starts], dst[starts], np.add.reduceat(size, starts)], axis=1)
    return merged.astype(np.int64, copy=False)


def _check_runs(r: np.ndarray, geo: RegionGeometry, whose: str) -> None:
    start, length = r[:, 0], r[:, 2]
    if length.min() < 1:
        raise PlanError("a token run is empty")
    num_slots = geo.num_pages * geo.page_size
    if start.min() < 0 or (start + length).max() > num_slots:
        raise PlanError(f"{whose} slots outside the pool's 0..{num_slots - 1}")
    if ((start % geo.page_size) + length > geo.page_size).any():
        raise PlanError(f"a token run crosses one of {whose} page boundaries")


# ---- page units: descriptor lists prepared once per registration ------------
#
# A pool is also a row of equal tiles, its *page units*: one per (layer, K|V,
# page) in NHD, one per (layer, K|V, page, head) where tokens are the innermost
# axis (HND, vLLM's CPU pages); unit i starts at byte i * unit_bytes. An order
# with neither (K|V inside a token) has no units: descriptors move its frames.
# NIXL prepares a descriptor list of every unit of a pool
# once (ours at start, a peer's when it registers), and a frame then names
# units by index instead of building and checking descriptors per WRITE. A
# run moves as page units only when it is one whole page on both sides and
# the units carry exactly the frame's heads (NHD: every head on both sides);
# the rest of a frame (a partial first or last page, NHD head slices) keeps
# per-frame descriptors from `plan_descriptors`.

MAX_UNITS = 2**31 - 1  # NIXL takes unit indices as int32


def has_page_units(geo: RegionGeometry) -> bool:
    """Whether a page of one (layer, K|V), or of one head of it, is one block of bytes."""
    return geo.order.tokens_innermost or geo.order.heads_within_tokens


def unit_bytes(geo: RegionGeometry) -> int:
    """Bytes of one page unit: a page of every head (NHD) or of one head (HND-like)."""
    if not has_page_units(geo):
        raise PlanError(f"a pool in order {geo.order.name} has no page units")
    heads = 1 if geo.order.tokens_innermost else geo.num_kv_heads
    return geo.page_size * heads * geo.head_dim * geo.item_size


def num_units(geo: RegionGeometry) -> int:
    return geo.nbytes // unit_bytes(geo)


def page_units(geo: RegionGeometry) -> np.ndarray:
    """[units, 2] int64 (offset, nbytes) of every page unit of the pool, in index order."""
    n = num_units(geo)
    if n > MAX_UNITS:
        raise PlanError(f"a pool of {n} page units exceeds NIXL's {MAX_UNITS} descriptors")
    size = unit_bytes(geo)
    return np.stack([np.arange(n, dtype=np.int64) * size, np.full(n, size, np.int64)], axis=1)


def can_use_page_units(
    src: RegionGeometry,
    dst: RegionGeometry,
    src_heads: tuple[int, int],
    dst_heads: tuple[int, int],
) -> bool:
    """Whether whole-page runs of this pairing move as page units."""
    if src.page_size != dst.page_size or src.order != dst.order or not has_page_units(src):
        return False
    if src.order.tokens_innermost:
        return True  # a unit is one head: any head slice is a set of units
    return src_heads == (0, src.num_kv_heads) and dst_heads == (0, dst.num_kv_heads)


def split_runs(
    runs: Sequence[tuple[int, int, int]], page_size: int
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """([k, 2] int64 (src_page, dst_page) of the runs that are one whole page on
    both sides, the other runs unchanged)."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    whole = (r[:, 0] % page_size == 0) & (r[:, 1] % page_size == 0) & (r[:, 2] == page_size)
    pages = r[whole][:, :2] // page_size
    rest = [(int(a), int(b), int(n)) for a, b, n in r[~whole]]
    return pages, rest


def whole_pages(
    src_slots: Sequence[int] | np.ndarray, dst_slots: Sequence[int] | np.ndarray, page_size: int
) -> np.ndarray | None:
    """[k, 2] int64 (src_page, dst_page) if the frame's tokens are whole pages on both
    sides (each page's tokens in order), else None: what `split_runs` of the frame's
    `copy_runs` gives for such a frame, without building the run list."""
    # Plain Python over the slot lists: this runs before a job's first WRITE, with
    # caches cold from the last job's bytes, where a dozen numpy calls on a few pages
    # cost ~50 us and this loop ~15 us (a list compare per page runs in C).
    src, dst = _as_list(src_slots), _as_list(dst_slots)
    n = len(src)
    if n == 0 or n % page_size or len(dst) != n:
        return None
    pairs: list[tuple[int, int]] = []
    for i in range(0, n, page_size):
        s0, d0 = src[i], dst[i]
        if s0 % page_size or d0 % page_size:
            return None
        if src[i : i + page_size] != list(range(s0, s0 + page_size)):
            return None
        if dst[i : i + page_size] != list(range(d0, d0 + page_size)):
            return None
        pairs.append((s0 // page_size, d0 // page_size))
    return np.array(pairs, dtype=np.int64)


def _as_list(slots: Sequence[int] | np.ndarray) -> list[int]:
    if isinstance(slots, list):
        return slots
    if isinstance(slots, np.ndarray):
        out: list[int] = slots.tolist()
        return out
    return list(slots)


def page_unit_grid(
    src: RegionGeometry,
    dst: RegionGeometry,
    pages: np.ndarray,
    layer_pairs: Sequence[tuple[int, int]],
    src_heads: tuple[int, int],
    dst_heads: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """int32 unit indices (ours, the peer's), pair by pair, that move `pages`
    ([k, 2] (src_page, dst_page)) of the given layers and heads, shaped
    [layer pairs, 2, pages, heads] (heads 1 in NHD).

    Raveled, that is the source's memory order (layer pair, K|V, page, head),
    so units that follow each other on both sides stay neighbours in the
    list. Computed once per job: a frame of pages `[p0, p1)` of the job then
    takes `frame_page_units(grid, p0, p1)` instead of planning its own.
    """
    if not can_use_page_units(src, dst, src_heads, dst_heads):
        raise PlanError("these pools or head slices cannot move as page units")
    num_heads = src_heads[1] - src_heads[0]
    if num_heads < 1 or dst_heads[1] - dst_heads[0] != num_heads:
        raise PlanError(f"head slices {src_heads} and {dst_heads} differ in size or are empty")
    # Checked in plain Python (a job has a few pages, a few dozen layers): numpy
    # calls on arrays this small cost more than the loop, most of all cold.
    p = np.asarray(pages, dtype=np.int64).reshape(-1, 2)
    src_pages, dst_pages = p.T.tolist()
    for col, geo, whose in ((src_pages, src, "our"), (dst_pages, dst, "the peer's")):
        if col and (min(col) < 0 or max(col) >= geo.num_pages):
            raise PlanError(f"{whose} pages outside 0..{geo.num_pages - 1}")
    src_layers, dst_layers = zip(*layer_pairs, strict=True) if layer_pairs else ((), ())
    return (
        _grid_side(src, src_layers, src_heads[0], num_heads, p[:, 0], "our"),
        _grid_side(dst, dst_layers, dst_heads[0], num_heads, p[:, 1], "the peer's"),
    )


def _grid_side(
    geo: RegionGeometry,
    layers: tuple[int, ...],
    first_head: int,
    num_heads: int,
    pages: np.ndarray,
    whose: str,
) -> np.ndarray:
    """One side of `page_unit_grid`: [layers, 2, pages, heads] int32."""
    # Unit of (layer, kv, page, head) = its byte offset / unit_bytes (head 0 in
    # NHD): a per-layer base that jobs share, plus page * (units per page step).
    base = _unit_bases(geo, layers, first_head, num_heads, whose)
    first_units = pages.astype(np.int32) * np.int32(geo.byte_strides["P"] // unit_bytes(geo))
    grid: np.ndarray = base + first_units[None, None, :, None]  # int32 + int32: a new array
    return grid


@functools.lru_cache(maxsize=256)
def _unit_bases(
    geo: RegionGeometry, layers: tuple[int, ...], first_head: int, num_heads: int, whose: str
) -> np.ndarray:
    """[layers, 2, 1, heads] int32 unit index of page 0 of each (layer, K|V, head): the
    same for every job with these layers and heads, so worked out once (read-only).
    int32 is what NIXL takes; `num_units` keeps every index below MAX_UNITS."""
    if layers and (min(layers) < 0 or max(layers) >= geo.num_layers):
        raise PlanError(f"{whose} layers outside 0..{geo.num_layers - 1}")
    layer = np.asarray(layers, dtype=np.int64).reshape(-1, 1, 1, 1)
    kv = np.arange(2, dtype=np.int64).reshape(1, 2, 1, 1)
    s = geo.byte_strides
    offset = layer * s["L"] + kv * s["K"]
    if geo.order.tokens_innermost:
        heads = first_head + np.arange(num_heads, dtype=np.int64).reshape(1, 1, 1, -1)
        offset = offset + heads * s["H"]
    bases = (offset // unit_bytes(geo)).astype(np.int32)
    bases.flags.writeable = False
    return bases


def frame_page_units(grid: np.ndarray, p0: int, p1: int) -> np.ndarray:
    """The int32 unit indices of pages `[p0, p1)` of a job's `page_unit_grid`, in the
    order `page_unit_grid` of those pages alone gives, raveled."""
    if not 0 <= p0 <= p1 <= grid.shape[2]:
        raise PlanError(f"pages {p0}..{p1} outside the job's 0..{grid.shape[2]}")
    return np.ascontiguousarray(grid[:, :, p0:p1]).ravel()
