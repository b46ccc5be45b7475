"""One ZMQ endpoint per rank: control messages and KV frames, in and out.

Wire format (multipart; the ROUTER prepends the DEALER's routing id):
    control: [b"C", sender_address, proof, data]
    kv:      [b"K", sender_address, proof, header, payload]
    refusal: [b"R", reason]  (ROUTER -> the refused connection only)

The proof binds the sender address to the connection's routing id (see
`identity.py`): a frame whose proof fails is dropped, counted, and answered
with a refusal on its own connection; handlers get the proven address.

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

The sending half (one DEALER per peer, outboxes for peers not connected
yet, tracked payloads) is `outbound.Outbound`, run by the same thread.

Hostile input: a message with the wrong number of parts, an unknown kind or
an oversized part is dropped and counted in `stats` by reason; libzmq itself
disconnects a peer whose frame exceeds the socket's size cap. Nothing a
peer sends can stop the I/O thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from pdcluster.runtime.transfer.curve import CurveKeys, make_server
from pdcluster.runtime.transfer.frames import MAX_HEADER_BYTES, MiB
from pdcluster.runtime.transfer.identity import check_proof, identity_key, is_loopback
from pdcluster.runtime.transfer.outbound import Outbound, SentCallback

log = logging.getLogger(__name__)

KIND_CONTROL = b"C"
KIND_KV = b"K"
KIND_REFUSED = b"R"
MAX_ADDRESS_BYTES = 256

ControlHandler = Callable[[str, bytes], None]  # (proven sender address, data)
KVHandler = Callable[[bytes, memoryview], None]  # (header, payload); payload valid during call
KVFilter = Callable[[str, bytes], bool]  # (proven sender address, header) -> accept?


@dataclass(frozen=True)
class EndpointConfig:
    """Endpoint settings. Sizes in bytes, counts in messages."""

    host: str = "127.0.0.1"  # interface the ROUTER binds
    port: int = 0  # 0 picks a free port
    advertise_host: str | None = None  # address peers dial, when host is a wildcard
    max_control_bytes: int = 1 * MiB
    max_kv_bytes: int = 64 * MiB  # must exceed the senders' max frame size
    # KV payloads under this size are copied into libzmq at send and reported
    # sent at once; larger ones are sent without a copy and tracked
    # (`outbound.py` says why: a tracker's release is ~1 ms late).
    copy_below: int = MiB // 4
    send_hwm: int = 1000  # messages libzmq queues per connected peer
    # Seconds a message may wait for its peer — queued because it is not connected,
    # or held by libzmq because it does not read — before it fails.
    send_timeout: float = 30.0
    recv_hwm: int = 64  # buffered messages per peer before TCP pushes back
    io_threads: int = 1  # libzmq I/O threads
    # CURVE keys (see `curve.py`): encrypt, and admit only peers holding them.
    curve: CurveKeys | None = None
    # Cluster token keying the sender proofs (see `identity.py`); "" = unkeyed.
    token: str = ""
    # Outbound DEALERs kept open at most (least recently used closed first)...
    max_peers: int = 256
    # ...and seconds one may sit unused (nothing queued or in flight) before it closes.
    peer_idle_timeout: float = 300.0


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


def _peer_ip(frame: zmq.Frame) -> str | None:
    """The IP the frame's connection comes from (libzmq's Peer-Address), if known."""
    try:
        ip = frame.get("Peer-Address")
    except (zmq.ZMQError, KeyError, TypeError):
        return None
    return ip if isinstance(ip, str) else None


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
        if self.config.max_peers < 1 or self.config.peer_idle_timeout <= 0:
            raise ValueError("max_peers must be >= 1 and peer_idle_timeout > 0")
        self.on_control = on_control
        self.on_kv = on_kv
        # Set by the owner before traffic: KV frames it refuses are dropped ("kv_wrong_source").
        self.accept_kv: KVFilter | None = None
        # Set by the owner: control frames it marks are taken only over loopback ("not_loopback").
        self.local_only: Callable[[bytes], bool] | None = None
        self._key = identity_key(self.config.token)
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
        self._poller = zmq.Poller()
        self._out: Outbound | None = None

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
            if cfg.curve is not None:
                make_server(router, cfg.curve)
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
            self._out = Outbound(
                ctx,
                self._poller,
                self._stats,
                send_hwm=cfg.send_hwm,
                send_timeout=cfg.send_timeout,
                curve=cfg.curve,
                sender=self._address.encode(),
                key=self._key,
                max_peers=cfg.max_peers,
                idle_timeout=cfg.peer_idle_timeout,
                copy_below=cfg.copy_below,
            )
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
        self._submit(("send", check_address(peer), [KIND_CONTROL, data]))

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
        assert self._router is not None
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
        out = self._out
        assert out is not None
        events = dict(self._poller.poll(out.poll_timeout()))
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
                out.send(cmd[1], cmd[2], *cmd[3:])
            elif cmd[0] == "drop":
                out.drop(cmd[1], cmd[2])
            elif cmd[0] == "discard":
                out.discard(cmd[1])
        if self._router in events:
            self._receive_batch()
        out.service(events)
        return True

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
        # [routing id, kind, sender, proof, body...]
        kind = parts[1].bytes if len(parts) > 1 else b""
        expected = {KIND_CONTROL: 5, KIND_KV: 6}.get(kind)
        if expected is None:
            self._reject("unknown_kind")
            return
        if len(parts) != expected:
            self._reject("bad_frame_count")
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
        routing_id = parts[0].bytes
        refused = check_proof(self._key, routing_id, sender, parts[3].bytes)
        if refused is not None:
            self._reject(refused)
            self._refuse(routing_id, refused)
            return
        if kind == KIND_CONTROL:
            data = parts[4]
            if len(data) > self.config.max_control_bytes:
                self._reject("oversized")
                return
            body = data.bytes
            if self.local_only is not None and self.local_only(body):
                if not is_loopback(_peer_ip(parts[1])):
                    self._reject("not_loopback")
                    return
            if self.on_control is not None:
                self.on_control(sender_addr, body)
            return
        header, payload = parts[4], parts[5]
        if len(header) > MAX_HEADER_BYTES or len(payload) > self.config.max_kv_bytes:
            self._reject("oversized")
            return
        if self.accept_kv is not None and not self.accept_kv(sender_addr, header.bytes):
            self._reject("kv_wrong_source")
            return
        if self.on_kv is not None:
            self.on_kv(header.bytes, payload.buffer)

    def _refuse(self, routing_id: bytes, reason: str) -> None:
        """Tell the refused connection, and only it, why (never blocks)."""
        assert self._router is not None
        try:
            self._router.send_multipart([routing_id, KIND_REFUSED, reason.encode()], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # gone, or not reading: nothing more is owed

    def _reject(self, reason: str) -> None:
        self._stats[reason] += 1
        log.debug("endpoint %s dropped a message: %s", self._address, reason)

    def _shutdown(self) -> None:
        with self._lock:
            # After a crash the loop is gone: refuse new commands from here on.
            if self._state == "running":
                self._state = "closing"
        out = self._out
        assert out is not None and self._router is not None and self._ctx is not None
        out.close()
        self._router.close(0)
        self._ctx.term()  # afterwards libzmq holds no message, so reads no payload
        out.abandon_trackers()
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "send" and len(cmd) > 3:
                out.notify(cmd[3], "endpoint_closed")
