"""Turn the workers' cumulative failure counters into per-interval increases.

Each PD worker serves `GET /admin/failures` → `{"failures": {"room_failed:<reason>":
count}}`, counts since the worker started. The operator polls them and
reports the *increase* per (role, reason) as one aggregated Event, never
one Event per request.

Invariants (tested):
- an increase is reported once: polling the same counts again yields nothing;
- a counter that went down (the worker restarted under the same pod uid)
  counts from zero again;
- a worker seen for the first time counts from zero, unless `baseline` is
  asked for (workers that ran before the operator started: their old
  failures were reported by the previous operator process, or are stale);
- malformed entries (not `room_failed:*`, not a non-negative int) are
  ignored, never raised on: the numbers come from another process.

Pure module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

PREFIX = "room_failed:"
MAX_REASON = 128


def parse_failures(body: Any) -> dict[str, int]:
    """Reason -> count from an `/admin/failures` body; malformed entries are dropped."""
    raw = body.get("failures") if isinstance(body, Mapping) else None
    if not isinstance(raw, Mapping):
        return {}
    out: dict[str, int] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key.startswith(PREFIX):
            continue
        reason = key[len(PREFIX) :][:MAX_REASON]
        if reason and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            out[reason] = value
    return out


class FailureCounts:
    def __init__(self) -> None:
        self._last: dict[str, dict[str, int]] = {}

    def knows(self, uid: str) -> bool:
        return uid in self._last

    def baseline(self, uid: str, counts: Mapping[str, int]) -> None:
        """Take `counts` as already reported."""
        self._last[uid] = dict(counts)

    def update(self, uid: str, counts: Mapping[str, int]) -> dict[str, int]:
        """The increase of each reason since the last update of `uid`."""
        prev = self._last.get(uid, {})
        increase: dict[str, int] = {}
        for reason, count in counts.items():
            before = prev.get(reason, 0)
            delta = count if count < before else count - before
            if delta > 0:
                increase[reason] = delta
        self._last[uid] = dict(counts)
        return increase

    def forget(self, uid: str) -> None:
        self._last.pop(uid, None)

    def retain(self, uids: Iterable[str]) -> None:
        """Forget every pod not in `uids` (pods that are gone)."""
        keep = set(uids)
        for uid in [u for u in self._last if u not in keep]:
            del self._last[uid]
