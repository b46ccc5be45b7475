"""`KVPoll` — the transfer state of one room, and the rule every update obeys.

Both sides (prefill sender, decode receiver) track a room with the same five
states. The numeric order matters: progress only moves up.

Invariants (docs/design.md §5), enforced by `Poll.update` through one table:
- only Bootstrapping and WaitingForInput may create an entry (`Poll.create`);
- Failed is terminal and sticky: nothing moves a Failed poll;
- Success is concluded: a later update (even Failed) does not change it;
- otherwise state = max(old, new), so a late or reordered update never moves
  a poll backwards;
- the first failure reason is kept.

An update for a room that was cleared is the room table's business (it
drops it before reaching this module); here every cell of the table is
either an explicit effect or `IllegalTransition`.

`consensus` folds the states of the ranks that must all report (the distinct
prefill ranks feeding one decode rank, or the ranks of one decode group):
Failed dominates, otherwise the slowest rank decides.

Pure module.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def is_concluded(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


class IllegalTransition(ValueError):
    """An update that the KVPoll rules forbid (a caller bug, not a peer's)."""


class Effect(enum.Enum):
    ADVANCE = "advance"  # state := new
    FAIL = "fail"  # state := Failed, reason recorded
    KEEP = "keep"  # duplicate, stale or post-conclusion update: no change


CREATABLE: frozenset[KVPoll] = frozenset({KVPoll.Bootstrapping, KVPoll.WaitingForInput})


_F, _B, _W, _T, _S = (
    KVPoll.Failed,
    KVPoll.Bootstrapping,
    KVPoll.WaitingForInput,
    KVPoll.Transferring,
    KVPoll.Success,
)
_UP, _FAIL, _KEEP = Effect.ADVANCE, Effect.FAIL, Effect.KEEP

# The whole rule as data, one row per current state (old → {new: effect}).
# A test checks the rows against the prose above; `Poll.update` only looks
# them up.
_ROWS: dict[KVPoll, dict[KVPoll, Effect]] = {
    _B: {_B: _KEEP, _W: _UP, _T: _UP, _S: _UP, _F: _FAIL},
    _W: {_B: _KEEP, _W: _KEEP, _T: _UP, _S: _UP, _F: _FAIL},
    _T: {_B: _KEEP, _W: _KEEP, _T: _KEEP, _S: _UP, _F: _FAIL},
    _S: {_B: _KEEP, _W: _KEEP, _T: _KEEP, _S: _KEEP, _F: _KEEP},  # concluded
    _F: {_B: _KEEP, _W: _KEEP, _T: _KEEP, _S: _KEEP, _F: _KEEP},  # sticky
}
TRANSITIONS: dict[tuple[KVPoll, KVPoll], Effect] = {
    (old, new): effect for old, row in _ROWS.items() for new, effect in row.items()
}


@dataclass(frozen=True, slots=True)
class Poll:
    """One room's (or one rank's) poll: state plus the first failure reason."""

    state: KVPoll
    reason: str | None = None

    @staticmethod
    def create(state: KVPoll) -> Poll:
        """A new entry; only Bootstrapping or WaitingForInput may create one."""
        state = _coerce(state)
        if state not in CREATABLE:
            raise IllegalTransition(
                f"a room entry cannot be created in state {state.name}; "
                "only Bootstrapping or WaitingForInput create entries"
            )
        return Poll(state)

    def update(self, new: KVPoll, reason: str | None = None) -> Poll:
        """Apply one update; returns self when nothing changes."""
        new = _coerce(new)
        effect = TRANSITIONS[(self.state, new)]
        if effect is Effect.KEEP:
            return self
        if effect is Effect.FAIL:
            return Poll(KVPoll.Failed, reason or "failed")
        return Poll(new)

    def fail(self, reason: str) -> Poll:
        return self.update(KVPoll.Failed, reason)

    @property
    def is_concluded(self) -> bool:
        return self.state.is_concluded


def _coerce(value: object) -> KVPoll:
    if isinstance(value, KVPoll):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return KVPoll(value)
        except ValueError:
            pass
    raise IllegalTransition(f"{value!r} is not a KVPoll state (0..4)")


def consensus(states: Iterable[KVPoll]) -> KVPoll:
    """The state of a group that needs every member: Failed dominates, else the minimum.

    An empty group has nothing to wait for and raises: a caller that folds
    zero ranks has lost its topology.
    """
    lowest: KVPoll | None = None
    for raw in states:
        state = _coerce(raw)
        if state is KVPoll.Failed:
            return KVPoll.Failed
        lowest = state if lowest is None or state < lowest else lowest
    if lowest is None:
        raise IllegalTransition("consensus over zero ranks: the group has no members")
    return lowest
