"""Which start of a peer a loss report is about — a pure table both room tables keep.

A peer's address outlives its process: a pod that is gone can have a
successor at the same IP (and the same ports) before a late report about it
arrives. A report (`fail_peer`) may name the incarnation it is about (the
lost pod's uid; for a prefill instance its leader pod's). A rank remembers
the incarnations it saw at each address (a prefill instance's /route answer,
each rank's registration; a decode rank's KV layout), and judges a report:

- `CURRENT`: no incarnation named (as before incarnations existed: whatever
  serves there), or the one the address serves now: act on everything tied
  to the address — rooms, verdicts for new rooms, connections;
- `STALE`: one seen there earlier, not the one serving now: only rooms and
  sources still bound to that incarnation are touched; the successor keeps
  its rooms, its connections and new rooms;
- `UNSEEN`: never seen here: nothing of it is here; the report changes nothing.

Addresses are what a room knows its peers by (a bootstrap address, a rank
endpoint); a report naming a bare host covers every address on that host.
Bounded: the oldest incarnations are forgotten first (`max_seen`).

Pure module.
"""

from __future__ import annotations

import enum
from collections import OrderedDict

from pdcluster.runtime.pd.room_common import peer_matches

MAX_SEEN = 4096


class ReportScope(enum.Enum):
    CURRENT = "current"
    STALE = "stale"
    UNSEEN = "unseen"


class Incarnations:
    def __init__(self, max_seen: int = MAX_SEEN) -> None:
        if max_seen < 1:
            raise ValueError(f"max_seen must be >= 1, got {max_seen}")
        self.max_seen = max_seen
        self._seen: OrderedDict[str, None] = OrderedDict()
        # address -> the incarnation it serves now (the latest seen there)
        self._current: OrderedDict[str, str] = OrderedDict()

    def saw(self, address: str, incarnation: str | None) -> None:
        """`address` serves `incarnation` now (None: it does not say; nothing recorded)."""
        if not incarnation:
            return
        self._seen[incarnation] = None
        self._seen.move_to_end(incarnation)
        self._current[address] = incarnation
        self._current.move_to_end(address)
        while len(self._seen) > self.max_seen:
            self._seen.popitem(last=False)
        while len(self._current) > self.max_seen:
            self._current.popitem(last=False)

    def has_seen(self, incarnation: str) -> bool:
        return incarnation in self._seen

    def current(self, address: str) -> str | None:
        return self._current.get(address)

    def scope(self, peer: str, incarnation: str | None) -> ReportScope:
        """What a report about `peer` (as `fail_peer` names it) at `incarnation` covers."""
        if incarnation is None:
            return ReportScope.CURRENT
        if incarnation not in self._seen:
            return ReportScope.UNSEEN
        serving = {inc for address, inc in self._current.items() if peer_matches(peer, address)}
        return ReportScope.CURRENT if incarnation in serving else ReportScope.STALE


def covers(scope: ReportScope, incarnation: str | None, bound: str | None) -> bool:
    """Whether a report of `scope` about `incarnation` touches something bound to
    `bound` (None: a room or peer that does not know which start it talks to)."""
    if incarnation is None or bound == incarnation:
        return True
    return bound is None and scope is ReportScope.CURRENT
