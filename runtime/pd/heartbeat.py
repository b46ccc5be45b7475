"""Heartbeat bookkeeping for the prefill instances a decode rank talks to.

The decode worker probes each known prefill instance's `GET /health` every
`interval_s` (default 5 s) and declares it dead after `failure_threshold`
(default 2) consecutive failures; one success resets the count. On DEAD the
worker calls `DecodeRoomTable.fail_peer(peer, "prefill_unreachable")`, drops
cached addresses and connections, and re-fetches /route when the peer is
used again (RECOVERED says probes succeed again). A new room on a peer declared dead
waits for one probe brought forward by `hasten`, not for the next interval.

Timing: probes start on a fixed cadence (`interval_s` after the previous
probe *started*), and each probe must be bounded by `probe_timeout_s`
(default min(interval / 2, 1 s): a timed-out probe is over before the next
one falls due). A peer that hangs right after a good probe is therefore
declared dead within `failure_threshold × interval_s + probe_timeout_s` —
under the `interval × threshold + 1 s` bound of docs/design.md §8.

I/O contract: `due(now)` returns the peers to probe now (and marks them in
flight); the I/O loop probes them without blocking, with `probe_timeout_s`,
and reports each with `on_result(peer, ok, now)`.

Idle peers: a peer stays watched only while it is used. `prune_idle(now,
in_use)` (called on every tick with the peers some room or quarantine still
needs) forgets a peer that no one used for `idle_s` (default 300 s) and
returns it, so the I/O loop can drop its bootstrap client too; the next room
on it `add`s it again (its first probe due at once). Without this every
prefill a decode rank ever talked to would be probed for the life of the
process, long after a scale-down or a rollout removed it.

Pure module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    OK = "ok"  # alive (and was alive)
    FAILING = "failing"  # a failure below the threshold
    DEAD = "dead"  # just crossed the threshold: fail its rooms now (reported once per outage)
    STILL_DEAD = "still_dead"
    RECOVERED = "recovered"  # was dead, answers again
    IGNORED = "ignored"  # result for a peer no longer tracked


@dataclass
class _Peer:
    next_probe: float
    failures: int = 0
    dead: bool = False
    in_flight: bool = False
    last_start: float | None = None  # when the latest probe started
    last_used: float = 0.0  # when a room (or quarantine) last needed it


class HeartbeatTracker:
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

    def is_dead(self, peer: str) -> bool:
        p = self._peers.get(peer)
        return p is not None and p.dead

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
            p.failures, p.dead = 0, False

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

    def on_result(self, peer: str, ok: bool, now: float) -> Verdict:
        p = self._peers.get(peer)
        if p is None:
            return Verdict.IGNORED
        p.in_flight = False
        if ok:
            was_dead = p.dead
            p.failures, p.dead = 0, False
            return Verdict.RECOVERED if was_dead else Verdict.OK
        p.failures += 1
        if p.dead:
            return Verdict.STILL_DEAD
        if p.failures >= self.failure_threshold:
            p.dead = True
            return Verdict.DEAD
        return Verdict.FAILING
