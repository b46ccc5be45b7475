"""Rank arithmetic of one instance of dp × cp × tp × pp ranks. Pure: no torch.

Global rank order: `((dp_rank * cp + cp_rank) * tp + tp_rank) * pp + pp_rank`,
so the ranks of one dp group are contiguous and pp is the fastest axis.

Roles:
- a dp group (cp × tp × pp ranks) is an independent engine with its own
  scheduler; its *leader* is cp = tp = pp = 0;
- a tp group (same dp, cp, pp) all-reduces the row-parallel projections;
- a pipeline (same dp, cp, tp) passes hidden states stage to stage.

Context parallelism (prefill only) is simplified for now: every cp rank
computes the whole prompt redundantly and holds its full KV, but *owns*
only a contiguous token range (`cp_token_range`) — the range it reports and
sends to decode. The split is by token, so it is the same whatever the page
size. Only the cp = 0 replica returns sampled tokens to the leader.
"""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """A topology or rank coordinate is invalid; the message says which."""


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def group_size(self) -> int:
        """Ranks in one dp group."""
        return self.cp * self.tp * self.pp

    def rank_of(self, dp: int, cp: int, tp: int, pp: int) -> int:
        for name, value, size in (
            ("dp", dp, self.dp),
            ("cp", cp, self.cp),
            ("tp", tp, self.tp),
            ("pp", pp, self.pp),
        ):
            if not 0 <= value < size:
                raise TopologyError(f"{name} rank {value} is outside [0, {size})")
        return ((dp * self.cp + cp) * self.tp + tp) * self.pp + pp

    def rank_info(self, rank: int) -> RankInfo:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside world size {self.world_size}")
        rest, pp = divmod(rank, self.pp)
        rest, tp = divmod(rest, self.tp)
        dp, cp = divmod(rest, self.cp)
        return RankInfo(self, dp, cp, tp, pp)

    def dp_group_ranks(self, dp: int) -> list[int]:
        return [
            self.rank_of(dp, c, t, p)
            for c in range(self.cp)
            for t in range(self.tp)
            for p in range(self.pp)
        ]

    def tp_groups(self) -> list[list[int]]:
        """Every tp group, in a fixed order (every process must create them alike)."""
        return [
            [self.rank_of(d, c, t, p) for t in range(self.tp)]
            for d in range(self.dp)
            for c in range(self.cp)
            for p in range(self.pp)
        ]

    def dp_groups(self) -> list[list[int]]:
        return [self.dp_group_ranks(d) for d in range(self.dp)]


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits in its instance."""

    parallel: ParallelConfig
    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int

    @property
    def rank(self) -> int:
        return self.parallel.rank_of(self.dp_rank, self.cp_rank, self.tp_rank, self.pp_rank)

    @property
    def is_leader(self) -> bool:
        return self.cp_rank == 0 and self.tp_rank == 0 and self.pp_rank == 0

    @property
    def leader_rank(self) -> int:
        return self.parallel.rank_of(self.dp_rank, 0, 0, 0)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.parallel.pp - 1

    @property
    def returns_tokens(self) -> bool:
        """The one rank of the group that samples and hands tokens to the leader."""
        return self.is_last_stage and self.cp_rank == 0 and self.tp_rank == 0

    @property
    def sampler_rank(self) -> int:
        return self.parallel.rank_of(self.dp_rank, 0, 0, self.parallel.pp - 1)

    def stage_rank(self, pp: int) -> int:
        """Global rank of stage `pp` in this rank's pipeline."""
        return self.parallel.rank_of(self.dp_rank, self.cp_rank, self.tp_rank, pp)

    def layer_range(self, num_layers: int) -> range:
        return layer_range(num_layers, self.parallel.pp, self.pp_rank)

    def kv_head_range(self, num_kv_heads: int) -> range:
        tp = self.parallel.tp
        if num_kv_heads % tp:
            raise TopologyError(
                f"num_kv_heads ({num_kv_heads}) is not divisible by tp ({tp}); "
                "choose a tp that divides the KV heads"
            )
        size = num_kv_heads // tp
        return range(self.tp_rank * size, (self.tp_rank + 1) * size)

    def cp_token_range(self, num_tokens: int) -> range:
        """Prompt tokens whose KV this rank owns (and sends) under cp."""
        return split_range(num_tokens, self.parallel.cp, self.cp_rank)


def split_range(total: int, parts: int, index: int) -> range:
    """Part `index` of [0, total) cut into `parts` contiguous, near-equal ranges.

    The first `total % parts` parts are one longer; parts may be empty when
    total < parts.
    """
    if total < 0 or parts < 1 or not 0 <= index < parts:
        raise TopologyError(f"cannot take part {index} of {parts} from {total}")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def layer_range(num_layers: int, pp: int, pp_rank: int) -> range:
    """Contiguous layers of pipeline stage `pp_rank`; every stage gets at least one."""
    if pp > num_layers:
        raise TopologyError(f"pp ({pp}) exceeds the model's {num_layers} layers")
    return split_range(num_layers, pp, pp_rank)
