"""Failure counts of a whole PD instance, gathered from every rank of every dp group.

Each rank keeps its own counters (`room_failed:<reason>`, rejects, drops…).
The operator polls one URL per instance and turns increases into
`RoomsFailed` Events whose count is a number of *rooms*, so:

- rooms are counted once per dp group, not once per rank: every rank of a
  group fails a group-wide failure (a peer lost, an abort) in its own
  table, and a tp2 instance must not report two rooms for one request.
  `RoomFailureTally` counts distinct rooms from the ranks' `failed` reports
  that reach the group leader, under the first reason reported;
- other counters (protocol rejects, drops, endpoint errors) are events of
  one rank each: the instance's value is their sum over ranks;
- a rank or dp group that did not report recently is *missing*; its last
  known counters still count. Counters only grow, so leaving them out would
  make the total drop and the operator count them again once it is back.

Pure module.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pdcluster.runtime.pd.failure_labels import reason_label

FAILED_PREFIX = "room_failed:"
DEFAULT_MAX_ROOMS = 1 << 16


def failure_key(reason: str) -> str:
    """The counter a failure reason goes under (as every rank names it): its label."""
    return FAILED_PREFIX + reason_label(reason)


def is_failure_key(key: str) -> bool:
    return key.startswith(FAILED_PREFIX)


def sum_counts(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for part in parts:
        for key, value in part.items():
            total[key] += value
    return dict(total)


def failures_only(counts: Mapping[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if is_failure_key(k)}


def check_counts(counts: object) -> dict[str, int]:
    """Counters received from another process: a str -> non-negative int mapping, or raise."""
    if not isinstance(counts, Mapping):
        raise ValueError(f"counters must be a mapping, got {type(counts).__name__}")
    out: dict[str, int] = {}
    for key, value in counts.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"counter name must be a non-empty string, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"counter {key!r} must be a non-negative int, got {value!r}")
        out[key] = value
    return out


class RoomFailureTally:
    """Distinct failed rooms of one dp group, by reason.

    `record(room, reason, now)` is called for every `failed` report of every
    rank; a room counts once, under the first reason. A room is remembered
    for `ttl_s` (every rank's report of one failure arrives well within the
    tombstone lifetime) and at most `max_rooms` rooms are (the oldest go
    first), so memory stays bounded under a flood of failures.
    """

    def __init__(self, ttl_s: float, max_rooms: int = DEFAULT_MAX_ROOMS) -> None:
        if not ttl_s > 0 or max_rooms < 1:
            raise ValueError(f"tally needs ttl_s > 0 and max_rooms >= 1, got {ttl_s}, {max_rooms}")
        self.ttl_s = ttl_s
        self.max_rooms = max_rooms
        self._seen: OrderedDict[int, float] = OrderedDict()  # room -> first report time
        self._counts: Counter[str] = Counter()

    def record(self, room: int, reason: str, now: float) -> bool:
        """True if this is the first report of the room's failure (it was counted)."""
        self._expire(now)
        if room in self._seen:
            return False
        self._seen[room] = now
        while len(self._seen) > self.max_rooms:
            self._seen.popitem(last=False)
        self._counts[failure_key(reason)] += 1
        return True

    def _expire(self, now: float) -> None:
        while self._seen:
            room, at = next(iter(self._seen.items()))
            if at + self.ttl_s > now:
                break
            del self._seen[room]

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def __len__(self) -> int:
        return len(self._seen)


@dataclass(frozen=True)
class _Pushed:
    name: str
    counts: dict[str, int]
    at: float


class RankCountsBook:
    """The latest counters each follower of a dp group pushed to its leader.

    Followers push on change and at least every `stale_s / 3`; a follower
    not heard from for `stale_s` (or never) is missing.
    """

    def __init__(self, ranks: Sequence[int], stale_s: float) -> None:
        if not stale_s > 0:
            raise ValueError(f"stale_s must be > 0, got {stale_s}")
        self.ranks = tuple(ranks)
        self.stale_s = stale_s
        self._latest: dict[int, _Pushed] = {}

    def update(self, rank: int, name: str, counts: Mapping[str, int], now: float) -> None:
        """Raises ValueError (and keeps what it had) for an unknown rank or bad counters."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not a follower of this group ({self.ranks})")
        self._latest[rank] = _Pushed(name or f"rank{rank}", check_counts(counts), now)

    def missing(self, now: float) -> list[str]:
        out = []
        for rank in self.ranks:
            pushed = self._latest.get(rank)
            if pushed is None:
                out.append(f"rank{rank}")
            elif now - pushed.at > self.stale_s:
                out.append(pushed.name)
        return out

    def by_rank(self) -> dict[str, dict[str, int]]:
        return {p.name: dict(p.counts) for p in self._latest.values()}


@dataclass(frozen=True)
class CountsView:
    """What `GET /admin/failures` answers, for one dp group or a whole instance."""

    failures: dict[str, int]  # rooms failed, by `room_failed:<reason>`
    stats: dict[str, int]  # every counter summed over ranks; room_failed:* = rooms
    ranks: dict[str, dict[str, int]]  # each rank's own counters
    missing: list[str]  # ranks / dp groups that did not report in time

    def to_json(self) -> dict[str, object]:
        return {
            "failures": self.failures,
            "stats": self.stats,
            "ranks": self.ranks,
            "missing": self.missing,
        }

    @classmethod
    def from_json(cls, body: object) -> CountsView:
        """Parse a dp group's answer; raises ValueError on anything malformed."""
        if not isinstance(body, Mapping):
            raise ValueError("answer is not an object")
        ranks = body.get("ranks")
        missing = body.get("missing")
        if not isinstance(ranks, Mapping) or not isinstance(missing, list):
            raise ValueError("answer lacks ranks or missing")
        return cls(
            failures=check_counts(body.get("failures")),
            stats=check_counts(body.get("stats")),
            ranks={str(k): check_counts(v) for k, v in ranks.items()},
            missing=[str(m) for m in missing],
        )


def build_group_view(
    leader_name: str,
    leader_counts: Mapping[str, int],
    book_ranks: Mapping[str, Mapping[str, int]],
    missing: Sequence[str],
    rooms_failed: Mapping[str, int],
) -> CountsView:
    """A dp group's view: the leader's and followers' counters, rooms from the tally."""
    ranks = {leader_name: dict(leader_counts), **{k: dict(v) for k, v in book_ranks.items()}}
    per_rank_sum = sum_counts(ranks.values())
    stats = {k: v for k, v in per_rank_sum.items() if not is_failure_key(k)}
    stats.update(rooms_failed)
    return CountsView(
        failures=dict(rooms_failed),
        stats=stats,
        ranks=ranks,
        missing=list(missing),
    )


def merge_views(views: Iterable[CountsView], missing: Iterable[str] = ()) -> CountsView:
    """An instance's view from its dp groups' views (rooms of different groups are distinct)."""
    parts = list(views)
    ranks: dict[str, dict[str, int]] = {}
    for v in parts:
        ranks.update(v.ranks)
    return CountsView(
        failures=sum_counts(v.failures for v in parts),
        stats=sum_counts(v.stats for v in parts),
        ranks=ranks,
        missing=[m for v in parts for m in v.missing] + list(missing),
    )
