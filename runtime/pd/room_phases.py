"""Phases of a prefill room and of a decode room — the room protocols as data.

A room's phase is the one piece of its state the protocol steps on: each
table below reads top to bottom as `phase → {event: next phase}`, and
`next_phase` turns a missing entry into `IllegalRoomTransition`. The room
tables (`prefill_rooms`, `decode_rooms`) decide *which* event happened from
their inputs; what may follow is decided here alone.

What lives outside these tables, on purpose:
- counts and per-peer records: in-flight writes and destinations
  (`prefill_claims`), sources and their acks (`decode_sources`); they choose
  between events (e.g. `DRAINED` once nothing is in flight), never replace one;
- the reported `KVPoll` (what a Status carries, what the admin API lists) is
  a function of the phase (`PREFILL_STATE`, `DECODE_STATE`), never stored.

Deadlines (`PREFILL_DEADLINES`, `DECODE_DEADLINES`): every non-terminal phase
has an entry, `(setting, reason)` or None. `setting` names the `RoomSettings`
field that bounds the phase (`waiting_s` and `prefill_wait_s` are extended
per prompt token); `reason` is what expiry means: the failure reason of a
live room, or the release reason of a failed one. None: the phase waits on
something with its own bound (the transfer engine's cancellation, the acks
of a one-sided transport). The clock restarts when a step lands in a phase
whose entry differs from the previous one's, and on the steps listed in
`*_RESTARTS_CLOCK`; otherwise the running deadline carries over (a room that
starts transferring keeps the deadline it got when it started waiting).

Invariants the tables encode:
- terminal phases (`SUCCEEDED`, `CLOSED`; `COMPLETE`, `RELEASED`) have no
  outgoing entry: a concluded room absorbs every event (the room table has
  already forgotten it);
- Success is reachable only after every write drained (prefill: `FINISHING`
  → `DRAINED`) or every source reported it (decode: `SUCCESS` from a waiting
  or transferring phase);
- a failed phase never goes back to a live one, and failing twice is not an
  entry (the room tables keep the first reason).

Pure module.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from pdcluster.runtime.pd.kvpoll import KVPoll

DeadlineSetting = Literal["bootstrap_s", "waiting_s", "prefill_wait_s", "release_s"]
Deadline = tuple[DeadlineSetting, str]


class IllegalRoomTransition(ValueError):
    """An event the phase table has no entry for: a bug in a room table, never a peer's doing.

    The room tables check what a local call or a peer message may do before
    they step, and answer with their own `RoomStateError` or `Dropped`; this
    error means that check and the table disagree.
    """


class PrefillPhase(enum.Enum):
    UNOPENED = "unopened"  # a decode claim created it; the prefill leg has not arrived
    OPENED = "opened"  # early: the leg arrived and runs, not every destination known yet
    COMPUTING = "computing"  # prefill_complete: the leg runs, destinations incomplete
    COMPUTED = "computed"  # prefill_complete: KV held, destinations incomplete
    AWAITING_KV = "awaiting_kv"  # prefill_complete: every destination known, still computing
    SENDING = "sending"  # writes may be enqueued (every destination known; SendHeldKV emitted)
    TRANSFERRING = "transferring"  # the first write was enqueued
    FINISHING = "finishing"  # the last write was enqueued; writes draining
    DRAINING = "draining"  # failed; writes still in flight
    CANCELLING = "cancelling"  # failed; CancelWrites emitted, waiting for writes_done
    SUCCEEDED = "succeeded"  # terminal: Success sent to every destination
    CLOSED = "closed"  # terminal: failed and drained


class PrefillEvent(enum.Enum):
    OPEN = "open"  # early: the prefill leg arrived, StartCompute
    OPEN_COMPUTE = "open_compute"  # prefill_complete: the leg arrived, StartCompute
    ALL_DESTINATIONS = "all_destinations"  # opened and every destination's metadata in
    KV_COMPUTED = "kv_computed"
    FIRST_WRITE = "first_write"
    FINISH = "finish"  # finish_sending
    DRAINED = "drained"  # nothing in flight any more
    FAIL = "fail"
    CANCEL = "cancel"  # release_s passed, or the peer is dead: CancelWrites


class DecodePhase(enum.Enum):
    ROUTING = "routing"  # added; its sources (the prefill ranks) not known yet
    AWAITING_READY = "awaiting_ready"  # prefill_complete: BOOTSTRAP sent, Ready outstanding
    AWAITING_PAGES = "awaiting_pages"  # sources known (and Ready): queued for pages
    WAITING = "waiting"  # metadata (pages) sent to every source
    TRANSFERRING = "transferring"  # every source reported Transferring
    FAILED = "failed"  # pages held until every source settled
    COMPLETE = "complete"  # terminal: every source succeeded, pages go to the request
    RELEASED = "released"  # terminal: failed, pages released


class DecodeEvent(enum.Enum):
    RESOLVED = "resolved"  # early: sources known
    BOOTSTRAP_SENT = "bootstrap_sent"  # prefill_complete: sources known, BOOTSTRAP sent
    ALL_READY = "all_ready"  # prefill_complete: Ready from every source
    PAGES_SENT = "pages_sent"  # assign_pages: TransferMeta to every source
    TRANSFERRING = "transferring"  # consensus of the sources reached Transferring
    SUCCESS = "success"  # every source reported Success
    FAIL = "fail"
    SETTLED = "settled"  # every source settled (acked, dead, or never sent pages)
    RELEASE_TIMEOUT = "release_timeout"  # release_s passed (never one-sided)


_P, _PE = PrefillPhase, PrefillEvent
_D, _DE = DecodePhase, DecodeEvent

PREFILL_TRANSITIONS: dict[PrefillPhase, dict[PrefillEvent, PrefillPhase]] = {
    _P.UNOPENED: {_PE.OPEN: _P.OPENED, _PE.OPEN_COMPUTE: _P.COMPUTING, _PE.FAIL: _P.DRAINING},
    _P.OPENED: {_PE.ALL_DESTINATIONS: _P.SENDING, _PE.FAIL: _P.DRAINING},
    _P.COMPUTING: {
        _PE.KV_COMPUTED: _P.COMPUTED,
        _PE.ALL_DESTINATIONS: _P.AWAITING_KV,
        _PE.FAIL: _P.DRAINING,
    },
    _P.COMPUTED: {_PE.ALL_DESTINATIONS: _P.SENDING, _PE.FAIL: _P.DRAINING},
    _P.AWAITING_KV: {_PE.KV_COMPUTED: _P.SENDING, _PE.FAIL: _P.DRAINING},
    _P.SENDING: {_PE.FIRST_WRITE: _P.TRANSFERRING, _PE.FINISH: _P.FINISHING, _PE.FAIL: _P.DRAINING},
    _P.TRANSFERRING: {_PE.FINISH: _P.FINISHING, _PE.FAIL: _P.DRAINING},
    _P.FINISHING: {_PE.DRAINED: _P.SUCCEEDED, _PE.FAIL: _P.DRAINING},
    _P.DRAINING: {_PE.DRAINED: _P.CLOSED, _PE.CANCEL: _P.CANCELLING},
    _P.CANCELLING: {_PE.DRAINED: _P.CLOSED},
    _P.SUCCEEDED: {},
    _P.CLOSED: {},
}

DECODE_TRANSITIONS: dict[DecodePhase, dict[DecodeEvent, DecodePhase]] = {
    _D.ROUTING: {
        _DE.RESOLVED: _D.AWAITING_PAGES,
        _DE.BOOTSTRAP_SENT: _D.AWAITING_READY,
        _DE.FAIL: _D.FAILED,
    },
    _D.AWAITING_READY: {_DE.ALL_READY: _D.AWAITING_PAGES, _DE.FAIL: _D.FAILED},
    _D.AWAITING_PAGES: {_DE.PAGES_SENT: _D.WAITING, _DE.FAIL: _D.FAILED},
    _D.WAITING: {_DE.TRANSFERRING: _D.TRANSFERRING, _DE.SUCCESS: _D.COMPLETE, _DE.FAIL: _D.FAILED},
    _D.TRANSFERRING: {_DE.SUCCESS: _D.COMPLETE, _DE.FAIL: _D.FAILED},
    _D.FAILED: {_DE.SETTLED: _D.RELEASED, _DE.RELEASE_TIMEOUT: _D.RELEASED},
    _D.COMPLETE: {},
    _D.RELEASED: {},
}

_BOOT: Deadline = ("bootstrap_s", "bootstrap_timeout")

PREFILL_DEADLINES: dict[PrefillPhase, Deadline | None] = {
    _P.UNOPENED: _BOOT,
    _P.OPENED: _BOOT,
    _P.COMPUTING: _BOOT,
    _P.COMPUTED: _BOOT,
    _P.AWAITING_KV: ("waiting_s", "transfer_timeout"),
    _P.SENDING: ("waiting_s", "transfer_timeout"),
    _P.TRANSFERRING: ("waiting_s", "transfer_timeout"),
    _P.FINISHING: ("waiting_s", "transfer_timeout"),
    _P.DRAINING: ("release_s", "release_timeout"),  # expiry: CANCEL
    _P.CANCELLING: None,  # the transfer engine reports the cancelled writes done
}

DECODE_DEADLINES: dict[DecodePhase, Deadline | None] = {
    _D.ROUTING: _BOOT,
    _D.AWAITING_READY: ("prefill_wait_s", "prefill_wait_timeout"),
    _D.AWAITING_PAGES: _BOOT,
    _D.WAITING: ("waiting_s", "waiting_timeout"),
    _D.TRANSFERRING: ("waiting_s", "waiting_timeout"),
    # Expiry: RELEASE_TIMEOUT. A one-sided transport arms none: only an ack
    # or a definitive peer verdict frees pages a peer may still write into.
    _D.FAILED: ("release_s", "release_timeout"),
}

# Steps that restart the clock although the deadline entry stays the same:
# KV held under prefill_complete gives decode a fresh bootstrap_s to claim it.
PREFILL_RESTARTS_CLOCK: frozenset[tuple[PrefillPhase, PrefillEvent]] = frozenset(
    {(_P.COMPUTING, _PE.KV_COMPUTED)}
)
DECODE_RESTARTS_CLOCK: frozenset[tuple[DecodePhase, DecodeEvent]] = frozenset()

# Phases in which the engine holds the prefill leg (StartCompute was emitted):
# the room owes one ReleaseSource when it ends. A failed phase that still has
# writes in flight always does (writes start only after StartCompute).
PREFILL_HOLDS_SOURCE: frozenset[PrefillPhase] = frozenset(
    {
        _P.OPENED,
        _P.COMPUTING,
        _P.COMPUTED,
        _P.AWAITING_KV,
        _P.SENDING,
        _P.TRANSFERRING,
        _P.FINISHING,
        _P.DRAINING,
        _P.CANCELLING,
    }
)

_B, _W, _T = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring

PREFILL_STATE: dict[PrefillPhase, KVPoll] = {
    _P.UNOPENED: _B,
    _P.OPENED: _B,
    _P.COMPUTING: _B,
    _P.COMPUTED: _B,
    _P.AWAITING_KV: _W,
    _P.SENDING: _W,
    _P.TRANSFERRING: _T,
    _P.FINISHING: _T,
    _P.DRAINING: KVPoll.Failed,
    _P.CANCELLING: KVPoll.Failed,
    _P.SUCCEEDED: KVPoll.Success,
    _P.CLOSED: KVPoll.Failed,
}

DECODE_STATE: dict[DecodePhase, KVPoll] = {
    _D.ROUTING: _B,
    _D.AWAITING_READY: _B,
    _D.AWAITING_PAGES: _B,
    _D.WAITING: _W,
    _D.TRANSFERRING: _T,
    _D.FAILED: KVPoll.Failed,
    _D.COMPLETE: KVPoll.Success,
    _D.RELEASED: KVPoll.Failed,
}

Phase = TypeVar("Phase", PrefillPhase, DecodePhase)
Event = TypeVar("Event", PrefillEvent, DecodeEvent)


def next_phase(table: Mapping[Phase, Mapping[Event, Phase]], phase: Phase, event: Event) -> Phase:
    """The phase `event` leads to from `phase`; a missing entry raises IllegalRoomTransition."""
    try:
        return table[phase][event]
    except KeyError:
        allowed = ", ".join(e.name for e in table.get(phase, {})) or "none: terminal"
        raise IllegalRoomTransition(
            f"no {event.name} in phase {phase.name} (allowed: {allowed})"
        ) from None


@dataclass(frozen=True)
class PhaseMachine(Generic[Phase, Event]):
    """One room kind's tables, and the one step rule that reads them."""

    transitions: Mapping[Phase, Mapping[Event, Phase]]
    deadlines: Mapping[Phase, Deadline | None]
    restarts_clock: frozenset[tuple[Phase, Event]]
    states: Mapping[Phase, KVPoll]

    def allows(self, phase: Phase, event: Event) -> bool:
        return event in self.transitions[phase]

    def step(self, phase: Phase, event: Event) -> tuple[Phase, bool]:
        """(next phase, whether its deadline is armed afresh); raises IllegalRoomTransition."""
        new = next_phase(self.transitions, phase, event)
        fresh = self.deadlines.get(new) != self.deadlines.get(phase)
        return new, fresh or (phase, event) in self.restarts_clock


PREFILL = PhaseMachine(
    PREFILL_TRANSITIONS, PREFILL_DEADLINES, PREFILL_RESTARTS_CLOCK, PREFILL_STATE
)
DECODE = PhaseMachine(DECODE_TRANSITIONS, DECODE_DEADLINES, DECODE_RESTARTS_CLOCK, DECODE_STATE)
