"""Rank coordinates `(dp, cp, tp, pp)` — one process of an instance.

A msgspec Struct so the same value travels in wire messages, keys the
topology tables and fills bootstrap registrations. Frozen and ordered:
usable as a dict key and sortable.

Pure module.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

# 64 is the manifest's bound per dimension; keep a margin for other producers.
MAX_DIM = 1024

RankIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_DIM)]
DimSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_DIM)]


class RankCoord(msgspec.Struct, frozen=True, order=True, forbid_unknown_fields=True):
    """Coordinates of one rank inside its instance."""

    dp: RankIndex = 0
    cp: RankIndex = 0
    tp: RankIndex = 0
    pp: RankIndex = 0

    def __str__(self) -> str:
        return f"dp{self.dp}/cp{self.cp}/tp{self.tp}/pp{self.pp}"


class InstanceShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sizes of an instance: `dp × cp × tp × pp` ranks."""

    dp: DimSize = 1
    cp: DimSize = 1
    tp: DimSize = 1
    pp: DimSize = 1

    @property
    def num_ranks(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def contains(self, rank: RankCoord) -> bool:
        return rank.dp < self.dp and rank.cp < self.cp and rank.tp < self.tp and rank.pp < self.pp

    def ranks(self) -> list[RankCoord]:
        """Every rank, in global rank order (dp, cp, tp, pp — pp fastest)."""
        return [
            RankCoord(dp, cp, tp, pp)
            for dp in range(self.dp)
            for cp in range(self.cp)
            for tp in range(self.tp)
            for pp in range(self.pp)
        ]

    def group(self, dp: int) -> list[RankCoord]:
        """The ranks of one dp group."""
        return [r for r in self.ranks() if r.dp == dp]

    def __str__(self) -> str:
        return f"dp={self.dp} cp={self.cp} tp={self.tp} pp={self.pp}"
