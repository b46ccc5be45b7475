"""The `nixl` transport: one-sided NIXL WRITEs from our pool into a peer's pool.

Every rank registers its whole KV pool (one contiguous tensor: host memory
on CPU, VRAM on CUDA; the tensor's device decides) with its own NIXL agent
(`NixlAgent`). A decode rank sends the agent's metadata and the pool's
region in its layout registration (`messages.NixlRegion`, our own msgspec
struct: nothing a peer sends is unpickled); a prefill rank adds that agent
(`NixlTransport.register_peer`) and from then on turns every frame into
WRITEs whose descriptors `nixl_plan` computes from the frame's token runs
(cut as for `shm`, `shm.copy_runs`), layer pairs and head slice.

Descriptor lists are prepared once per registration: our pool's page units
when the transport starts, a peer's when it registers (`prep_xfer_dlist`).
A frame's whole-page runs then become one WRITE that names units by index
(`make_prepped_xfer`); what page units cannot carry (a partial first or last
page, NHD head slices) goes in a second WRITE built from per-frame
descriptors (`initialize_xfer`). A frame is done when all its WRITEs are.
The unit indices of a job are worked out once, at its first frame
(`page_unit_grid`); each later frame of whole pages takes its slice, so a
frame costs one `make_prepped_xfer` and no planning.

A prefill agent only initiates WRITEs: it runs without NIXL's progress
thread, whose polling costs a fifth of a core even idle, since our own
progress thread checking the handles is what moves UCX forward on this
side. A decode agent keeps it: over TCP, UCX emulates a remote write with
messages the target's worker must process.

One-sided safety is `shm`'s, with one difference: a WRITE may finish later,
not inside the call. A frame's `on_done` fires only when NIXL reports its
handle DONE (or ERR, with NIXL's status text), so the sender keeps the
room `in_flight` until then: the control plane acks an abort, and sends
Success, only after every handle of the room finished. A WRITE that NIXL
reports DONE from the posting call itself (UCX over TCP and shared memory
finish small and medium WRITEs there) is completed on the posting thread
at once; only WRITEs still in progress go to the progress thread, whose
hand-off (a thread wake-up per frame) costs a loaded host more than the
WRITE. A notification (`notify`) to a peer waits for every WRITE posted
to that peer before it, as it does behind the frames of `tcp`, and is
dropped if one of them failed (the room's failure is reported instead).
A handle still in progress after `handle_timeout_s` is cancelled (NIXL
releases an in-flight request only once the backend confirmed the abort);
until that release succeeds it stays in flight, and the room's pages on
the decode side stay quarantined.
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
    can_use_page_units,
    check_geometries,
    frame_page_units,
    page_unit_grid,
    page_unit_indices,
    page_units,
    plan_descriptors,
    split_runs,
    unit_bytes,
    whole_pages,
)
from pdcluster.runtime.transfer.peer_table import PeerTable
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

    def __init__(self, owner: str, pool: KVPool, *, progress_thread: bool = True) -> None:
        """`progress_thread=False` for an agent that only initiates WRITEs (a prefill
        rank): its transport's polling progresses UCX; a WRITE target needs the thread."""
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        # Unique per process: a restarted rank must never be mistaken for the old agent.
        self.name = f"{owner}#{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The sender thread posts WRITEs while the progress thread polls them.
        config = nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
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
    units: Any  # the prepared descriptor list of the peer's page units


@dataclass(eq=False)  # compared by identity: one posted WRITE each
class _Write:
    room: int
    peer: str
    handle: Any
    on_done: FrameDone
    started: float
    failed: bool = False


@dataclass(eq=False)
class _JobPlan:
    """What every frame of one job to one peer shares, worked out at its first frame."""

    job: TransferJob
    peer: _Peer
    src_slots: np.ndarray  # [tokens] int64
    dst_slots: np.ndarray  # [tokens] int64
    layer_pairs: list[tuple[int, int]]
    # The job's page-unit indices (ours, the peer's) by page, when its tokens up to
    # its last whole page are whole pages on both sides (`page_unit_grid`); frames
    # inside them take their units from it, the others plan their own.
    grid: tuple[np.ndarray, np.ndarray] | None


@dataclass(eq=False)
class _Note:
    """A notification held back until the WRITEs posted before it to its peer finished."""

    peer: str
    data: bytes
    waits_for: list[_Write]


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
        self._peers: PeerTable[_Peer] = PeerTable("NIXL agent")
        # Held while a frame's WRITEs are built and posted, and while a peer's prepared
        # list and agent are released: NIXL must never use a released one. (Reentrant:
        # a refused post calls back into the sender on this thread.)
        self._posting = threading.RLock()
        self._writes: list[_Write] = []
        self._notes: list[_Note] = []  # in the order they were sent
        # The plan of the job whose frames are being posted (the sender thread posts
        # one job's frames in a row): made at its first frame, not per frame.
        self._job_plan: _JobPlan | None = None
        self._closed = False
        self.stats: dict[str, int] = {
            "writes": 0,
            "prepped_writes": 0,
            "descriptors": 0,
            "bytes": 0,
            "errors": 0,
            "done_at_post": 0,
        }
        self._units = self._prep_units(
            "NIXL_INIT_AGENT", self.local, agent.base_address, agent.device_id, agent.mem_type
        )
        self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._thread.start()

    def _prep_units(
        self, name: str, geo: RegionGeometry, base: int, device_id: int, mem_type: str
    ) -> Any:
        """A prepared NIXL descriptor list of every page unit of a pool at `base`."""
        units = page_units(geo)
        descs = np.stack(
            [units[:, 0] + base, units[:, 1], np.full(len(units), device_id, dtype=np.int64)],
            axis=1,
        )
        return self.agent.agent.prep_xfer_dlist(name, descs, mem_type)

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
        """Add `peer`'s agent and prepare its page units; a new agent (the peer
        restarted) replaces the old one."""
        check_address(peer)
        self.check_region(region, shape)
        old = self._peers.find(peer)
        if old is not None and old.region == region:
            return
        nx = self.agent.agent
        try:
            remote = nx.add_remote_agent(region.agent_metadata)
        except Exception as err:
            raise ValueError(f"NIXL refused the peer's agent metadata: {err}") from None
        if isinstance(remote, bytes):
            remote = remote.decode()
        if remote != region.agent_name:
            nx.remove_remote_agent(remote)
            raise ValueError(
                f"the peer's NIXL metadata names agent {remote!r}, "
                f"its registration {region.agent_name!r}"
            )
        geometry = geometry_of(shape)
        try:
            units = self._prep_units(
                remote, geometry, region.base_address, region.device_id, region.mem_type
            )
        except Exception as err:
            nx.remove_remote_agent(remote)
            raise ValueError(f"NIXL refused the peer's region: {err}") from None
        old = self._peers.put(peer, _Peer(region, remote, geometry, units))
        if old is not None:  # the peer's previous process: nothing more goes to it
            self._release_peer(peer, old, remove_agent=old.remote != remote)

    def has_peer(self, peer: str, region: NixlRegion) -> bool:
        known = self._peers.find(peer)
        return known is not None and known.region == region

    def unregister_peer(self, peer: str) -> None:
        known = self._peers.pop(peer)
        if known is not None:
            self._release_peer(peer, known, remove_agent=True)

    def _release_peer(self, peer: str, known: _Peer, remove_agent: bool) -> None:
        with self._posting:
            try:
                self.agent.agent.release_dlist_handle(known.units)
                if remove_agent:
                    self.agent.agent.remove_remote_agent(known.remote)
            except Exception as err:
                log.warning("nixl: releasing the agent of %s failed: %s", peer, err)

    # ---- Transport -------------------------------------------------------

    def check(self, job: TransferJob, src: PoolGeometry) -> None:
        check_job(job, src, self._peers.get(job.peer).geometry)

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
        """Post the frame's WRITEs; `on_done` fires once NIXL reports all of them finished."""
        start = header.token_start - job.token_start
        with self._posting:
            peer = self._peers.find(job.peer)
            if peer is None:
                on_done("peer_unregistered")
                return
            try:
                plan = self._plan_of(job, peer)
                handles = self._make_writes(plan, start, header.num_tokens, slots)
            except Exception as err:  # nothing was posted: the frame fails here
                on_done(f"nixl_write_failed: {err}")
                return
            if not handles:  # a frame of no tokens: nothing to write
                on_done(None)
                return
            self._post(job.room, job.peer, handles, _joined(on_done, len(handles)))

    def _plan_of(self, job: TransferJob, peer: _Peer) -> _JobPlan:
        """The job's plan: the last one if it is this job's to this peer, else a new one."""
        plan = self._job_plan
        if plan is not None and plan.job is job and plan.peer is peer:
            return plan
        assert job.dst_slots is not None  # check() guarantees it
        src = np.asarray(job.src_slots, dtype=np.int64)
        dst = np.asarray(job.dst_slots, dtype=np.int64)
        layer_pairs = list(zip(job.src_layers, job.dst_layers, strict=True))
        grid = None
        geo, ps = peer.geometry, self.local.page_size
        if can_use_page_units(self.local, geo, job.src_heads, job.dst_heads):
            whole = len(src) // ps * ps  # a partial last page is planned by its frame
            pages = whole_pages(src[:whole], dst[:whole], ps)
            if pages is not None:
                grid = page_unit_grid(
                    self.local, geo, pages, layer_pairs, job.src_heads, job.dst_heads
                )
        plan = _JobPlan(job, peer, src, dst, layer_pairs, grid)
        self._job_plan = plan
        return plan

    def _make_writes(
        self, plan: _JobPlan, start: int, num_tokens: int, slots: torch.Tensor
    ) -> list[Any]:
        """The WRITE requests of the job's tokens `[start, start + num_tokens)` (from
        `slots`), not yet posted: page units, then the rest."""
        job, peer, geo = plan.job, plan.peer, plan.peer.geometry
        ps, end = self.local.page_size, start + num_tokens
        src_slots = slots.cpu().numpy()
        local = remote = np.zeros(0, dtype=np.int32)
        runs: list[tuple[int, int, int]] = []
        grid_tokens = 0 if plan.grid is None else plan.grid[0].shape[2] * ps
        if plan.grid is not None and start % ps == 0 and end % ps == 0 and end <= grid_tokens:
            # The usual frame: whole pages of a whole-page job, cut from its grid.
            if len(src_slots) != num_tokens or (
                num_tokens and src_slots[0] != plan.src_slots[start]
            ):
                raise ValueError("the frame's slots are not the job's")
            local = frame_page_units(plan.grid[0], start // ps, end // ps)
            remote = frame_page_units(plan.grid[1], start // ps, end // ps)
        else:
            dst_slots = plan.dst_slots[start:end]
            runs = copy_runs(src_slots, dst_slots, ps, geo.page_size)
            if can_use_page_units(self.local, geo, job.src_heads, job.dst_heads):
                pages, runs = split_runs(runs, ps)
                if len(pages):
                    local, remote = page_unit_indices(
                        self.local, geo, pages, plan.layer_pairs, job.src_heads, job.dst_heads
                    )
        nx = self.agent.agent
        handles: list[Any] = []
        nbytes = descriptors = 0
        try:
            if len(local):
                handles.append(
                    nx.make_prepped_xfer("WRITE", self._units, local, peer.units, remote)
                )
                descriptors += len(local)
                nbytes += len(local) * unit_bytes(self.local)
            if runs:
                table = plan_descriptors(
                    self.local, geo, runs, plan.layer_pairs, job.src_heads, job.dst_heads
                )
                handles.append(self._initialize_write(table, peer))
                descriptors += len(table)
                nbytes += int(table[:, 2].sum())
        except Exception:
            for handle in handles:
                self._release(handle)
            raise
        with self._lock:
            self.stats["writes"] += len(handles)
            self.stats["prepped_writes"] += 1 if len(local) else 0
            self.stats["descriptors"] += descriptors
            self.stats["bytes"] += nbytes
        return handles

    def _initialize_write(self, table: np.ndarray, peer: _Peer) -> Any:
        """A WRITE from per-frame descriptors ([n, 3] src offset, dst offset, bytes)."""
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
        return nx.initialize_xfer(
            "WRITE",
            nx.get_xfer_descs(local, self.agent.mem_type),
            nx.get_xfer_descs(remote, region.mem_type),
            peer.remote,
        )

    def _post(self, room: int, peer: str, handles: list[Any], on_done: FrameDone) -> None:
        nx = self.agent.agent
        for handle in handles:
            try:
                state = nx.transfer(handle)
            except Exception as err:
                state, why = "ERR", str(err)
            else:
                why = "the UCX backend refused the WRITE"
            if state == "ERR":
                self._release(handle)
                with self._lock:
                    self.stats["errors"] += 1
                on_done(f"nixl_write_failed: {why}")
                continue
            if state == "DONE":
                # Finished inside the call: nothing of it can land any more, so the
                # frame is done here, without waking the progress thread.
                self._release(handle)
                with self._lock:
                    self.stats["done_at_post"] += 1
                on_done(None)
                continue
            with self._lock:
                self._writes.append(_Write(room, peer, handle, on_done, time.monotonic()))
                self._lock.notify_all()

    def discard(self, room: int) -> None:
        """Nothing to withdraw: posted WRITEs finish (or time out) on their own."""

    def notify(self, peer: str, data: bytes) -> None:
        """Send `data` to `peer` once every WRITE posted to it so far finished."""
        with self._lock:
            earlier = [w for w in self._writes if w.peer == peer]
            if earlier or any(n.peer == peer for n in self._notes):
                self._notes.append(_Note(peer, data, earlier))
                self._lock.notify_all()
                return
        self.endpoint.send_control(peer, data)

    def _due_notes(self) -> list[_Note]:
        """Take the notes whose WRITEs all finished (under `_lock`), in order per peer."""
        due: list[_Note] = []
        kept: list[_Note] = []
        held: set[str] = set()  # peers with an earlier note still waiting
        for note in self._notes:
            note.waits_for = [w for w in note.waits_for if w in self._writes or w.failed]
            waiting = any(not w.failed for w in note.waits_for)
            if waiting or note.peer in held:
                kept.append(note)
                held.add(note.peer)
            else:
                due.append(note)
        self._notes = kept
        return due

    def _send_notes(self, notes: list[_Note]) -> None:
        for note in notes:
            if any(w.failed for w in note.waits_for):
                # A WRITE before it failed: the peer must not read its pages as
                # complete; the room's failure goes to the control plane instead.
                log.warning("nixl: notification to %s dropped: a WRITE before it failed", note.peer)
                continue
            try:
                self.endpoint.send_control(note.peer, note.data)
            except Exception as err:
                log.warning("nixl: notification to %s failed: %s", note.peer, err)

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
                self._lock.wait_for(lambda: self._writes or self._notes or self._closed)
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
                for w, err in finished:
                    w.failed = err is not None
                if any(err for _, err in finished):
                    self.stats["errors"] += sum(1 for _, err in finished if err)
                notes = self._due_notes()
            for w, err in finished:
                if w.handle is not None:
                    self._release(w.handle)
                try:
                    w.on_done(err)
                except Exception:
                    log.exception("nixl: frame callback of room %d failed", w.room)
            self._send_notes(notes)
            if not finished and not notes:
                time.sleep(POLL_S)

    def _release(self, handle: Any) -> bool:
        try:
            self.agent.agent.release_xfer_handle(handle)
        except Exception as err:
            log.debug("nixl: releasing a transfer handle failed (still in flight?): %s", err)
            return False
        return True


def _joined(on_done: FrameDone, num_results: int) -> FrameDone:
    """`on_done` once, after `num_results` calls, with the first error among them."""
    lock = threading.Lock()
    left = [num_results]
    errors: list[str] = []

    def one(error: str | None) -> None:
        with lock:
            if error is not None:
                errors.append(error)
            left[0] -= 1
            if left[0]:
                return
        on_done(errors[0] if errors else None)

    return one
