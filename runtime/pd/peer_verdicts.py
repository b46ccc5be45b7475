"""Which prefill peers a decode rank holds dead, why, and for how long.

Two kinds of verdict (docs/design.md §8):
- an operator report (`/admin/fail_peer`): the pod is lost or not ready.
  It lasts `bootstrap_s`, and while it lasts a new room on that peer is
  refused at once — no /route fetch, no retries against a gone server;
- a heartbeat verdict: the peer stopped answering probes. It lasts until a
  probe finds it answering (`recovered`), and a new room on it is held for
  one probe rather than refused: unreachable a while ago is not gone now (a
  resumed or restarted process at the same address).

A peer may be a bootstrap address, a rank endpoint or a host; lookups match
with `peer_matches`. When two verdicts overlap, the first reason stays and
the longer limits win. Pure module.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from pdcluster.runtime.pd.room_common import peer_matches


@dataclass(frozen=True)
class Verdict:
    reason: str
    until: float  # inf for a heartbeat verdict: only `recovered` ends it
    # New rooms fail at once before this; after it (a heartbeat verdict) they
    # wait for one probe.
    refuse_until: float


class Gate(Enum):
    PROCEED = "proceed"  # no verdict: fetch /route
    HOLD = "hold"  # heartbeat verdict: probe first
    REFUSE = "refuse"  # operator report: fail now


class PeerVerdicts:
    def __init__(self) -> None:
        self._dead: dict[str, Verdict] = {}

    def declare(
        self, peer: str, reason: str, now: float, *, until_recovered: bool, bootstrap_s: float
    ) -> None:
        until = math.inf if until_recovered else now + bootstrap_s
        refuse_until = -math.inf if until_recovered else until
        old = self._dead.get(peer)
        if old is not None and old.until > now:
            until, reason = max(until, old.until), old.reason
            refuse_until = max(refuse_until, old.refuse_until)
        self._dead[peer] = Verdict(reason, until, refuse_until)

    def recovered(self, peer: str) -> None:
        self._dead.pop(peer, None)

    def gate(self, peer: str, now: float) -> tuple[Gate, str | None]:
        """What a new room on `peer` (its instance address) does now, and the reason."""
        held: str | None = None
        for dead, v in self._dead.items():
            if v.until > now and peer_matches(dead, peer):
                if v.refuse_until > now:
                    return Gate.REFUSE, v.reason
                held = held or v.reason
        return (Gate.HOLD, held) if held is not None else (Gate.PROCEED, None)

    def reason_for(self, peer: str, now: float) -> str | None:
        """Why `peer` is held dead now, or None."""
        for dead, v in self._dead.items():
            if v.until > now and peer_matches(dead, peer):
                return v.reason
        return None

    def current(self, now: float) -> Iterator[tuple[str, Verdict]]:
        """Verdicts that still hold, after forgetting the expired ones."""
        self._dead = {p: v for p, v in self._dead.items() if v.until > now}
        yield from list(self._dead.items())

    def down(self, now: float) -> dict[str, str]:
        return {p: v.reason for p, v in self._dead.items() if v.until > now}
