"""Scripted peers that speak the real PD protocol from inside the test process.

A `RoguePrefill` is a prefill instance of one rank: a real bootstrap server
(`create_bootstrap_app`) and a real ZMQ endpoint; it registers like a prefill
rank, answers layout registrations, and otherwise does only what the test
tells it — so a real decode worker can be held in any KVPoll state, sent a
stale ABORT_ACK, a corrupted KV frame or an incompatible topology.

A `RogueDecode` is a decode rank: it registers its KV layout with a real
prefill rank and sends metadata, BOOTSTRAP and ABORT on the test's cue, so a
real prefill worker can be driven the same way. Both record every control
message and KV frame they receive.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import msgspec

from pdcluster.runtime.engine.config import tiny_config
from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.bootstrap_registry import InstanceInfo, RankRegistration
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd_worker.bootstrap_server import BootstrapServer, create_bootstrap_app
from pdcluster.runtime.transfer.curve import CurveKeys
from pdcluster.runtime.transfer.endpoint import Endpoint, EndpointConfig
from pdcluster.runtime.transfer.frames import KVFrameHeader, decode_header, encode_header

M = TypeVar("M")
P = TypeVar("P", bound="_Peer")
TINY = tiny_config()


def fetch_instance(bootstrap: tuple[str, int], token: str) -> InstanceInfo:
    """GET /route of a real prefill instance (its compat and rank endpoints)."""
    host, port = bootstrap
    resp = httpx.get(
        f"http://{host}:{port}/route",
        params={"dp": -1, "cp": -1, "tp": -1, "pp": -1},
        headers={"Authorization": f"Bearer {token}"},
        timeout=5,
    )
    resp.raise_for_status()
    return msgspec.json.decode(resp.content, type=InstanceInfo)


@dataclass
class _Peer:
    endpoint: Endpoint = field(init=False)
    inbox: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)
    kv: list[tuple[KVFrameHeader, bytes]] = field(default_factory=list)
    seen: list[Any] = field(default_factory=list)
    # Arrival order of control messages and KV frames together.
    order: list[Any] = field(default_factory=list)

    def start(self, curve: CurveKeys | None = None, token: str = "") -> None:
        # `token` keys the proofs binding this endpoint's address to its connections.
        config = EndpointConfig(curve=curve, token=token)
        self.endpoint = Endpoint(config, on_control=self._control, on_kv=self._kv)
        self.endpoint.start()

    @property
    def address(self) -> str:
        return self.endpoint.address

    def _control(self, sender: str, data: bytes) -> None:
        try:
            msg = pdmsg.decode(data)
        except pdmsg.ProtocolError as err:
            msg = err
        self.seen.append(msg)
        self.order.append(msg)
        if not self.auto_reply(sender, msg):
            self.inbox.put((sender, msg))

    def auto_reply(self, sender: str, msg: Any) -> bool:
        return False

    def _kv(self, header: bytes, payload: memoryview) -> None:
        parsed = decode_header(header)
        self.kv.append((parsed, bytes(payload)))
        self.order.append(parsed)

    def send(self, to: str, msg: pdmsg.Message) -> None:
        self.endpoint.send_control(to, pdmsg.encode(msg))

    def send_raw(self, to: str, data: bytes) -> None:
        self.endpoint.send_control(to, data)

    def expect(
        self, kind: type[M], room: int | None = None, timeout: float = 10.0
    ) -> tuple[str, M]:
        """The next message of `kind` (for `room`); others stay recorded in `seen`."""
        deadline = time.monotonic() + timeout
        skipped: list[tuple[str, Any]] = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"no {kind.__name__} for room {room} within {timeout}s; got {skipped}"
                    )
                try:
                    sender, msg = self.inbox.get(timeout=left)
                except queue.Empty:
                    continue
                if isinstance(msg, kind) and (room is None or getattr(msg, "room", None) == room):
                    return sender, msg
                skipped.append((sender, msg))
        finally:
            for item in skipped:
                self.inbox.put(item)

    def quiet(self, kind: type[Any], room: int, wait: float) -> bool:
        """True if no `kind` message for `room` arrives within `wait` seconds."""
        time.sleep(wait)
        return not any(isinstance(m, kind) and getattr(m, "room", None) == room for m in self.seen)

    def close(self) -> None:
        self.endpoint.close()

    def __enter__(self: P) -> P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Called with (bootstrap address, True) when a rogue prefill starts and
# (address, False) when it stops: a running FaultCluster publishes it to its
# decode workers, as the operator publishes a new prefill pod, since decode
# contacts only the bootstrap servers it was told about.
PREFILL_LISTENERS: list[Callable[[str, bool], None]] = []


class RoguePrefill(_Peer):
    """One-rank prefill instance whose rank does only what the test says."""

    def __init__(
        self,
        token: str,
        compat: CompatInfo,
        *,
        shape: InstanceShape | None = None,
        port: int = 0,
        register: bool = True,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__()
        self.token = token
        self.compat = compat
        self.shape = shape or InstanceShape()
        self.rank = RankCoord()
        self.start(curve, token)
        self.server = BootstrapServer(create_bootstrap_app(self.shape, token), port=port).start()
        for tell in list(PREFILL_LISTENERS):
            tell(f"127.0.0.1:{self.server.port}", True)
        if register:
            self.register()

    @property
    def bootstrap(self) -> tuple[str, int]:
        return "127.0.0.1", self.server.port

    def register(self) -> None:
        reg = RankRegistration(
            rank=self.rank, shape=self.shape, endpoint=self.address, compat=self.compat
        )
        resp = httpx.put(
            self.server.url + "/route",
            json=msgspec.to_builtins(reg),
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=5,
        )
        resp.raise_for_status()

    def auto_reply(self, sender: str, msg: Any) -> bool:
        # A real prefill rank accepts a compatible layout; that is not what tests probe here.
        if isinstance(msg, pdmsg.KVLayoutRegister):
            ack = pdmsg.LayoutAck(rank=self.rank, endpoint=self.address, accepted=True)
            self.send(msg.decode_endpoint, ack)
            return True
        return False

    def status(
        self, meta: pdmsg.TransferMeta, state: KVPoll, first_token: int | None = None
    ) -> None:
        self.send(
            meta.decode_endpoint,
            pdmsg.Status(
                room=meta.room,
                generation=meta.generation,
                rank=self.rank,
                state=state,
                first_token=first_token,
            ),
        )

    def ack(self, to: str, room: int, generation: int) -> None:
        self.send(to, pdmsg.AbortAck(room=room, rank=self.rank, generation=generation))

    def send_kv(
        self,
        meta: pdmsg.TransferMeta,
        num_tokens: int,
        *,
        checksum: int | None = None,
        is_last: bool = False,
        fill: int = 0,
    ) -> bytes:
        """A KV frame for tokens [0, num_tokens) of every layer and head of a tiny decode rank."""
        shape = (TINY.num_layers, 2, num_tokens, TINY.num_kv_heads, TINY.head_dim)
        nbytes = 4
        for d in shape:
            nbytes *= d
        payload = bytes([fill]) * nbytes
        header = KVFrameHeader(
            room=meta.room,
            generation=meta.generation,
            src_rank=0,
            layers=tuple(range(TINY.num_layers)),
            token_start=0,
            token_end=num_tokens,
            head_start=0,
            head_end=TINY.num_kv_heads,
            dtype="float32",
            shape=shape,
            checksum=checksum,
            is_last=is_last,
        )
        self.endpoint.send_kv(meta.decode_endpoint, encode_header(header), payload)
        return payload

    def close(self) -> None:
        for tell in list(PREFILL_LISTENERS):
            tell(f"127.0.0.1:{self.server.port}", False)
        self.server.stop()
        super().close()


class RogueDecode(_Peer):
    """One decode rank (tiny model, every layer and head) driven by the test."""

    def __init__(
        self,
        token: str,
        compat: CompatInfo,
        *,
        rank: RankCoord | None = None,
        num_pages: int = 256,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__()
        self.token = token
        self.compat = compat
        self.rank = rank or RankCoord()
        self.num_pages = num_pages
        self.start(curve, token)

    def layout(self, **changes: Any) -> pdmsg.KVLayoutRegister:
        fields: dict[str, Any] = {
            "token": self.token,
            "decode_rank": self.rank,
            "decode_endpoint": self.address,
            "compat": self.compat,
            "num_pages": self.num_pages,
            "layer_start": 0,
            "layer_end": TINY.num_layers,
            "head_start": 0,
            "head_end": TINY.num_kv_heads,
        }
        fields.update(changes)
        return pdmsg.KVLayoutRegister(**fields)

    def register(self, prefill: str, **changes: Any) -> pdmsg.LayoutAck:
        self.send(prefill, self.layout(**changes))
        return self.expect(pdmsg.LayoutAck)[1]

    def meta(
        self, prefill: str, room: int, rid: str, pages: list[int], generation: int = 1
    ) -> None:
        self.send(
            prefill,
            pdmsg.TransferMeta(
                room=room,
                generation=generation,
                rid=rid,
                decode_rank=self.rank,
                decode_endpoint=self.address,
                dst_pages=pages,
                num_destinations=1,
            ),
        )

    def bootstrap_msg(self, prefill: str, room: int, rid: str, generation: int = 1) -> None:
        self.send(
            prefill,
            pdmsg.Bootstrap(
                room=room,
                generation=generation,
                rid=rid,
                decode_rank=self.rank,
                decode_endpoint=self.address,
                num_destinations=1,
            ),
        )

    def abort(
        self, prefill: str, room: int, rid: str, generation: int = 1, reason: str = "test_abort"
    ) -> None:
        self.send(
            prefill,
            pdmsg.Abort(
                room=room,
                generation=generation,
                rid=rid,
                reason=reason,
                decode_rank=self.rank,
                decode_endpoint=self.address,
            ),
        )

    def frames_for(self, room: int) -> int:
        return sum(1 for h, _ in self.kv if h.room == room)


class Background:
    """Run a blocking call on a thread; `result()` joins it."""

    def __init__(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self._out: list[Any] = []
        self._err: list[BaseException] = []

        def run() -> None:
            try:
                self._out.append(fn(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001 - re-raised in result()
                self._err.append(err)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 60.0) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"background call still running after {timeout}s")
        if self._err:
            raise self._err[0]
        return self._out[0]
