"""One ZMQ endpoint per rank: control messages and KV frames, in and out.

Wire format (multipart; the ROUTER prepends the DEALER's identity):
    control: [b"C", sender_address, data]
    kv:      [b"K", header, payload]

Threading: one I/O thread owns every socket (the ROUTER it serves and one
DEALER per peer). ZMQ sockets are not thread-safe, so other threads only
append commands to a queue and write a byte to a wakeup pipe that the I/O
thread polls together with its sockets. Callbacks (`on_control`, `on_kv`)
run on the I/O thread: they must not block, and may call `send_*`.

Ordering: everything sent to one peer goes through one DEALER, so the peer
sees control messages and KV frames in submission order; a completion
message submitted after a job's frames arrives after them.

Zero-copy: a KV payload is handed to libzmq without a copy and tracked;
`on_sent` fires once libzmq released the buffer (sent, or dropped with its
peer), and only then may the caller reuse that memory.

Hostile input: a message with the wrong number of parts, an unknown kind or
an oversized part is dropped and counted in `stats` by reason; libzmq itself
disconnects a peer whose frame exceeds the socket's size cap. Nothing a
peer sends can stop the I/O thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from pdcluster.runtime.transfer.frames import MAX_HEADER_BYTES, MiB

log = logging.getLogger(__name__)

KIND_CONTROL = b"C"
KIND_KV = b"K"
MAX_ADDRESS_BYTES = 256

ControlHandler = Callable[[str, bytes], None]  # (sender address, data)
KVHandler = Callable[[bytes, memoryview], None]  # (header, payload); payload valid during call
SentCallback = Callable[[str | None], None]  # None, or why the payload was not sent


@dataclass(frozen=True)
class EndpointConfig:
    """Endpoint settings. Sizes in bytes, counts in messages."""

    host: str = "127.0.0.1"  # interface the ROUTER binds
    port: int = 0  # 0 picks a free port
    advertise_host: str | None = None  # address peers dial, when host is a wildcard
    max_control_bytes: int = 1 * MiB
    max_kv_bytes: int = 64 * MiB  # must exceed the senders' max frame size
    send_hwm: int = 1000  # messages libzmq queues per connected peer
    send_timeout: float = 30.0  # seconds a message may wait for its peer before it fails
    recv_hwm: int = 64  # buffered messages per peer before TCP pushes back
    io_threads: int = 1  # libzmq I/O threads


def check_address(address: str) -> str:
    """Validate a peer address ("tcp://host:port"); return it unchanged."""
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_BYTES:
        raise ValueError(f"peer address must be a short string, got {address!r}")
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise ValueError(f"peer address must look like tcp://host:port, got {address!r}")
    if not 0 < int(port) < 65536:
        raise ValueError(f"peer port out of range in {address!r}")
    return address


@dataclass
class _Outgoing:
    parts: list[Any]
    on_sent: SentCallback | None
    tag: int | None
    queued_at: float


@dataclass
class _Peer:
    socket: zmq.Socket[Any]
    # Messages libzmq refused (peer not connected, or high-water mark); flushed
    # in order on POLLOUT, failed with "send_timeout" when they waited too long.
    outbox: deque[_Outgoing] = field(default_factory=deque)


@dataclass
class _Tracked:
    """A zero-copy payload libzmq may still read."""

    tracker: zmq.MessageTracker
    on_sent: SentCallback
    peer: str
    error: str | None = None  # set when its peer was dropped before it left


class Endpoint:
    """A rank's ZMQ endpoint. `start()` binds and starts the I/O thread."""

    def __init__(
        self,
        config: EndpointConfig | None = None,
        *,
        on_control: ControlHandler | None = None,
        on_kv: KVHandler | None = None,
    ) -> None:
        self.config = config or EndpointConfig()
        if self.config.host in ("0.0.0.0", "*", "::") and not self.config.advertise_host:
            raise ValueError("binding a wildcard host needs advertise_host for peers to dial")
        self.on_control = on_control
        self.on_kv = on_kv
        self._stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._state = "new"  # new -> running -> closing -> closed
        self._commands: deque[tuple[Any, ...]] = deque()
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._address = ""
        self._ctx: zmq.Context[Any] | None = None
        self._router: zmq.Socket[Any] | None = None
        # Owned by the I/O thread only:
        self._peers: dict[str, _Peer] = {}
        self._trackers: list[_Tracked] = []
        self._poller = zmq.Poller()

    # ---- lifecycle -------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"endpoint already {self._state}")
            cfg = self.config
            ctx: zmq.Context[Any] = zmq.Context(io_threads=cfg.io_threads)
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.RCVHWM, cfg.recv_hwm)
            # libzmq drops the connection of a peer sending a frame above this cap,
            # before allocating it; the app-level limits below it are counted.
            cap = max(cfg.max_kv_bytes, cfg.max_control_bytes, MAX_HEADER_BYTES) + 64 * 1024
            router.setsockopt(zmq.MAXMSGSIZE, cap)
            try:
                if cfg.port:
                    router.bind(f"tcp://{cfg.host}:{cfg.port}")
                else:
                    router.bind_to_random_port(f"tcp://{cfg.host}")
            except zmq.ZMQError as exc:
                router.close(0)
                ctx.term()
                raise OSError(f"cannot bind tcp://{cfg.host}:{cfg.port or '*'}: {exc}") from exc
            bound = router.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(bound, bytes)
            port = bound.decode().rpartition(":")[2]
            self._address = f"tcp://{cfg.advertise_host or cfg.host}:{port}"
            self._ctx, self._router = ctx, router
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            self._state = "running"
            # Thread.start is a memory barrier: the sockets migrate to the I/O thread.
            self._thread = threading.Thread(target=self._run, name=f"endpoint{port}", daemon=True)
            self._thread.start()

    @property
    def address(self) -> str:
        """The address peers dial ("tcp://host:port"); set by start()."""
        if not self._address:
            raise RuntimeError("endpoint not started")
        return self._address

    @property
    def stats(self) -> dict[str, int]:
        """Counts of dropped inbound messages and failed sends, by reason."""
        return dict(self._stats)

    @property
    def is_running(self) -> bool:
        return self._state == "running"

    def close(self, timeout: float = 5.0) -> None:
        """Stop the I/O thread, drop queued sends, release every socket.

        Pending `on_sent` callbacks fire with "endpoint_closed". Raises
        TimeoutError if a callback blocks the I/O thread past `timeout`.
        """
        with self._lock:
            if self._state == "new":
                self._state = "closed"
                return
            if self._state == "running":
                self._state = "closing"
                self._commands.append(("close",))
                self._wake()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return  # closing from a callback: the loop exits after it returns
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"endpoint I/O thread still busy after {timeout}s (callback?)")
        with self._lock:
            if self._wake_w >= 0:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1
            self._state = "closed"

    # ---- commands from any thread ----------------------------------------

    def send_control(self, peer: str, data: bytes) -> None:
        """Queue a control message to `peer`; raises if closed or oversized."""
        if len(data) > self.config.max_control_bytes:
            raise ValueError(
                f"control message of {len(data)} bytes > {self.config.max_control_bytes}"
            )
        self._submit(("send", check_address(peer), [KIND_CONTROL, self.address.encode(), data]))

    def send_kv(
        self,
        peer: str,
        header: bytes,
        payload: Any,
        on_sent: SentCallback | None = None,
        tag: int | None = None,
    ) -> None:
        """Queue a KV frame; `payload` (buffer protocol) is sent without a copy.

        The caller must keep `payload`'s memory unchanged until `on_sent`
        fires; a reference is held until then. `tag` (e.g. the room) lets
        `discard` withdraw the frame while it still waits for its peer.
        """
        if len(header) > MAX_HEADER_BYTES:
            raise ValueError(f"header of {len(header)} bytes > {MAX_HEADER_BYTES}")
        nbytes = memoryview(payload).nbytes
        if nbytes > self.config.max_kv_bytes:
            raise ValueError(f"KV payload of {nbytes} bytes > {self.config.max_kv_bytes}")
        self._submit(("send", check_address(peer), [KIND_KV, header, payload], on_sent, tag))

    def discard(self, tag: int) -> None:
        """Withdraw queued frames tagged `tag` that no peer took yet (on_sent: "discarded").

        Frames libzmq already accepted are beyond recall: they are sent, or
        dropped with their peer.
        """
        self._submit(("discard", tag))

    def drop_peer(self, peer: str) -> None:
        """Close the connection to `peer` (e.g. declared dead); queued sends fail."""
        self._submit(("drop", check_address(peer), "peer_dropped"))

    def _submit(self, cmd: tuple[Any, ...]) -> None:
        with self._lock:
            if self._state != "running":
                raise RuntimeError(f"endpoint is {self._state}")
            self._commands.append(cmd)
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: a wakeup is already pending

    # ---- I/O thread ------------------------------------------------------

    def _run(self) -> None:
        assert self._router is not None and self._ctx is not None
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        try:
            while self._step():
                pass
        except Exception:
            log.exception("endpoint %s I/O loop failed; closing", self._address)
        finally:
            self._shutdown()

    def _step(self) -> bool:
        # Poll briefly while libzmq still holds tracked payloads, so their owners
        # get them back promptly; otherwise sleep until something happens.
        timeout: int | None = None
        if self._trackers:
            timeout = 1
        elif any(peer.outbox for peer in self._peers.values()):
            timeout = 100  # to expire messages whose peer never shows up
        events = dict(self._poller.poll(timeout))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "close":
                return False
            if cmd[0] == "send":
                self._send(cmd[1], cmd[2], *cmd[3:])
            elif cmd[0] == "drop":
                self._drop(cmd[1], cmd[2])
            elif cmd[0] == "discard":
                self._discard(cmd[1])
        if self._router in events:
            self._receive_batch()
        for addr, peer in list(self._peers.items()):
            if peer.outbox and events.get(peer.socket, 0) & zmq.POLLOUT:
                self._flush(addr, peer)
            if peer.outbox:
                self._expire(peer)
        self._reap_trackers()
        return True

    def _connect(self, addr: str) -> _Peer:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.send_hwm)
        # Queue nothing inside libzmq for a peer that is not connected: such
        # messages wait in our outbox, where they can time out or be dropped.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(addr)
        peer = _Peer(sock)
        self._peers[addr] = peer
        return peer

    def _send(
        self,
        addr: str,
        parts: list[Any],
        on_sent: SentCallback | None = None,
        tag: int | None = None,
    ) -> None:
        peer = self._peers.get(addr) or self._connect(addr)
        if peer.outbox:
            peer.outbox.append(_Outgoing(parts, on_sent, tag, time.monotonic()))
            return
        if not self._try_send(addr, peer, parts, on_sent):
            peer.outbox.append(_Outgoing(parts, on_sent, tag, time.monotonic()))
            self._poller.register(peer.socket, zmq.POLLOUT)

    def _discard(self, tag: int) -> None:
        for peer in self._peers.values():
            if not any(item.tag == tag for item in peer.outbox):
                continue
            kept: deque[_Outgoing] = deque()
            for item in peer.outbox:
                if item.tag == tag:
                    self._stats["send_discarded"] += 1
                    self._notify(item.on_sent, "discarded")
                else:
                    kept.append(item)
            peer.outbox = kept
            if not kept:
                self._poller.unregister(peer.socket)

    def _try_send(
        self, addr: str, peer: _Peer, parts: list[Any], on_sent: SentCallback | None
    ) -> bool:
        try:
            tracker = peer.socket.send_multipart(
                parts, flags=zmq.NOBLOCK, copy=False, track=on_sent is not None
            )
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            self._stats["send_failed"] += 1
            self._notify(on_sent, f"send_failed: {exc}")
            return True
        if on_sent is not None:
            assert isinstance(tracker, zmq.MessageTracker)
            self._trackers.append(_Tracked(tracker, on_sent, addr))
        return True

    def _flush(self, addr: str, peer: _Peer) -> None:
        while peer.outbox:
            item = peer.outbox[0]
            if not self._try_send(addr, peer, item.parts, item.on_sent):
                return
            peer.outbox.popleft()
        self._poller.unregister(peer.socket)

    def _expire(self, peer: _Peer) -> None:
        # Oldest first: failing only from the front keeps the rest in order.
        deadline = time.monotonic() - self.config.send_timeout
        while peer.outbox and peer.outbox[0].queued_at < deadline:
            self._stats["send_timeout"] += 1
            self._notify(peer.outbox.popleft().on_sent, "send_timeout")
        if not peer.outbox:
            self._poller.unregister(peer.socket)

    def _drop(self, addr: str, reason: str) -> None:
        peer = self._peers.pop(addr, None)
        if peer is None:
            return
        if peer.outbox:
            self._poller.unregister(peer.socket)
        # LINGER 0: libzmq discards what it still queues. Its trackers complete
        # once libzmq let go of the payloads; report those as not delivered.
        peer.socket.close(0)
        for tracked in self._trackers:
            if tracked.peer == addr and tracked.error is None:
                tracked.error = reason
        while peer.outbox:
            self._stats["send_dropped"] += 1
            self._notify(peer.outbox.popleft().on_sent, reason)

    def _reap_trackers(self) -> None:
        if not self._trackers:
            return
        pending = []
        for tracked in self._trackers:
            if tracked.tracker.done:
                self._notify(tracked.on_sent, tracked.error)
            else:
                pending.append(tracked)
        self._trackers = pending

    def _notify(self, on_sent: SentCallback | None, error: str | None) -> None:
        if on_sent is None:
            return
        try:
            on_sent(error)
        except Exception:
            self._stats["callback_error"] += 1
            log.exception("endpoint %s: on_sent callback failed", self._address)

    def _receive_batch(self, limit: int = 64) -> None:
        assert self._router is not None
        # Bounded so queued sends and tracker callbacks are not starved.
        for _ in range(limit):
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._dispatch(parts)
            except Exception:
                self._stats["callback_error"] += 1
                log.exception("endpoint %s: handler failed", self._address)

    def _dispatch(self, parts: list[zmq.Frame]) -> None:
        if len(parts) != 4:
            self._reject("bad_frame_count")
            return
        kind = parts[1].bytes
        if kind == KIND_CONTROL:
            data = parts[3]
            if len(data) > self.config.max_control_bytes:
                self._reject("oversized")
                return
            sender = parts[2].bytes
            if len(sender) > MAX_ADDRESS_BYTES:
                self._reject("bad_sender")
                return
            try:
                sender_addr = check_address(sender.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                self._reject("bad_sender")
                return
            if self.on_control is not None:
                self.on_control(sender_addr, data.bytes)
        elif kind == KIND_KV:
            header, payload = parts[2], parts[3]
            if len(header) > MAX_HEADER_BYTES or len(payload) > self.config.max_kv_bytes:
                self._reject("oversized")
                return
            if self.on_kv is not None:
                self.on_kv(header.bytes, payload.buffer)
        else:
            self._reject("unknown_kind")

    def _reject(self, reason: str) -> None:
        self._stats[reason] += 1
        log.debug("endpoint %s dropped a message: %s", self._address, reason)

    def _shutdown(self) -> None:
        with self._lock:
            # After a crash the loop is gone: refuse new commands from here on.
            if self._state == "running":
                self._state = "closing"
        self._reap_trackers()  # payloads already sent are reported as sent
        for addr in list(self._peers):
            self._drop(addr, "endpoint_closed")
        if self._router is not None:
            self._router.close(0)
        if self._ctx is not None:
            # After term() libzmq holds no message, so no payload is read any more.
            self._ctx.term()
        trackers, self._trackers = self._trackers, []
        for tracked in trackers:
            # Not reaped before close: delivery is unknown, report it as not sent.
            self._notify(tracked.on_sent, tracked.error or "endpoint_closed")
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "send" and len(cmd) > 3:
                self._notify(cmd[3], "endpoint_closed")
