"""Liveness of the prefill instances a decode rank talks to — a sans-IO machine.

Everything a decode rank decides about its prefill peers lives here: the
heartbeat (probe schedule, failure count, the per-peer state table), the
verdicts new rooms are gated on, and the bookkeeping of operator reports,
heartbeat deaths and one-sided quarantine. The I/O loop feeds events and
performs the returned actions; no clock, no socket, no logger.

Per watched instance (its bootstrap address) the heartbeat state follows
`TRANSITIONS`; an event missing there raises `LivenessError`:

    ALIVE ──probe fails──► FAILING ──failures reach the threshold──► UNREACHABLE
      ▲   (threshold 1: ALIVE ──► UNREACHABLE at once)                  │
      └──────────── a probe answers, or a fresh /route answer ◄─────────┘

Outside the table, and only there: the failure count (which picks
`PROBE_FAILED` or `PROBE_FAILED_LAST`), the probe schedule, and five
records keyed by peer: `lost_at` (operator reports and heartbeat deaths,
kept `bootstrap_s`), `gone` (the definitive operator reports among them,
with the start of each instance they are about), `dead_at` (heartbeat
deaths, kept until the peer answers), `starts` (the start id each watched
instance's latest probe answer named) and `quarantined` (shm only: the
rank endpoints of an instance that stopped answering while it held our
pages).

Invariants (docs/design.md §8):
- timing: probes start on a fixed cadence (`interval_s` after the previous
  probe *started*), at most one in flight per peer, each bounded by
  `probe_timeout_s` (default min(interval / 2, 1 s)). A peer that hangs
  right after a good probe is declared UNREACHABLE within
  `failure_threshold × interval_s + probe_timeout_s`, under the
  `interval × threshold + 1 s` bound;
- UNREACHABLE is reported once per outage (`DeclareUnreachable`); a peer
  seen answering by other means (a /route reply) starts fresh, so its next
  death is reported again;
- only an answer to a request that *started* after a verdict undoes it: a
  probe already in flight when the operator reported the pod lost proves
  nothing;
- a definitive report (`gone`: the process can no longer run) is undone
  before `bootstrap_s` only by proof of a *new start* at that address: a
  probe answer naming a start id (a per-process id the prefill's bootstrap
  server reports in `/health`) other than the one this rank saw there
  before the report. The same start answering is the old process (a
  terminating pod, a late answer): a zombie, which never ends the report.
  An instance whose start this rank had not seen before the report, or a
  server that names none, is used again once the report expires. A report
  that is not definitive (NotReady, a hang) is undone by any such answer;
- a peer's verdicts end together: while one report on it stands, an
  answer undoes no heartbeat death of it either (the next answer does);
- a verdict (`PeerVerdicts`): an operator report lasts `bootstrap_s` (or
  until undone as above) and refuses new rooms at once; a heartbeat verdict
  lasts until the peer answers and holds a new room for one probe instead
  (unreachable a while ago is not gone now). When two overlap the first
  reason stays and the longer limits win;
- one-sided (shm) transport: a loss that is not definitive keeps the
  sockets (queued ABORTs reach a process that resumes, its acks free the
  pages) and quarantines the instance's endpoints until it acks, answers
  /route on other endpoints (`ReleaseRestarted`: the old process is gone)
  or a definitive loss arrives. Otherwise the sockets are dropped;
- idle peers: one no room or quarantine used for `idle_s` (default 300 s)
  is forgotten (`ForgetIdle`) and added back, fresh, by the next room.

A peer may be a bootstrap address, a rank endpoint or a host; lookups match
with `peer_matches`. Pure module.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from pdcluster.runtime.pd.room_common import peer_matches


class LivenessError(RuntimeError):
    """An event the transition table has no entry for."""


class PeerState(enum.Enum):
    ALIVE = "alive"  # answers (or not probed yet); no failure counted
    FAILING = "failing"  # failures below the threshold
    UNREACHABLE = "unreachable"  # declared dead by the heartbeat


class PeerEvent(enum.Enum):
    PROBE_OK = "probe_ok"
    PROBE_FAILED = "probe_failed"  # the count stays below the threshold
    PROBE_FAILED_LAST = "probe_failed_last"  # the count is at or past the threshold
    ANSWERED = "answered"  # other proof it answers: a /route reply after a verdict


TRANSITIONS: dict[PeerState, dict[PeerEvent, PeerState]] = {
    PeerState.ALIVE: {
        PeerEvent.PROBE_OK: PeerState.ALIVE,
        PeerEvent.PROBE_FAILED: PeerState.FAILING,
        PeerEvent.PROBE_FAILED_LAST: PeerState.UNREACHABLE,
        PeerEvent.ANSWERED: PeerState.ALIVE,
    },
    PeerState.FAILING: {
        PeerEvent.PROBE_OK: PeerState.ALIVE,
        PeerEvent.PROBE_FAILED: PeerState.FAILING,
        PeerEvent.PROBE_FAILED_LAST: PeerState.UNREACHABLE,
        PeerEvent.ANSWERED: PeerState.ALIVE,
    },
    PeerState.UNREACHABLE: {
        # No PROBE_FAILED: an unreachable peer's count is past the threshold.
        PeerEvent.PROBE_OK: PeerState.ALIVE,
        PeerEvent.PROBE_FAILED_LAST: PeerState.UNREACHABLE,
        PeerEvent.ANSWERED: PeerState.ALIVE,
    },
}


def next_state(state: PeerState, event: PeerEvent) -> PeerState:
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise LivenessError(f"no transition from {state.name} on {event.name}") from None


class ProbeResult(enum.Enum):
    """What one probe result did to its peer."""

    OK = "ok"  # alive (and was alive)
    FAILING = "failing"  # a failure below the threshold
    DEAD = "dead"  # just crossed the threshold: fail its rooms now (once per outage)
    STILL_DEAD = "still_dead"
    RECOVERED = "recovered"  # was unreachable, answers again
    IGNORED = "ignored"  # result for a peer no longer watched


def _probe_result(old: PeerState, new: PeerState) -> ProbeResult:
    if new is PeerState.UNREACHABLE:
        return ProbeResult.STILL_DEAD if old is PeerState.UNREACHABLE else ProbeResult.DEAD
    if new is PeerState.FAILING:
        return ProbeResult.FAILING
    return ProbeResult.RECOVERED if old is PeerState.UNREACHABLE else ProbeResult.OK


# ------------------------------------------------------------------ heartbeat


@dataclass
class _Peer:
    next_probe: float
    state: PeerState = PeerState.ALIVE
    failures: int = 0
    in_flight: bool = False
    last_start: float | None = None  # when the latest probe started
    last_used: float = 0.0  # when a room (or quarantine) last needed it


class HeartbeatTracker:
    """The probe schedule and state of each watched peer.

    I/O contract: `due(now)` returns the peers to probe now (and marks them
    in flight); the I/O loop probes them without blocking, with
    `probe_timeout_s`, and reports each with `on_result(peer, ok, now)`.
    """

    def __init__(
        self,
        interval_s: float = 5.0,
        failure_threshold: int = 2,
        probe_timeout_s: float | None = None,
        idle_s: float = 300.0,
    ) -> None:
        if not idle_s > 0:
            raise ValueError(f"heartbeat needs idle_s > 0, got {idle_s}")
        if not interval_s > 0 or failure_threshold < 1:
            raise ValueError(
                f"heartbeat needs interval_s > 0 and failure_threshold >= 1, "
                f"got {interval_s}, {failure_threshold}"
            )
        timeout = min(interval_s / 2, 1.0) if probe_timeout_s is None else probe_timeout_s
        if not 0 < timeout <= interval_s:
            raise ValueError(f"probe_timeout_s must be in (0, interval_s], got {timeout}")
        self.interval_s = interval_s
        self.failure_threshold = failure_threshold
        self.probe_timeout_s = timeout
        self.idle_s = idle_s
        self._peers: dict[str, _Peer] = {}

    def add(self, peer: str, now: float) -> None:
        """Start watching `peer` (idempotent); its first probe is due at once."""
        if not peer:
            raise ValueError("peer must be a non-empty address")
        self._peers.setdefault(peer, _Peer(next_probe=now, last_used=now))

    def prune_idle(self, now: float, in_use: set[str]) -> list[str]:
        """Forget the peers nobody used for `idle_s`; returns them, sorted.

        `in_use`: peers some room or quarantine needs now (they count as
        used at `now`). A peer with a probe in flight is kept until its
        result came: that result may still decide about rooms.
        """
        dropped = []
        for name, p in self._peers.items():
            if name in in_use or p.in_flight:
                p.last_used = now
            elif now - p.last_used >= self.idle_s:
                dropped.append(name)
        for name in dropped:
            del self._peers[name]
        return sorted(dropped)

    def remove(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def peers(self) -> list[str]:
        return list(self._peers)

    def state(self, peer: str) -> PeerState | None:
        p = self._peers.get(peer)
        return None if p is None else p.state

    def is_dead(self, peer: str) -> bool:
        return self.state(peer) is PeerState.UNREACHABLE

    def failures(self, peer: str) -> int:
        p = self._peers.get(peer)
        return 0 if p is None else p.failures

    def mark_alive(self, peer: str) -> None:
        """Other proof that `peer` answers (a fresh /route reply): forget its failures.

        Without it a peer that came back between two probes and died again
        before the next one would never be reported DEAD a second time.
        """
        p = self._peers.get(peer)
        if p is not None:
            p.state, p.failures = next_state(p.state, PeerEvent.ANSWERED), 0

    def due(self, now: float) -> list[str]:
        """Peers to probe now; each is marked in flight until `on_result`."""
        out = []
        for name, p in self._peers.items():
            if not p.in_flight and p.next_probe <= now:
                p.in_flight = True
                p.last_start = now
                # Fixed cadence: a slow probe does not push the next one back.
                p.next_probe = max(p.next_probe + self.interval_s, now)
                out.append(name)
        return out

    def hasten(self, peer: str, now: float) -> None:
        """Probe `peer` soon: a room on it was just refused or held for a probe.

        A resumed or restarted peer is then noticed one probe later, not one
        interval later, while traffic asks for it. Probes stay at most one
        in flight and at least `probe_timeout_s` apart, however many rooms
        ask: rooms held meanwhile share the probe in flight or the next one.
        """
        p = self._peers.get(peer)
        if p is None or p.in_flight:
            return
        earliest = now if p.last_start is None else p.last_start + self.probe_timeout_s
        p.next_probe = min(p.next_probe, max(now, earliest))

    def next_wakeup(self) -> float | None:
        """When the next probe falls due (None: nothing to probe or all in flight)."""
        times = [p.next_probe for p in self._peers.values() if not p.in_flight]
        return min(times) if times else None

    def on_result(self, peer: str, ok: bool, now: float) -> ProbeResult:
        p = self._peers.get(peer)
        if p is None:
            return ProbeResult.IGNORED
        p.in_flight = False
        if ok:
            event, p.failures = PeerEvent.PROBE_OK, 0
        else:
            p.failures += 1
            last = p.failures >= self.failure_threshold
            event = PeerEvent.PROBE_FAILED_LAST if last else PeerEvent.PROBE_FAILED
        old, p.state = p.state, next_state(p.state, event)
        return _probe_result(old, p.state)


# ------------------------------------------------------------------ verdicts


@dataclass(frozen=True)
class PeerVerdict:
    """Why and how long a decode rank holds a peer dead."""

    reason: str
    until: float  # inf for a heartbeat verdict: only `recovered` ends it
    # New rooms fail at once before this; after it (a heartbeat verdict) they
    # wait for one probe.
    refuse_until: float


class Gate(enum.Enum):
    PROCEED = "proceed"  # no verdict: fetch /route
    HOLD = "hold"  # heartbeat verdict: probe first
    REFUSE = "refuse"  # operator report: fail now


class PeerVerdicts:
    """The verdicts new rooms are gated on (kept by the decode room table)."""

    def __init__(self) -> None:
        self._dead: dict[str, PeerVerdict] = {}

    def declare(
        self, peer: str, reason: str, now: float, *, until_recovered: bool, bootstrap_s: float
    ) -> None:
        until = math.inf if until_recovered else now + bootstrap_s
        refuse_until = -math.inf if until_recovered else until
        old = self._dead.get(peer)
        if old is not None and old.until > now:
            until, reason = max(until, old.until), old.reason
            refuse_until = max(refuse_until, old.refuse_until)
        self._dead[peer] = PeerVerdict(reason, until, refuse_until)

    def recovered(self, peer: str) -> None:
        self._dead.pop(peer, None)

    def gate(self, peer: str, now: float) -> tuple[Gate, str | None]:
        """What a new room on `peer` (its instance address) does now, and the reason."""
        held: str | None = None
        for _, v in self._holding(peer, now):
            if v.refuse_until > now:
                return Gate.REFUSE, v.reason
            held = held or v.reason
        return (Gate.HOLD, held) if held is not None else (Gate.PROCEED, None)

    def reason_for(self, peer: str, now: float) -> str | None:
        """Why `peer` is held dead now, or None."""
        return next((v.reason for _, v in self._holding(peer, now)), None)

    def current(self, now: float) -> Iterator[tuple[str, PeerVerdict]]:
        """Verdicts that still hold, after forgetting the expired ones."""
        self._dead = {p: v for p, v in self._dead.items() if v.until > now}
        yield from list(self._dead.items())

    def down(self, now: float) -> dict[str, str]:
        return {p: v.reason for p, v in self._dead.items() if v.until > now}

    def _holding(self, peer: str, now: float) -> Iterator[tuple[str, PeerVerdict]]:
        for dead, v in self._dead.items():
            if v.until > now and peer_matches(dead, peer):
                yield dead, v


# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class PeerAction:
    """An action about one prefill instance, named by its bootstrap address `peer`."""

    peer: str


@dataclass(frozen=True)
class StartProbe(PeerAction):
    """Probe `peer`'s `GET /health` within `timeout_s`; report with `on_probe`
    (with the start id the answer names, if any)."""

    timeout_s: float


@dataclass(frozen=True)
class FailHeldRooms(PeerAction):
    """A probe of `peer` failed: the rooms held for it fail (`probe_failed`)."""


@dataclass(frozen=True)
class DeclareUnreachable(PeerAction):
    """`peer` just crossed the threshold: log, count `peer_dead`, then report
    it lost (`lost`, reason `prefill_unreachable`, not definitive, until it answers)."""


@dataclass(frozen=True)
class PeerAnswers(PeerAction):
    """A verdict on `peer` is undone: log that it answers again."""


@dataclass(frozen=True)
class ForgetRoute(PeerAction):
    """Drop the cached /route answer of `peer`: it may be on new rank addresses."""


@dataclass(frozen=True)
class ResumeHeld:
    """These peers answer again (`peer_recovered` each): rooms held for them fetch /route."""

    peers: tuple[str, ...]


@dataclass(frozen=True)
class CheckRestart(PeerAction):
    """A quarantined instance answers: fetch its /route, report with `restart_checked`."""


@dataclass(frozen=True)
class DropSockets:
    """Close the connections to these rank endpoints: nobody reads them any more."""

    endpoints: tuple[str, ...]


@dataclass(frozen=True)
class FailPeerRooms(PeerAction):
    """Fail every room tied to `peer` (`fail_peer` with these flags)."""

    reason: str
    definitive: bool
    until_recovered: bool
    incarnation: str | None = None  # the report's (`fail_peer`), passed through


@dataclass(frozen=True)
class ReleaseRestarted:
    """`endpoint` registered elsewhere: its process is gone. Log, drop its
    socket and fail its rooms definitively (`prefill_restarted`), freeing pages."""

    endpoint: str


@dataclass(frozen=True)
class ForgetIdle(PeerAction):
    """No room used `peer` for `idle_s`: log, count, drop its bootstrap client."""


LivenessAction = (
    StartProbe
    | FailHeldRooms
    | DeclareUnreachable
    | PeerAnswers
    | ForgetRoute
    | ResumeHeld
    | CheckRestart
    | DropSockets
    | FailPeerRooms
    | ReleaseRestarted
    | ForgetIdle
)


# ------------------------------------------------------------------ the machine


class PeerLiveness:
    """What a decode rank knows and decides about its prefill peers.

    `bootstrap_s`: how long an operator report lasts. `one_sided`: the
    transport writes into our memory (shm), so a peer that merely stopped
    answering is quarantined rather than cut off.
    """

    def __init__(self, heartbeat: HeartbeatTracker, *, bootstrap_s: float, one_sided: bool) -> None:
        self.heartbeat = heartbeat
        self.bootstrap_s = bootstrap_s
        self.one_sided = one_sided
        # peer -> when its probe in flight started.
        self._probing: dict[str, float] = {}
        # Lost target (as given) -> when it was declared lost. Only an answer
        # to a request that *started* later may revive it.
        self._lost_at: dict[str, float] = {}
        # The definitive reports among them: target -> (when, the start ids each
        # instance it covers was seen serving before it; None where one report
        # found none seen). Only an answer from another start undoes it before
        # bootstrap_s: that is a new process.
        self._gone: dict[str, tuple[float, dict[str, frozenset[str] | None]]] = {}
        # Watched peer -> the start id its latest probe answer named.
        self._starts: dict[str, str] = {}
        # Watched peer -> when its probes declared it dead. Kept (unlike
        # `_lost_at`) until it answers again: a restart can take longer than
        # `bootstrap_s`, and a fresh /route answer must still revive it then,
        # or its next death would go unreported (STILL_DEAD, no verdict).
        self._dead_at: dict[str, float] = {}
        # shm only: instance -> rank endpoints it had when it stopped answering.
        self._quarantined: dict[str, set[str]] = {}

    # -------------------------------------------------------------- queries
    def peers(self) -> list[str]:
        return self.heartbeat.peers()

    def watched_by(self, peer: str) -> list[str]:
        """The watched instances a loss of `peer` (instance, endpoint or host) hits."""
        return [w for w in self.heartbeat.peers() if peer_matches(peer, w)]

    def quarantined(self) -> dict[str, frozenset[str]]:
        return {p: frozenset(e) for p, e in self._quarantined.items()}

    def is_quarantined(self, peer: str) -> bool:
        return peer in self._quarantined

    # -------------------------------------------------------------- events
    def watch(self, peer: str, now: float) -> None:
        """A room uses `peer`: probe it from now on (idempotent)."""
        if peer not in self.heartbeat.peers():
            self.heartbeat.add(peer, now)

    def hold(self, peer: str, now: float) -> None:
        """A room on `peer` was refused or held for a probe: probe soon."""
        self.heartbeat.hasten(peer, now)

    def tick(self, now: float, in_use: Iterable[str]) -> list[LivenessAction]:
        """Expire old reports, forget idle peers, start the probes due.

        `in_use`: the instances some room uses now.
        """
        # The room table forgets a lost peer after bootstrap_s; so may we.
        horizon = now - self.bootstrap_s
        self._lost_at = {p: at for p, at in self._lost_at.items() if at > horizon}
        self._gone = {p: g for p, g in self._gone.items() if g[0] > horizon}
        dropped = self.heartbeat.prune_idle(now, set(in_use) | set(self._quarantined))
        for p in dropped:
            # Added back fresh: a start seen before it was forgotten proves nothing then.
            self._starts.pop(p, None)
        acts: list[LivenessAction] = [ForgetIdle(p) for p in dropped]
        return acts + self.start_probes(now)

    def start_probes(self, now: float) -> list[LivenessAction]:
        acts: list[LivenessAction] = []
        for peer in self.heartbeat.due(now):
            if peer in self._probing:
                continue
            self._probing[peer] = now
            acts.append(StartProbe(peer, self.heartbeat.probe_timeout_s))
        return acts

    def on_probe(
        self, peer: str, ok: bool, now: float, start: str | None = None
    ) -> list[LivenessAction]:
        """A probe's result; `start`: the start id its answer named (None: none)."""
        started = self._probing.pop(peer, 0.0)
        result = self.heartbeat.on_result(peer, ok, now)
        acts: list[LivenessAction] = []
        if not ok:
            # Rooms held for this probe (the peer was already declared dead) fail now.
            acts.append(FailHeldRooms(peer))
        if result is ProbeResult.DEAD:
            self._dead_at[peer] = now
            acts.append(DeclareUnreachable(peer))
        elif result in (ProbeResult.OK, ProbeResult.RECOVERED):
            recovered = result is ProbeResult.RECOVERED
            acts += self._revive(peer, started, recovered=recovered, refetch=True, start=start)
            if start is None:
                self._starts.pop(peer, None)  # which start answers is not known now
            else:
                self._starts[peer] = start
        return acts

    def on_route_answer(self, peer: str, started: float) -> list[LivenessAction]:
        """/route answered a request sent at `started`: as good as a probe.

        A restarted instance is used as soon as it answers, not one interval
        later. /route names no start: it never undoes a definitive report.
        """
        return self._revive(peer, started, recovered=False, refetch=False)

    def lost(
        self,
        peer: str,
        reason: str,
        now: float,
        *,
        definitive: bool,
        until_recovered: bool = False,
        rooms: Iterable[tuple[str, ...]] = (),
        routes: Mapping[str, Iterable[str]] | None = None,
        incarnation: str | None = None,
    ) -> list[LivenessAction]:
        """A heartbeat death or an operator report (`definitive`: the pod is gone)
        about what `peer` serves now (`incarnation`, passed on to the room table).

        `rooms`: each room's peers (its instance, then its rank endpoints);
        `routes`: the rank endpoints of the cached /route answer of each
        instance in `watched_by(peer)` (empty when none is cached).
        """
        self._lost_at[peer] = now
        if definitive:
            self._gone[peer] = (now, self._gone_about(peer, now))
        quarantine = self.one_sided and not definitive
        # Rank endpoints of each lost instance: what the rooms use, and /route's answer.
        hit: dict[str, set[str]] = {}
        for instance, *used in rooms:
            if peer_matches(peer, instance, *used):
                hit.setdefault(instance, set()).update(used)
        acts: list[LivenessAction] = []
        for watched, endpoints in (routes or {}).items():
            hit.setdefault(watched, set()).update(endpoints)
            acts.append(ForgetRoute(watched))
        for instance, endpoints in hit.items():
            if quarantine:
                # Keep the sockets: the ABORTs queued on them reach the process
                # if it resumes, and its acks free the pages.
                self._quarantined.setdefault(instance, set()).update(endpoints)
            elif endpoints:
                # Sockets to a dead process only queue messages nobody reads.
                acts.append(DropSockets(tuple(endpoints)))
        if definitive:
            for watched in [w for w in self._quarantined if peer_matches(peer, w)]:
                del self._quarantined[watched]
        acts.append(FailPeerRooms(peer, reason, definitive, until_recovered, incarnation))
        return acts

    def restart_checked(self, peer: str, endpoints: Iterable[str] | None) -> list[LivenessAction]:
        """A quarantined instance's /route answer (None: it did not answer).

        Its endpoints not in the answer belong to a process that is gone; the
        ones still there are the same process resumed, which will ack. Call
        `keep_quarantined` after performing the actions.
        """
        old = self._quarantined.get(peer)
        if old is None or endpoints is None:
            return []  # settled meanwhile, or not answering /route yet: the next probe retries
        gone = old - set(endpoints)
        self._quarantined[peer] = old - gone
        return [ReleaseRestarted(e) for e in sorted(gone)]

    def keep_quarantined(self, peer: str, waiting: Iterable[str]) -> None:
        """Keep watching the endpoints some room still waits on (the answer may be stale)."""
        old = self._quarantined.get(peer)
        if old is None:
            return
        left = old & set(waiting)
        if left:
            self._quarantined[peer] = left
        else:
            del self._quarantined[peer]

    # -------------------------------------------------------------- helpers
    def _revive(
        self,
        peer: str,
        started: float,
        *,
        recovered: bool,
        refetch: bool,
        start: str | None = None,
    ) -> list[LivenessAction]:
        """`peer` answered a request sent at `started`, naming `start` (None: no
        start id): undo the verdicts that answer undoes (module docstring)."""
        matching = [p for p in self._lost_at if peer_matches(p, peer)]
        revived = [
            p
            for p in matching
            if self._lost_at[p] <= started and self._is_undone_by(p, peer, start)
        ]
        # A report still standing keeps the peer's one verdict record, so its
        # heartbeat death is not undone now either: the next answer may.
        standing = len(revived) < len(matching)
        dead_at = self._dead_at.get(peer)
        recovered = not standing and (recovered or (dead_at is not None and dead_at <= started))
        if recovered:
            self._dead_at.pop(peer, None)
        acts: list[LivenessAction] = []
        if recovered or revived:
            acts.append(PeerAnswers(peer))
            self.heartbeat.mark_alive(peer)
            if refetch:
                # It may have restarted on new rank addresses: fetch /route afresh.
                acts.append(ForgetRoute(peer))
            for p in revived:
                del self._lost_at[p]
                self._gone.pop(p, None)
            acts.append(ResumeHeld(tuple(revived) if standing else (peer, *revived)))
        if peer in self._quarantined:
            acts.append(CheckRestart(peer))
        return acts

    def _gone_about(self, peer: str, now: float) -> dict[str, frozenset[str] | None]:
        """Which start of each instance a definitive report on `peer` is about:
        the latest this rank saw answering there, with those of an earlier
        report still standing on it (a start that report was about is no
        proof either). Unseen (None) stays unseen: nothing is proof then."""
        old = self._gone.get(peer)
        earlier = old[1] if old is not None and old[0] > now - self.bootstrap_s else {}
        about: dict[str, frozenset[str] | None] = {}
        for w in set(self.watched_by(peer)) | set(earlier):
            seen = self._starts.get(w)
            before = earlier.get(w, frozenset())
            if seen is None or before is None:
                about[w] = None
            else:
                about[w] = before | {seen}
        return about

    def _is_undone_by(self, report: str, peer: str, start: str | None) -> bool:
        """Whether `peer` answering as `start` undoes the report on `report` (that
        answer's request started after it): any answer undoes one that is not
        definitive; a definitive one only an answer from another start than the
        one it is about (known: seen at `peer` before the report)."""
        gone = self._gone.get(report)
        if gone is None:
            return True
        about = gone[1].get(peer)
        return about is not None and start is not None and start not in about
