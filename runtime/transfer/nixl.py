"""The `nixl` transport: one-sided NIXL WRITEs from our pool into a peer's pool.

Every rank registers its whole KV pool (one contiguous tensor: host memory
on CPU, VRAM on CUDA; the tensor's device decides) with its own NIXL agent
(`NixlAgent`). A decode rank sends the agent's metadata and the pool's
region in its layout registration (`messages.NixlRegion`, our own msgspec
struct: nothing a peer sends is unpickled); a prefill rank adds that agent
(`NixlTransport.register_peer`) and from then on turns every frame into one
WRITE whose descriptors `nixl_plan` computes from the frame's token runs
(cut as for `shm`, `shm.copy_runs`), layer pairs and head slice.

One-sided safety is `shm`'s, with one difference: a WRITE finishes later,
not inside the call. A frame's `on_done` fires only when NIXL reports its
handle DONE (or ERR, with NIXL's status text), so the sender keeps the
room `in_flight` until then: the control plane acks an abort, and sends
Success, only after every handle of the room finished. A handle still in
progress after `handle_timeout_s` is cancelled (NIXL releases an in-flight
request only once the backend confirmed the abort); until that release
succeeds it stays in flight, and the room's pages on the decode side stay
quarantined.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.pd.messages import NIXL_REGION_VERSION, NixlRegion
from pdcluster.runtime.transfer.endpoint import Endpoint, check_address
from pdcluster.runtime.transfer.frames import KVFrameHeader, PoolGeometry
from pdcluster.runtime.transfer.job import TransferJob, check_job
from pdcluster.runtime.transfer.nixl_plan import (
    PlanError,
    RegionGeometry,
    check_geometries,
    plan_descriptors,
)
from pdcluster.runtime.transfer.sender import FrameDone
from pdcluster.runtime.transfer.shm import copy_runs
from pdcluster.runtime.transfer.ucx_report import is_tcp_fallback, parse_ucx_lanes, transports_of

log = logging.getLogger(__name__)

# A WRITE still in progress after this long is cancelled (the peer is hung or gone).
HANDLE_TIMEOUT_S = 30.0
# Poll period of the progress thread while handles are in flight.
POLL_S = 0.0005


def flush_ucx_log() -> None:
    """Flush UCX's log file (it is block-buffered): call the loaded libucs's ucs_log_flush."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((ln.split()[-1] for ln in maps if "/libucs" in ln), None)
        if path is not None:
            ctypes.CDLL(path).ucs_log_flush()
    except (OSError, AttributeError) as err:
        log.debug("nixl: cannot flush UCX's log: %s", err)


def geometry_of(shape: KVPoolShape) -> RegionGeometry:
    return RegionGeometry(
        num_layers=shape.num_layers,
        num_pages=shape.num_pages,
        page_size=shape.page_size,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
        layout=shape.layout,
    )


class NixlAgent:
    """This rank's NIXL agent with its KV pool registered (one per rank process)."""

    def __init__(self, owner: str, pool: KVPool) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        # Unique per process: a restarted rank must never be mistaken for the old agent.
        self.name = f"{owner}#{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The sender thread posts WRITEs while the progress thread polls them.
        config = nixl_agent_config(
            backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.agent = nixl_agent(self.name, config)
        self.pool = pool
        buffer = pool.buffer
        if not buffer.is_contiguous():
            raise ValueError("a NIXL-registered KV pool must be one contiguous tensor")
        self.mem_type = "VRAM" if buffer.device.type == "cuda" else "DRAM"
        self.device_id = buffer.device.index or 0
        self.base_address = buffer.data_ptr()
        self.nbytes = buffer.numel() * buffer.element_size()
        self._reg = self.agent.register_memory(
            [(self.base_address, self.nbytes, self.device_id, "")], self.mem_type
        )

    def region(self) -> NixlRegion:
        return NixlRegion(
            version=NIXL_REGION_VERSION,
            agent_name=self.name,
            agent_metadata=self.agent.get_agent_metadata(),
            mem_type="VRAM" if self.mem_type == "VRAM" else "DRAM",
            device_id=self.device_id,
            base_address=self.base_address,
            nbytes=self.nbytes,
        )

    def report(self, require_rdma: bool = False) -> dict[str, Any]:
        """What was negotiated: the UCX lanes and transports of this process's peers."""
        from pdcluster.runtime.transfer.nixl_support import ucx_log_path

        path = ucx_log_path()
        text = ""
        if path is not None:
            flush_ucx_log()
            try:
                with open(path, errors="replace") as f:
                    text = f.read()
            except OSError:
                pass
        lanes = parse_ucx_lanes(text)
        fallback = is_tcp_fallback(lanes)
        return {
            "agent": self.name,
            "mem_type": self.mem_type,
            "ucx_tls": os.environ.get("UCX_TLS"),
            "ucx_net_devices": os.environ.get("UCX_NET_DEVICES"),
            "ucx_lanes": lanes,
            "ucx_transports": transports_of(lanes),
            "tcp_fallback": fallback,
            # The manifest asked for RDMA / GPU-direct and got TCP: a silent slowdown.
            "rdma_missing": require_rdma and fallback,
        }

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as err:  # the process is ending: log, never raise
            log.warning("nixl: deregistering the KV pool failed: %s", err)


@dataclass
class _Peer:
    region: NixlRegion
    remote: str  # the name NIXL knows the peer's agent by
    geometry: RegionGeometry


@dataclass
class _Write:
    room: int
    handle: Any
    on_done: FrameDone
    started: float


class NixlTransport:
    """Writes frames into registered peers' pools with NIXL (a `DirectCopy` transport)."""

    wants_checksum = False  # no frame bytes to corrupt on our side of the wire
    reads_device_pool = True  # the pool itself is registered: no staging, CPU or GPU

    def __init__(
        self,
        endpoint: Endpoint,
        agent: NixlAgent,
        handle_timeout_s: float = HANDLE_TIMEOUT_S,
    ) -> None:
        self.endpoint = endpoint
        self.agent = agent
        self.local = geometry_of(agent.pool.shape)
        self.handle_timeout_s = handle_timeout_s
        self._lock = threading.Condition()
        self._peers: dict[str, _Peer] = {}
        self._writes: list[_Write] = []
        self._closed = False
        self.stats: dict[str, int] = {"writes": 0, "descriptors": 0, "bytes": 0, "errors": 0}
        self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._thread.start()

    # ---- peers -----------------------------------------------------------

    def check_region(self, region: NixlRegion, shape: KVPoolShape) -> None:
        """Raise ValueError if a peer's region cannot take our frames (size, geometry)."""
        if region.nbytes != shape.nbytes:
            raise ValueError(
                f"the peer's NIXL region holds {region.nbytes} bytes, "
                f"its registered layout needs {shape.nbytes}"
            )
        try:
            check_geometries(self.local, geometry_of(shape))
        except PlanError as err:
            raise ValueError(str(err)) from None

    def register_peer(self, peer: str, region: NixlRegion, shape: KVPoolShape) -> None:
        """Add `peer`'s agent; a new agent (the peer restarted) replaces the old one."""
        check_address(peer)
        self.check_region(region, shape)
        with self._lock:
            old = self._peers.get(peer)
            if old is not None and old.region == region:
                return
        remote = self.agent.agent.add_remote_agent(region.agent_metadata)
        if isinstance(remote, bytes):
            remote = remote.decode()
        if remote != region.agent_name:
            self.agent.agent.remove_remote_agent(remote)
            raise ValueError(
                f"the peer's NIXL metadata names agent {remote!r}, "
                f"its registration {region.agent_name!r}"
            )
        with self._lock:
            self._peers[peer] = _Peer(region, remote, geometry_of(shape))
        if old is not None and old.remote != remote:
            try:  # the peer's previous process: nothing more goes to it
                self.agent.agent.remove_remote_agent(old.remote)
            except Exception as err:
                log.warning("nixl: removing the old agent of %s failed: %s", peer, err)

    def has_peer(self, peer: str, region: NixlRegion) -> bool:
        with self._lock:
            known = self._peers.get(peer)
            return known is not None and known.region == region

    def unregister_peer(self, peer: str) -> None:
        with self._lock:
            known = self._peers.pop(peer, None)
        if known is not None:
            try:
                self.agent.agent.remove_remote_agent(known.remote)
            except Exception as err:
                log.warning("nixl: removing agent of %s failed: %s", peer, err)

    def _peer(self, peer: str) -> _Peer:
        with self._lock:
            known = self._peers.get(peer)
        if known is None:
            raise ValueError(f"no NIXL agent registered for peer {peer}")
        return known

    # ---- Transport -------------------------------------------------------

    def check(self, job: TransferJob, src: PoolGeometry) -> None:
        check_job(job, src, self._peer(job.peer).geometry)

    def send_frame(
        self, job: TransferJob, header: KVFrameHeader, payload: torch.Tensor, on_done: FrameDone
    ) -> None:
        # Only reached for a pool the sender does not hand us directly: no staging
        # buffer is registered with NIXL, so there is nothing to WRITE from.
        on_done("nixl_needs_registered_pool")

    def copy_frame(
        self,
        job: TransferJob,
        header: KVFrameHeader,
        pool: KVPool,
        slots: torch.Tensor,
        on_done: FrameDone,
    ) -> None:
        """Post one WRITE for the frame; `on_done` fires when NIXL reports it finished."""
        try:
            peer = self._peer(job.peer)
        except ValueError:
            on_done("peer_unregistered")
            return
        assert job.dst_slots is not None  # check() guarantees it
        start = header.token_start - job.token_start
        dst_slots = np.asarray(job.dst_slots[start : start + header.num_tokens], dtype=np.int64)
        runs = copy_runs(
            slots.cpu().numpy(), dst_slots, self.local.page_size, peer.geometry.page_size
        )
        layer_pairs = list(zip(job.src_layers, job.dst_layers, strict=True))
        table = plan_descriptors(
            self.local, peer.geometry, runs, layer_pairs, job.src_heads, job.dst_heads
        )
        region = peer.region
        local = np.stack(
            [
                table[:, 0] + self.agent.base_address,
                table[:, 2],
                np.full(len(table), self.agent.device_id, dtype=np.int64),
            ],
            axis=1,
        )
        remote = np.stack(
            [
                table[:, 1] + region.base_address,
                table[:, 2],
                np.full(len(table), region.device_id, dtype=np.int64),
            ],
            axis=1,
        )
        nx = self.agent.agent
        handle = nx.initialize_xfer(
            "WRITE",
            nx.get_xfer_descs(local, self.agent.mem_type),
            nx.get_xfer_descs(remote, region.mem_type),
            peer.remote,
        )
        state = nx.transfer(handle)
        with self._lock:
            self.stats["writes"] += 1
            self.stats["descriptors"] += len(table)
            self.stats["bytes"] += int(table[:, 2].sum())
        if state == "ERR":
            self._release(handle)
            on_done("nixl_write_failed: the UCX backend refused the WRITE")
            return
        with self._lock:
            self._writes.append(_Write(job.room, handle, on_done, time.monotonic()))
            self._lock.notify_all()

    def discard(self, room: int) -> None:
        """Nothing to withdraw: posted WRITEs finish (or time out) on their own."""

    def notify(self, peer: str, data: bytes) -> None:
        self.endpoint.send_control(peer, data)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._writes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(2)

    # ---- progress --------------------------------------------------------

    def _progress(self) -> None:
        nx = self.agent.agent
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._writes or self._closed)
                if self._closed:
                    return
                writes = list(self._writes)
            now = time.monotonic()
            finished: list[tuple[_Write, str | None]] = []
            for w in writes:
                state = nx.check_xfer_state(w.handle)
                if state == "DONE":
                    finished.append((w, None))
                elif state == "ERR":
                    finished.append((w, "nixl_write_failed: the peer's agent is unreachable"))
                elif now - w.started > self.handle_timeout_s and self._release(w.handle):
                    # NIXL confirmed the abort: nothing of it can land any more.
                    finished.append((w, "nixl_write_timeout"))
                    w.handle = None
            with self._lock:
                done = {id(w) for w, _ in finished}
                self._writes = [w for w in self._writes if id(w) not in done]
                if any(err for _, err in finished):
                    self.stats["errors"] += sum(1 for _, err in finished if err)
            for w, err in finished:
                if w.handle is not None:
                    self._release(w.handle)
                try:
                    w.on_done(err)
                except Exception:
                    log.exception("nixl: frame callback of room %d failed", w.room)
            if not finished:
                time.sleep(POLL_S)

    def _release(self, handle: Any) -> bool:
        try:
            self.agent.agent.release_xfer_handle(handle)
        except Exception as err:
            log.debug("nixl: releasing a transfer handle failed (still in flight?): %s", err)
            return False
        return True
