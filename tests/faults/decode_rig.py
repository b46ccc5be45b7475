"""One real decode rank agent in this process, fed by a hand-driven prefill.

`DecodeRig` runs a `DecodeAgent` (its room table, endpoint, KV receiver and
loop thread, as a worker runs them) on 127.0.0.1, next to a plain
`Endpoint` that plays the prefill rank: the test sees every control message
the agent sends it (layout, metadata, aborts) and sends KV frames and
statuses back over real sockets. The prefill instance's /route answer is
seeded into the agent's bootstrap cache, so no bootstrap server is needed;
the agent's group reports land in `reports`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.bootstrap_registry import InstanceInfo, RankAddress
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd_worker.agent import AgentContext
from pdcluster.runtime.pd_worker.decode_agent import DecodeAgent
from pdcluster.runtime.pd_worker.group import GroupMessage, GroupOpen, GroupPages, GroupReport
from pdcluster.runtime.spec import TransferSpec
from pdcluster.runtime.transfer.checksum import compute_checksum
from pdcluster.runtime.transfer.endpoint import Endpoint, EndpointConfig
from pdcluster.runtime.transfer.frames import KVFrameHeader, encode_header

PAGE_SIZE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
NUM_PAGES = 16
# The prefill instance's bootstrap address: nothing listens there, the
# agent's bootstrap cache answers for it.
PREFILL_PEER = "127.0.0.1:9"
RANK = RankCoord(dp=0, cp=0, tp=0, pp=0)
TOKEN = "rig-token"


def _compat() -> CompatInfo:
    return CompatInfo(
        page_size=PAGE_SIZE,
        kv_dtype="float32",
        kv_layout="NHD",
        allocation_policy="early",
        model_fingerprint="rig",
    )


class DecodeRig:
    def __init__(self, **transfer: Any) -> None:
        spec = TransferSpec.model_validate({"heartbeat": {"intervalSeconds": 3600.0}, **transfer})
        shape = KVPoolShape(LAYERS, NUM_PAGES, PAGE_SIZE, HEADS, HEAD_DIM)
        self.pool = KVPool(shape)
        ctx = AgentContext(
            role="decode",
            cluster="rig",
            instance=0,
            coord=RANK,
            group_rank=0,
            group_size=1,
            shape=InstanceShape(),
            compat=_compat(),
            token=TOKEN,
            room_settings=RoomSettings.from_spec(spec),
            transfer=spec,
            layers=(0, LAYERS),
            heads=(0, HEADS),
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            head_dim=HEAD_DIM,
            page_size=PAGE_SIZE,
            num_pages=NUM_PAGES,
            host="127.0.0.1",
            advertise_host="127.0.0.1",
            bootstrap_address="",
        )
        self.ctx = ctx
        self._cond = threading.Condition()
        self.reports: list[tuple[float, GroupReport]] = []
        self.inbox: list[pdmsg.Message] = []
        self.prefill = Endpoint(
            # Keyed by the cluster token like a real prefill rank: frames prove their sender.
            EndpointConfig(host="127.0.0.1", advertise_host="127.0.0.1", token=TOKEN),
            on_control=self._on_prefill_control,
        )
        self.prefill.start()
        self.agent = DecodeAgent(ctx, self.pool, None)
        self.agent.report_sink = self._on_report
        info = InstanceInfo(
            shape=InstanceShape(),
            compat=_compat(),
            ranks=[RankAddress(rank=RANK, endpoint=self.prefill.address)],
        )
        self.agent.bootstrap.get(PREFILL_PEER)._instance = info
        self.agent.start()

    def close(self) -> None:
        closed = threading.Event()
        self.agent.aio.submit(self.agent.bootstrap.aclose(), lambda *_: closed.set())
        closed.wait(5)
        self.agent.close()
        self.agent.aio.loop.close()
        self.prefill.close()

    # ------------------------------------------------------------ observing
    def _on_report(self, rep: GroupReport) -> None:
        with self._cond:
            self.reports.append((time.monotonic(), rep))
            self._cond.notify_all()

    def _on_prefill_control(self, sender: str, data: bytes) -> None:
        msg = pdmsg.decode(data)
        with self._cond:
            self.inbox.append(msg)
            self._cond.notify_all()

    def wait_report(self, room: int, kind: str, timeout: float = 5.0) -> tuple[float, GroupReport]:
        def find() -> tuple[float, GroupReport] | None:
            return next(
                ((t, r) for t, r in self.reports if r.room == room and r.kind == kind), None
            )

        with self._cond:
            found = self._cond.wait_for(find, timeout)
        assert found, f"no {kind!r} report for room {room}: {self.reports}"
        return found

    def has_report(self, room: int, kind: str) -> bool:
        with self._cond:
            return any(r.room == room and r.kind == kind for _, r in self.reports)

    def poll_report(self, room: int, kind: str, timeout: float) -> tuple[float, GroupReport] | None:
        """Like `wait_report`, but None when none came within `timeout`."""
        try:
            return self.wait_report(room, kind, timeout)
        except AssertionError:
            return None

    def wait_message(self, kind: type, room: int, timeout: float = 5.0) -> Any:
        def find() -> Any:
            return next(
                (m for m in self.inbox if isinstance(m, kind) and getattr(m, "room", None) == room),
                None,
            )

        with self._cond:
            found = self._cond.wait_for(find, timeout)
        assert found is not None, f"prefill got no {kind.__name__} for room {room}"
        return found

    # ------------------------------------------------------------ driving
    def group(self, msg: GroupMessage) -> None:
        self.agent.post(lambda: self.agent.on_group(msg, time.monotonic()))

    def open_room(
        self, room: int, rid: str, pages: list[int], num_tokens: int
    ) -> pdmsg.TransferMeta:
        """Open the room and hand it pages; returns the metadata prefill received."""
        self.group(GroupOpen(room=room, rid=rid, num_tokens=num_tokens, peer=PREFILL_PEER))
        self.group(GroupPages(room=room, pages=pages))
        meta: pdmsg.TransferMeta = self.wait_message(pdmsg.TransferMeta, room)
        return meta

    def open_room_only(self, room: int, rid: str, num_tokens: int) -> None:
        """Open the room without pages (it fetches /route first)."""
        self.group(GroupOpen(room=room, rid=rid, num_tokens=num_tokens, peer=PREFILL_PEER))

    def send_frame(
        self,
        meta: pdmsg.TransferMeta,
        token_start: int,
        token_end: int,
        fill: float | torch.Tensor,
    ) -> torch.Tensor:
        """One KV frame of every layer and head for tokens [start, end): all
        `fill`, or the given [L, 2, n, H, D] tensor. Returns the payload."""
        n = token_end - token_start
        if isinstance(fill, torch.Tensor):
            payload = fill.to(torch.float32).contiguous()
        else:
            payload = torch.full((LAYERS, 2, n, HEADS, HEAD_DIM), fill, dtype=torch.float32)
        raw = payload.reshape(-1).view(torch.uint8).numpy()
        header = KVFrameHeader(
            room=meta.room,
            generation=meta.generation,
            src_rank=0,
            layers=tuple(range(LAYERS)),
            token_start=token_start,
            token_end=token_end,
            head_start=0,
            head_end=HEADS,
            dtype="float32",
            shape=tuple(payload.shape),
            checksum=compute_checksum(raw) if self.ctx.transfer.checksum else None,
        )
        self.prefill.send_kv(self.agent.address, encode_header(header), raw)
        return payload

    def send_status(self, meta: pdmsg.TransferMeta, state: KVPoll, **kw: Any) -> None:
        status = pdmsg.Status(
            room=meta.room, generation=meta.generation, rank=RANK, state=state, **kw
        )
        self.prefill.send_control(self.agent.address, pdmsg.encode(status))

    def send_ack(self, room: int, generation: int) -> None:
        """The prefill rank's ABORT_ACK for `room` at `generation`."""
        ack = pdmsg.AbortAck(room=room, rank=RANK, generation=generation)
        self.prefill.send_control(self.agent.address, pdmsg.encode(ack))

    def page_bytes(self, page: int) -> torch.Tensor:
        """Every byte of one page, all layers and both K and V."""
        return self.pool.buffer[:, :, page].contiguous().reshape(-1).view(torch.uint8)

    def fill_page(self, page: int, value: int) -> None:
        """Write `value` into every byte of one page (what its next owner would do)."""
        self.pool.buffer[:, :, page].view(torch.uint8).fill_(value)
