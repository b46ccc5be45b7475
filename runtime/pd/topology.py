"""Which prefill rank sends which part of a room's KV to which decode rank.

Inputs: the prefill and decode instance shapes (`dp × cp × tp × pp`) and the
model's `num_layers` / `num_kv_heads`. Output: for every decode rank its
*sources* — one `KVSlice` per prefill rank it must hear from — and for every
prefill rank its *destinations*. Both sides compute the same slices from the
same inputs, so neither has to trust the other's arithmetic.

Rules (docs/design.md §2):
- dp: a room's prefill dp group is `room % prefill.dp`, on both legs. A
  request may name it (`data_parallel_rank`) only to say the same thing:
  any other value fails at once (`prefill_dp_group`), since the two legs
  would otherwise meet in different groups and wait for each other until a
  timeout. Decode dp groups are chosen by the decode instance itself.
  The mapping is between one prefill dp group and one decode dp group.
- tp: KV heads split evenly and contiguously over tp ranks; `num_kv_heads`
  must divide by both tp sizes. A decode rank receives its heads from every
  prefill rank holding part of them (prefill tp > decode tp: several
  sources; prefill tp < decode tp: one prefill rank feeds several decode
  ranks). With `replicated_kv` (MLA-style) every tp rank holds all heads:
  decode tp rank t gets real data from prefill tp rank `t % prefill.tp`,
  and prefill tp ranks no decode rank reads from send *dummy* completions
  to decode tp rank `t % decode.tp`, so every rank's poll still concludes.
- pp: layers split in contiguous ranges, the first `num_layers % pp` stages
  one layer longer (`layer_range`). Decode pp is 1 or equal to prefill pp.
- cp: prefill only (decode cp must be 1). Cp rank r owns a contiguous,
  page-aligned token range: the prompt's pages `ceil(n / page_size)` split
  like layers, then clipped to n tokens (`cp_token_range`). A cp rank whose
  range is empty still reports Success. The prefill engine must partition
  its KV the same way.
- `required_responses(decode_rank)` = number of distinct prefill ranks among
  its sources (dummies included): a room succeeds only when all reported.

Every (layer, head, token) a decode rank holds is covered by exactly one
real slice; tests check this for every supported combination.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from pdcluster.runtime.engine import topology as engine_topology
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.spec import Topology, pages_for

Span = tuple[int, int]  # half-open [start, end)


class TopologyError(ValueError):
    """An unsupported prefill/decode/model combination; the message names the values."""


class DpRankConflict(ValueError):
    """A request named a prefill dp group other than `room % dp`; the message names both."""


def prefill_dp_group(room: int, num_groups: int, data_parallel_rank: int | None = None) -> int:
    """The prefill dp group of `room`: `room % num_groups`, which an explicit rank must equal."""
    if room < 0:
        raise TopologyError(f"room must be non-negative, got {room}")
    if num_groups < 1:
        raise TopologyError(f"prefill dp must be >= 1, got {num_groups}")
    group = room % num_groups
    if data_parallel_rank is not None and data_parallel_rank != group:
        raise DpRankConflict(
            f"dp_rank_conflict: data_parallel_rank {data_parallel_rank} != "
            f"room % {num_groups} = {group}"
        )
    return group


def shape_of(topology: Topology) -> InstanceShape:
    """The InstanceShape of a role's topology in the manifest."""
    return InstanceShape(dp=topology.dp, cp=topology.cp, tp=topology.tp, pp=topology.pp)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    # MLA-style KV: one latent shared by all heads, so every tp rank holds it all.
    replicated_kv: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_kv_heads < 1:
            raise TopologyError(
                f"model needs num_layers >= 1 and num_kv_heads >= 1, got "
                f"num_layers={self.num_layers} num_kv_heads={self.num_kv_heads}"
            )


def split_span(total: int, parts: int, index: int) -> Span:
    """Contiguous near-even split: the first `total % parts` parts get one more.

    The engine's own rule (`engine.topology.split_range`), so the layers and
    heads a rank's KV pool holds and the slices mapped here cannot diverge.
    """
    try:
        part = engine_topology.split_range(total, parts, index)
    except engine_topology.TopologyError as err:
        raise TopologyError(str(err)) from None
    return part.start, part.stop


def layer_range(num_layers: int, pp_size: int, pp_rank: int) -> Span:
    if pp_size > num_layers:
        raise TopologyError(
            f"pp={pp_size} exceeds num_layers={num_layers}: a stage would hold no layer"
        )
    return split_span(num_layers, pp_size, pp_rank)


def head_range(num_kv_heads: int, tp_size: int, tp_rank: int, replicated: bool = False) -> Span:
    if replicated:
        return 0, num_kv_heads
    if num_kv_heads % tp_size:
        raise TopologyError(
            f"num_kv_heads={num_kv_heads} is not divisible by tp={tp_size}; "
            "choose a tp that divides the KV heads"
        )
    return split_span(num_kv_heads, tp_size, tp_rank)


def cp_token_range(num_tokens: int, page_size: int, cp_size: int, cp_rank: int) -> Span:
    """Tokens [start, end) of the prompt whose KV cp rank `cp_rank` holds and sends."""
    first, last = split_span(pages_for(num_tokens, page_size), cp_size, cp_rank)
    return min(first * page_size, num_tokens), min(last * page_size, num_tokens)


def overlap(a: Span, b: Span) -> Span | None:
    """The part of `a` that is also in `b`; None where they share nothing."""
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return (start, end) if start < end else None


def offset_span(span: Span, origin: int) -> Span:
    """Global `span` as offsets from `origin` (where a rank's own part begins)."""
    return span[0] - origin, span[1] - origin


class PoolSpans(NamedTuple):
    """Layers and heads as offsets into one rank's own KV pool (which holds
    only that rank's part of the model)."""

    layers: Span
    heads: Span

    @classmethod
    def within(cls, layers: Span, heads: Span, held_layers: Span, held_heads: Span) -> PoolSpans:
        """Global `layers`/`heads` inside a pool holding `held_layers`/`held_heads`."""
        return cls(offset_span(layers, held_layers[0]), offset_span(heads, held_heads[0]))


@dataclass(frozen=True)
class KVSlice:
    """What one prefill rank sends one decode rank for every room they share.

    Ranges are global model indices; `prefill_local` / `decode_local` give the
    same ranges as offsets into each side's own KV pool (which holds only its rank's part).
    """

    prefill_rank: RankCoord
    decode_rank: RankCoord
    layers: Span
    heads: Span
    prefill_layers: Span  # the whole range the prefill rank holds
    prefill_heads: Span
    decode_layers: Span  # the whole range the decode rank holds
    decode_heads: Span
    cp_size: int
    is_dummy: bool = False

    def token_range(self, num_tokens: int, page_size: int) -> Span:
        if self.is_dummy:
            return 0, 0
        return cp_token_range(num_tokens, page_size, self.cp_size, self.prefill_rank.cp)

    @property
    def prefill_local(self) -> PoolSpans:
        return PoolSpans.within(self.layers, self.heads, self.prefill_layers, self.prefill_heads)

    @property
    def decode_local(self) -> PoolSpans:
        return PoolSpans.within(self.layers, self.heads, self.decode_layers, self.decode_heads)


class PDTopology:
    """The slice tables for one (prefill instance, decode instance, model) triple."""

    def __init__(self, prefill: InstanceShape, decode: InstanceShape, model: ModelShape) -> None:
        if decode.cp != 1:
            raise TopologyError(f"decode cp must be 1 (got {decode.cp}): cp is prefill-only")
        if decode.pp not in (1, prefill.pp):
            raise TopologyError(
                f"decode pp must be 1 or equal prefill pp ({prefill.pp}), got {decode.pp}"
            )
        for role, shape in (("prefill", prefill), ("decode", decode)):
            if not model.replicated_kv and model.num_kv_heads % shape.tp:
                raise TopologyError(
                    f"num_kv_heads={model.num_kv_heads} is not divisible by {role} "
                    f"tp={shape.tp}; choose a tp that divides the KV heads"
                )
            if shape.pp > model.num_layers:
                raise TopologyError(
                    f"{role} pp={shape.pp} exceeds num_layers={model.num_layers}: "
                    "a stage would hold no layer"
                )
        self.prefill = prefill
        self.decode = decode
        self.model = model
        # Slices depend on tp/pp/cp only, not on dp: compute them once for
        # group 0 and re-stamp dp on lookup.
        self._by_decode: dict[RankCoord, tuple[KVSlice, ...]] = {}
        self._by_prefill: dict[RankCoord, tuple[KVSlice, ...]] = {}
        self._build()

    def prefill_dp_for_room(self, room: int, data_parallel_rank: int | None = None) -> int:
        """`prefill_dp_group` over this prefill instance's dp size."""
        return prefill_dp_group(room, self.prefill.dp, data_parallel_rank)

    def _layers(self, shape: InstanceShape, rank: RankCoord) -> Span:
        return layer_range(self.model.num_layers, shape.pp, rank.pp)

    def _heads(self, shape: InstanceShape, rank: RankCoord) -> Span:
        return head_range(self.model.num_kv_heads, shape.tp, rank.tp, self.model.replicated_kv)

    def _build(self) -> None:
        by_decode: dict[RankCoord, list[KVSlice]] = {d: [] for d in self.decode.group(0)}
        by_prefill: dict[RankCoord, list[KVSlice]] = {p: [] for p in self.prefill.group(0)}
        for d in self.decode.group(0):
            d_layers, d_heads = self._layers(self.decode, d), self._heads(self.decode, d)
            for p in self.prefill.group(0):
                p_layers, p_heads = self._layers(self.prefill, p), self._heads(self.prefill, p)
                layers = overlap(d_layers, p_layers)
                heads = overlap(d_heads, p_heads)
                if layers is None or heads is None:
                    continue
                is_dummy = False
                if self.model.replicated_kv and p.tp != d.tp % self.prefill.tp:
                    # Only one prefill tp rank is the real source; the rest
                    # report to a single decode tp rank as dummies.
                    if p.tp % self.decode.tp != d.tp or p.tp < self.decode.tp:
                        continue
                    is_dummy = True
                piece = KVSlice(
                    prefill_rank=p,
                    decode_rank=d,
                    layers=layers,
                    heads=(0, 0) if is_dummy else heads,
                    prefill_layers=p_layers,
                    prefill_heads=p_heads,
                    decode_layers=d_layers,
                    decode_heads=d_heads,
                    cp_size=self.prefill.cp,
                    is_dummy=is_dummy,
                )
                by_decode[d].append(piece)
                by_prefill[p].append(piece)
        self._by_decode = {k: tuple(v) for k, v in by_decode.items()}
        self._by_prefill = {k: tuple(v) for k, v in by_prefill.items()}

    @staticmethod
    def _key(shape: InstanceShape, rank: RankCoord, role: str) -> RankCoord:
        """`rank` as the tables hold it: in dp group 0 (every dp group is alike)."""
        if not shape.contains(rank):
            raise TopologyError(f"{role} rank {rank} is outside the {role} instance ({shape})")
        return _with_dp(rank, 0)

    def sources(self, decode_rank: RankCoord, prefill_dp: int) -> tuple[KVSlice, ...]:
        """The slices decode rank `decode_rank` receives from prefill dp group `prefill_dp`."""
        base = self._by_decode[self._key(self.decode, decode_rank, "decode")]
        _check_dp_group(self.prefill, prefill_dp, "prefill")
        return tuple(
            replace(s, prefill_rank=_with_dp(s.prefill_rank, prefill_dp), decode_rank=decode_rank)
            for s in base
        )

    def required_responses(self, decode_rank: RankCoord) -> int:
        """Distinct prefill ranks that must report Success before the room may decode."""
        base = self._by_decode[self._key(self.decode, decode_rank, "decode")]
        return len({s.prefill_rank for s in base})

    def destinations(self, prefill_rank: RankCoord, decode_dp: int) -> tuple[KVSlice, ...]:
        """The slices prefill rank `prefill_rank` sends into decode dp group `decode_dp`."""
        base = self._by_prefill[self._key(self.prefill, prefill_rank, "prefill")]
        _check_dp_group(self.decode, decode_dp, "decode")
        return tuple(
            replace(s, prefill_rank=prefill_rank, decode_rank=_with_dp(s.decode_rank, decode_dp))
            for s in base
        )

    def num_destinations(self, prefill_rank: RankCoord) -> int:
        """How many decode ranks this prefill rank hears from for one room."""
        return len(self._by_prefill[self._key(self.prefill, prefill_rank, "prefill")])


def _check_dp_group(shape: InstanceShape, dp: int, role: str) -> None:
    if not 0 <= dp < shape.dp:
        raise TopologyError(f"{role} dp group {dp} outside dp={shape.dp}")


def _with_dp(rank: RankCoord, dp: int) -> RankCoord:
    return RankCoord(dp=dp, cp=rank.cp, tp=rank.tp, pp=rank.pp)
