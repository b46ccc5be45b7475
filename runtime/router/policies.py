"""Worker selection policies, one instance per role (prefill and decode apart).

Invariants:
- only healthy workers are candidates; with none, `select` raises
  `NoHealthyWorkerError` (HTTP 503) and changes no state;
- round_robin visits the healthy workers in pool order, each once per cycle;
- least_outstanding picks a worker with the fewest legs in flight and
  rotates among ties, so equal load spreads evenly;
- random is uniform over the healthy workers and reproducible from a seed.

Pure module: a policy only reads workers and its own counter (round_robin
and least_outstanding take turns the same way, through `_Rotation`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from pdcluster.runtime.router.errors import NoHealthyWorkerError
from pdcluster.runtime.router.workers import Worker
from pdcluster.runtime.spec import SelectionPolicy


class Policy(Protocol):
    name: str

    def select(self, workers: Sequence[Worker], role: str) -> Worker: ...


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

    def select(self, workers: Sequence[Worker], role: str) -> Worker:
        return self._take_turn(_candidates(workers, role))


class LeastOutstanding(_Rotation):
    name = SelectionPolicy.least_outstanding.value

    def select(self, workers: Sequence[Worker], role: str) -> Worker:
        healthy = _candidates(workers, role)
        low = min(w.outstanding for w in healthy)
        return self._take_turn([w for w in healthy if w.outstanding == low])


class RandomChoice:
    name = SelectionPolicy.random.value

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, workers: Sequence[Worker], role: str) -> Worker:
        return self._rng.choice(_candidates(workers, role))


def make_policy(name: str, seed: int | None = None) -> Policy:
    """Build a policy by name; raise ValueError listing the valid names."""
    try:
        kind = SelectionPolicy(name)
    except ValueError:
        valid = ", ".join(p.value for p in SelectionPolicy)
        raise ValueError(f"unknown selection policy {name!r}; choose one of: {valid}") from None
    if kind is SelectionPolicy.round_robin:
        return RoundRobin()
    if kind is SelectionPolicy.least_outstanding:
        return LeastOutstanding()
    return RandomChoice(seed)
