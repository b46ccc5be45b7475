"""The sending half of an endpoint: one DEALER per peer, owned by the I/O thread.

Every method runs on the endpoint's I/O thread; nothing here is thread-safe
and nothing needs to be.

Invariants:
- a message is handed to libzmq only if the peer is connected (IMMEDIATE):
  otherwise it waits in that peer's outbox, in order, where it can fail
  ("send_timeout"), be withdrawn by tag ("discarded") or fail with its peer
  ("peer_dropped"); later messages to the peer never overtake it;
- every `on_sent` fires exactly once: None when libzmq released a tracked
  payload it took (or, for one under `copy_below` bytes, took its own copy),
  else the reason the message did not leave. A small payload is copied, not
  tracked, because a tracker's release reaches Python about a millisecond
  after libzmq let go (pyzmq's release goes through its own thread), longer
  than copying it takes, and a short prompt's Success waits on that release;
- a peer that keeps a tracked payload inside libzmq longer than
  `send_timeout` (it is connected but does not read: a hung process) is
  dropped, so its payloads fail ("peer_stalled") and their buffers come
  back: one stuck peer must not hold every staging buffer of the sender,
  and with them the transfers to every other peer. A copied payload holds
  no buffer of ours; libzmq's queue for the peer is bounded by the
  high-water mark, and past it messages wait in the outbox, where they
  time out;
- every frame leaves as [kind, our address, proof, body...], the proof
  binding our address to this DEALER's random routing id (`identity.py`);
- at most `max_peers` DEALERs are open: a new peer closes the least recently
  used idle one (nothing queued, no payload in libzmq), and a DEALER unused
  for `idle_timeout` closes on its own; a later send reconnects.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import zmq

from pdcluster.runtime.transfer.curve import CurveKeys, make_client
from pdcluster.runtime.transfer.identity import identity_key, new_routing_id, prove

log = logging.getLogger(__name__)

SentCallback = Callable[[str | None], None]  # None, or why the payload was not sent


@dataclass
class _Outgoing:
    parts: list[Any]
    on_sent: SentCallback | None
    tag: int | None
    queued_at: float


@dataclass
class _Peer:
    socket: zmq.Socket[Any]
    proof: bytes  # our address, bound to this socket's routing id
    used_at: float = 0.0  # last send
    # Messages libzmq refused (peer not connected, or high-water mark); flushed
    # in order on POLLOUT, failed with "send_timeout" when they waited too long.
    outbox: deque[_Outgoing] = field(default_factory=deque)


@dataclass
class _Tracked:
    """A zero-copy payload libzmq may still read."""

    tracker: zmq.MessageTracker
    on_sent: SentCallback
    peer: str
    taken_at: float  # when libzmq took it
    error: str | None = None  # set when its peer was dropped before it left


# repr=False: `key` and `curve` are secrets.
@dataclass(eq=False, repr=False)
class Outbound:
    """Connections to peers, their outboxes, and the payloads libzmq still holds."""

    ctx: zmq.Context[Any]
    poller: zmq.Poller
    stats: Counter[str]
    _: KW_ONLY
    send_hwm: int
    send_timeout: float
    curve: CurveKeys | None = None
    sender: bytes = b""
    key: bytes = field(default_factory=lambda: identity_key(""))
    max_peers: int = 256
    idle_timeout: float = 300.0
    copy_below: int = 0
    # Least recently used first.
    _peers: OrderedDict[str, _Peer] = field(default_factory=OrderedDict, init=False)
    _trackers: list[_Tracked] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.max_peers < 1 or self.idle_timeout <= 0:
            raise ValueError("max_peers must be >= 1 and idle_timeout > 0")

    def poll_timeout(self) -> int | None:
        """Milliseconds the I/O loop may sleep before `service` has work again."""
        if self._trackers:
            return 1  # owners want their payload buffers back promptly
        if any(peer.outbox for peer in self._peers.values()):
            return 100  # to expire messages whose peer never shows up
        if self._peers:
            return 1000  # to close DEALERs left idle
        return None

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def send(
        self,
        addr: str,
        parts: list[Any],
        on_sent: SentCallback | None = None,
        tag: int | None = None,
    ) -> None:
        peer = self._peers.get(addr)
        if peer is None:
            try:
                peer = self._connect(addr)
            except zmq.ZMQError as err:
                # An address libzmq refuses (it came from a peer's frame): drop
                # this send, never the I/O loop that serves every other peer.
                if on_sent is not None:
                    on_sent(f"cannot connect to {addr!r}: {err}")
                return
        self._peers.move_to_end(addr)
        peer.used_at = time.monotonic()
        parts = [parts[0], self.sender, peer.proof, *parts[1:]]
        if peer.outbox:
            peer.outbox.append(_Outgoing(parts, on_sent, tag, time.monotonic()))
            return
        if not self._try_send(addr, peer, parts, on_sent):
            peer.outbox.append(_Outgoing(parts, on_sent, tag, time.monotonic()))
            self.poller.register(peer.socket, zmq.POLLOUT)

    def discard(self, tag: int) -> None:
        for peer in self._peers.values():
            if not any(item.tag == tag for item in peer.outbox):
                continue
            kept: deque[_Outgoing] = deque()
            for item in peer.outbox:
                if item.tag == tag:
                    self.stats["send_discarded"] += 1
                    self._notify(item.on_sent, "discarded")
                else:
                    kept.append(item)
            peer.outbox = kept
            if not kept:
                self.poller.unregister(peer.socket)

    def drop(self, addr: str, reason: str, linger_ms: int = 0) -> None:
        peer = self._peers.pop(addr, None)
        if peer is None:
            return
        if peer.outbox:
            self.poller.unregister(peer.socket)
        # LINGER 0: libzmq discards what it still queues. Its trackers complete
        # once libzmq let go of the payloads; report those as not delivered.
        peer.socket.close(linger_ms)
        for tracked in self._trackers:
            if tracked.peer == addr and tracked.error is None:
                tracked.error = reason
        while peer.outbox:
            self.stats["send_dropped"] += 1
            self._notify(peer.outbox.popleft().on_sent, reason)

    def service(self, events: dict[Any, int]) -> None:
        """After a poll: flush writable outboxes, expire stale messages, reap trackers."""
        for addr, peer in list(self._peers.items()):
            if peer.outbox and events.get(peer.socket, 0) & zmq.POLLOUT:
                self._flush(addr, peer)
            if peer.outbox:
                self._expire(peer)
        self.reap()
        self._drop_stalled()
        self._close_idle(time.monotonic() - self.idle_timeout)

    def _is_idle(self, addr: str, peer: _Peer) -> bool:
        return not peer.outbox and not any(t.peer == addr for t in self._trackers)

    def _close_idle(self, unused_since: float) -> None:
        for addr, peer in list(self._peers.items()):
            if peer.used_at >= unused_since:
                break  # least recently used first: the rest are newer
            if self._is_idle(addr, peer):
                self.stats["peer_idle_closed"] += 1
                self._retire(addr)

    def _retire(self, addr: str) -> None:
        # Nothing of ours is queued or tracked; a short linger lets control
        # messages libzmq took (untracked) still leave.
        self.drop(addr, "peer_idle_closed", linger_ms=1000)

    def reap(self) -> None:
        if not self._trackers:
            return
        pending = []
        for tracked in self._trackers:
            if tracked.tracker.done:
                self._notify(tracked.on_sent, tracked.error)
            else:
                pending.append(tracked)
        self._trackers = pending

    def _drop_stalled(self) -> None:
        if not self._trackers:
            return
        deadline = time.monotonic() - self.send_timeout
        stalled = {
            t.peer
            for t in self._trackers
            if t.taken_at < deadline and t.error is None and t.peer in self._peers
        }
        for addr in stalled:
            self.stats["peer_stalled"] += 1
            log.warning("peer %s took no data for %.1fs: dropping it", addr, self.send_timeout)
            self.drop(addr, "peer_stalled")

    def close(self) -> None:
        """Drop every peer; call before terminating the context."""
        self.reap()  # payloads already sent are reported as sent
        for addr in list(self._peers):
            self.drop(addr, "endpoint_closed")

    def abandon_trackers(self) -> None:
        """After the context terminated: libzmq reads no payload any more."""
        trackers, self._trackers = self._trackers, []
        for tracked in trackers:
            # Not reaped before close: delivery is unknown, report it as not sent.
            self._notify(tracked.on_sent, tracked.error or "endpoint_closed")

    def notify(self, on_sent: SentCallback | None, error: str | None) -> None:
        self._notify(on_sent, error)

    # ---- internals -------------------------------------------------------

    def _connect(self, addr: str) -> _Peer:
        if len(self._peers) >= self.max_peers:
            victim = next((a for a, p in self._peers.items() if self._is_idle(a, p)), None)
            if victim is None:
                self.stats["peers_over_cap"] += 1  # all busy: exceed rather than fail a send
            else:
                self.stats["peer_evicted"] += 1
                self._retire(victim)
        routing_id = new_routing_id()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.setsockopt(zmq.RCVHWM, 16)  # peers send us only refusals here; never read
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.send_hwm)
        # Queue nothing inside libzmq for a peer that is not connected: such
        # messages wait in our outbox, where they can time out or be dropped.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.curve is not None:
            make_client(sock, self.curve)
        try:
            sock.connect(addr)
        except zmq.ZMQError:
            sock.close(0)
            raise
        peer = _Peer(sock, prove(self.key, routing_id, self.sender))
        self._peers[addr] = peer
        return peer

    def _try_send(
        self, addr: str, peer: _Peer, parts: list[Any], on_sent: SentCallback | None
    ) -> bool:
        copy = on_sent is not None and _num_bytes(parts) < self.copy_below
        try:
            tracker = peer.socket.send_multipart(
                parts, flags=zmq.NOBLOCK, copy=copy, track=on_sent is not None and not copy
            )
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            self.stats["send_failed"] += 1
            self._notify(on_sent, f"send_failed: {exc}")
            return True
        if copy:
            self.stats["kv_copied"] += 1
            self._notify(on_sent, None)  # libzmq holds its own copy: the buffer is free
        elif on_sent is not None:
            assert isinstance(tracker, zmq.MessageTracker)
            self._trackers.append(_Tracked(tracker, on_sent, addr, time.monotonic()))
        return True

    def _flush(self, addr: str, peer: _Peer) -> None:
        while peer.outbox:
            item = peer.outbox[0]
            if not self._try_send(addr, peer, item.parts, item.on_sent):
                return
            peer.outbox.popleft()
        self.poller.unregister(peer.socket)

    def _expire(self, peer: _Peer) -> None:
        # Oldest first: failing only from the front keeps the rest in order.
        deadline = time.monotonic() - self.send_timeout
        while peer.outbox and peer.outbox[0].queued_at < deadline:
            self.stats["send_timeout"] += 1
            self._notify(peer.outbox.popleft().on_sent, "send_timeout")
        if not peer.outbox:
            self.poller.unregister(peer.socket)

    def _notify(self, on_sent: SentCallback | None, error: str | None) -> None:
        if on_sent is None:
            return
        try:
            on_sent(error)
        except Exception:
            self.stats["callback_error"] += 1
            log.exception("on_sent callback failed")


def _num_bytes(parts: list[Any]) -> int:
    return sum(memoryview(part).nbytes for part in parts)
