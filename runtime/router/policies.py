"""Worker selection policies, one instance per role (prefill and decode apart).

Invariants:
- only healthy workers are candidates; with none, `select` raises
  `NoHealthyWorkerError` (HTTP 503) and changes no state;
- round_robin visits the healthy workers in pool order, each once per cycle;
- least_outstanding picks a worker with the fewest legs in flight and
  rotates among ties, so equal load spreads evenly;
- random is uniform over the healthy workers and reproducible from a seed;
- cache_aware (`choose_by_cache`), for any role (prefill, decode, colocated),
  sends a request to the candidate holding the most leading pages of its
  prompt (`prefix_index.py`), the least loaded of those on a tie, unless
  that worker's legs in flight exceed the least loaded candidate's by more
  than ``max_load_gap``; with no page cached anywhere, no prompt tokens, or
  over the gap, it picks as least_outstanding does.

Pure module: a policy only reads workers, the prefix index and its own
counter (round_robin and least_outstanding take turns the same way, through
`_Rotation`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol

from pdcluster.runtime.router.errors import NoHealthyWorkerError
from pdcluster.runtime.router.prefix_index import PrefixIndex, PromptTokens
from pdcluster.runtime.router.workers import Worker
from pdcluster.runtime.spec import SelectionPolicy


class Policy(Protocol):
    name: str

    def select(
        self, workers: Sequence[Worker], role: str, prompt: PromptTokens | None = None
    ) -> Worker: ...


def _candidates(workers: Sequence[Worker], role: str) -> list[Worker]:
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        raise NoHealthyWorkerError(role)
    return healthy


class _Rotation:
    """Takes turns through whatever candidates a pick offers: the n-th pick
    takes candidates[n % len(candidates)]."""

    def __init__(self) -> None:
        self._turn = 0

    def _take_turn(self, candidates: Sequence[Worker]) -> Worker:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return chosen


class RoundRobin(_Rotation):
    name = SelectionPolicy.round_robin.value

    def select(
        self, workers: Sequence[Worker], role: str, prompt: PromptTokens | None = None
    ) -> Worker:
        return self._take_turn(_candidates(workers, role))


class LeastOutstanding(_Rotation):
    name = SelectionPolicy.least_outstanding.value

    def select(
        self, workers: Sequence[Worker], role: str, prompt: PromptTokens | None = None
    ) -> Worker:
        healthy = _candidates(workers, role)
        low = min(w.outstanding for w in healthy)
        return self._take_turn([w for w in healthy if w.outstanding == low])


class RandomChoice:
    name = SelectionPolicy.random.value

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(
        self, workers: Sequence[Worker], role: str, prompt: PromptTokens | None = None
    ) -> Worker:
        return self._rng.choice(_candidates(workers, role))


def choose_by_cache(
    candidates: Sequence[Worker], cached_pages: Mapping[str, int], max_load_gap: int
) -> Worker | None:
    """The candidate holding the longest cached prefix, or None to pick by load.

    Among the candidates with the most cached pages, the least loaded one (the
    first in pool order on a tie). None when no candidate holds a page, or
    when that worker's ``outstanding`` exceeds the least loaded candidate's
    by more than ``max_load_gap``: a long queue there would cost more than
    recomputing the prefix elsewhere.
    """
    if not candidates:
        return None
    best = max(cached_pages.get(w.url, 0) for w in candidates)
    if best <= 0:
        return None
    holders = [w for w in candidates if cached_pages.get(w.url, 0) == best]
    chosen = min(holders, key=lambda w: w.outstanding)
    if chosen.outstanding - min(w.outstanding for w in candidates) > max_load_gap:
        return None
    return chosen


class CacheAware:
    name = SelectionPolicy.cache_aware.value

    def __init__(self, index: PrefixIndex, max_load_gap: int) -> None:
        if not isinstance(max_load_gap, int) or isinstance(max_load_gap, bool) or max_load_gap < 0:
            raise ValueError(f"max_load_gap must be an integer >= 0, got {max_load_gap!r}")
        self.index = index
        self.max_load_gap = max_load_gap
        self._by_load = LeastOutstanding()
        self.num_by_cache = 0  # picks the cache decided (the rest went by load)

    def select(
        self, workers: Sequence[Worker], role: str, prompt: PromptTokens | None = None
    ) -> Worker:
        healthy = _candidates(workers, role)
        if prompt is not None:
            cached = self.index.cached_pages([w.url for w in healthy], prompt)
            chosen = choose_by_cache(healthy, cached, self.max_load_gap)
            if chosen is not None:
                self.num_by_cache += 1
                return chosen
        return self._by_load.select(healthy, role)


def make_policy(
    name: str,
    seed: int | None = None,
    *,
    index: PrefixIndex | None = None,
    max_load_gap: int = 4,
) -> Policy:
    """Build a policy by name; raise ValueError listing the valid names.
    ``cache_aware`` reads ``index`` (a new, empty one when None)."""
    try:
        kind = SelectionPolicy(name)
    except ValueError:
        valid = ", ".join(p.value for p in SelectionPolicy)
        raise ValueError(f"unknown selection policy {name!r}; choose one of: {valid}") from None
    if kind is SelectionPolicy.round_robin:
        return RoundRobin()
    if kind is SelectionPolicy.least_outstanding:
        return LeastOutstanding()
    if kind is SelectionPolicy.cache_aware:
        return CacheAware(index if index is not None else PrefixIndex(), max_load_gap)
    return RandomChoice(seed)
