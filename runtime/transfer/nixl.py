"""The `nixl` transport: one-sided NIXL WRITEs from our pool into a peer's pool.

Every rank registers its whole KV pool with its own NIXL agent
(`nixl_agent.NixlAgent`). A decode rank sends the agent's region in its
layout registration; a prefill rank adds that agent (`register_peer`) and
from then on turns every frame into WRITEs whose descriptors `nixl_plan`
computes from the frame's token runs (cut as for `shm`, `shm.copy_runs`),
layer pairs and head slice.

Descriptor lists are prepared once per registration: our pool's page units
when the transport starts, a peer's when it registers (`prep_xfer_dlist`).
A frame's whole-page runs then become one WRITE that names units by index
(`make_prepped_xfer`); what page units cannot carry (a partial first or last
page, NHD head slices) goes in a second WRITE built from per-frame
descriptors (`initialize_xfer`). A frame is done when all its WRITEs are.
The unit indices of a job are worked out once, at its first frame
(`page_unit_grid`); each later frame of whole pages takes its slice, so a
frame costs one `make_prepped_xfer` and no planning.

One-sided safety is `shm`'s, with one difference: a WRITE may finish later,
not inside the call. When a frame is done, and when a notification may go,
is `nixl_writes.PostedWrites`'s: it keeps the room `in_flight` until every
handle of the room finished, and holds a notification behind the WRITEs
posted to its peer before it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.pd.messages import NixlRegion
from pdcluster.runtime.transfer.endpoint import Endpoint, check_address
from pdcluster.runtime.transfer.frames import KVFrameHeader, PoolGeometry
from pdcluster.runtime.transfer.job import TransferJob, check_job
from pdcluster.runtime.transfer.nixl_agent import NixlAgent, geometry_of
from pdcluster.runtime.transfer.nixl_plan import (
    PlanError,
    RegionGeometry,
    can_use_page_units,
    check_geometries,
    frame_page_units,
    page_unit_grid,
    plan_descriptors,
    split_runs,
    unit_bytes,
    whole_pages,
)
from pdcluster.runtime.transfer.nixl_writes import HANDLE_TIMEOUT_S, PostedWrites
from pdcluster.runtime.transfer.peer_table import PeerTable
from pdcluster.runtime.transfer.sender import FrameDone
from pdcluster.runtime.transfer.shm import copy_runs

log = logging.getLogger(__name__)


@dataclass
class _Peer:
    region: NixlRegion
    remote: str  # the name NIXL knows the peer's agent by
    geometry: RegionGeometry
    units: Any  # the prepared descriptor list of the peer's page units


@dataclass(eq=False)
class _JobPlan:
    """What every frame of one job to one peer shares, worked out at its first frame."""

    job: TransferJob
    peer: _Peer
    layer_pairs: list[tuple[int, int]]
    # The job's page-unit indices (ours, the peer's) by page, when its tokens up to
    # its last whole page are whole pages on both sides (`page_unit_grid`); frames
    # inside them take their units from it, the others plan their own.
    grid: tuple[np.ndarray, np.ndarray] | None


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
        self._lock = threading.Lock()  # guards `_stats`
        self._peers: PeerTable[_Peer] = PeerTable("NIXL agent")
        # Held while a frame's WRITEs are built and posted, and while a peer's prepared
        # list and agent are released: NIXL must never use a released one. (Reentrant:
        # a refused post calls back into the sender on this thread.)
        self._posting = threading.RLock()
        # The plan of the job whose frames are being posted (the sender thread posts
        # one job's frames in a row): made at its first frame, not per frame.
        self._job_plan: _JobPlan | None = None
        self._stats: dict[str, int] = {
            "writes": 0,
            "prepped_writes": 0,
            "descriptors": 0,
            "bytes": 0,
        }
        self._units = agent.prep_units(
            "NIXL_INIT_AGENT", self.local, agent.base_address, agent.device_id, agent.mem_type
        )
        self.writes = PostedWrites(
            agent,
            lambda peer, data: self.endpoint.send_control(peer, data),
            handle_timeout_s,
        )

    @property
    def handle_timeout_s(self) -> float:
        return self.writes.handle_timeout_s

    @property
    def stats(self) -> dict[str, int]:
        """WRITEs built (and how: prepared units, descriptors, bytes), then how they ended
        (errors, done inside the posting call): a snapshot."""
        with self._lock:
            built = dict(self._stats)
        return built | self.writes.counts()

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
        remote = self.agent.add_peer(region)
        geometry = geometry_of(shape)
        try:
            units = self.agent.prep_units(
                remote, geometry, region.base_address, region.device_id, region.mem_type
            )
        except Exception as err:
            self.agent.remove_peer(remote)
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
                self.agent.release_units(known.units)
                if remove_agent:
                    self.agent.remove_peer(known.remote)
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
        slots: np.ndarray,
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
            self.writes.post(job.room, job.peer, handles, _joined(on_done, len(handles)))

    def discard(self, room: int) -> None:
        """Nothing to withdraw: posted WRITEs finish (or time out) on their own."""

    def notify(self, peer: str, data: bytes) -> None:
        """Send `data` to `peer` once every WRITE posted to it so far finished."""
        self.writes.notify(peer, data)

    def in_flight(self) -> int:
        return self.writes.in_flight()

    def close(self) -> None:
        self.writes.close()

    # ---- frames to WRITEs ------------------------------------------------

    def _plan_of(self, job: TransferJob, peer: _Peer) -> _JobPlan:
        """The job's plan: the last one if it is this job's to this peer, else a new one."""
        plan = self._job_plan
        if plan is not None and plan.job is job and plan.peer is peer:
            return plan
        assert job.dst_slots is not None  # check() guarantees it
        layer_pairs = list(zip(job.src_layers, job.dst_layers, strict=True))
        grid = None
        geo, ps = peer.geometry, self.local.page_size
        if can_use_page_units(self.local, geo, job.src_heads, job.dst_heads):
            whole = len(job.src_slots) // ps * ps  # a partial last page is planned by its frame
            pages = whole_pages(job.src_slots[:whole], job.dst_slots[:whole], ps)
            if pages is not None:
                grid = page_unit_grid(
                    self.local, geo, pages, layer_pairs, job.src_heads, job.dst_heads
                )
        plan = _JobPlan(job, peer, layer_pairs, grid)
        self._job_plan = plan
        return plan

    def _make_writes(
        self, plan: _JobPlan, start: int, num_tokens: int, src_slots: np.ndarray
    ) -> list[Any]:
        """The WRITE requests of the job's tokens `[start, start + num_tokens)` (from
        `slots`), not yet posted: page units, then the rest."""
        job, peer, geo = plan.job, plan.peer, plan.peer.geometry
        ps, end = self.local.page_size, start + num_tokens
        local = remote = _NO_UNITS
        runs: list[tuple[int, int, int]] = []
        grid_tokens = 0 if plan.grid is None else plan.grid[0].shape[2] * ps
        if plan.grid is not None and start % ps == 0 and end % ps == 0 and end <= grid_tokens:
            # The usual frame: whole pages of a whole-page job, cut from its grid.
            if len(src_slots) != num_tokens or (
                num_tokens and src_slots[0] != job.src_slots[start]
            ):
                raise ValueError("the frame's slots are not the job's")
            local = frame_page_units(plan.grid[0], start // ps, end // ps)
            remote = frame_page_units(plan.grid[1], start // ps, end // ps)
        else:
            assert job.dst_slots is not None  # check() guarantees it
            dst_slots = np.asarray(job.dst_slots[start:end], dtype=np.int64)
            runs = copy_runs(src_slots, dst_slots, ps, geo.page_size)
            if can_use_page_units(self.local, geo, job.src_heads, job.dst_heads):
                pages, runs = split_runs(runs, ps)
                if len(pages):
                    grid = page_unit_grid(
                        self.local, geo, pages, plan.layer_pairs, job.src_heads, job.dst_heads
                    )
                    local, remote = grid[0].ravel(), grid[1].ravel()
        handles: list[Any] = []
        nbytes = descriptors = 0
        try:
            if len(local):
                handles.append(self.agent.page_unit_write(self._units, local, peer.units, remote))
                descriptors += len(local)
                nbytes += len(local) * unit_bytes(self.local)
            if runs:
                table = plan_descriptors(
                    self.local, geo, runs, plan.layer_pairs, job.src_heads, job.dst_heads
                )
                handles.append(self.agent.descriptor_write(table, peer.region, peer.remote))
                descriptors += len(table)
                nbytes += int(table[:, 2].sum())
        except Exception:
            for handle in handles:
                self.agent.release(handle)
            raise
        with self._lock:
            self._stats["writes"] += len(handles)
            self._stats["prepped_writes"] += 1 if len(local) else 0
            self._stats["descriptors"] += descriptors
            self._stats["bytes"] += nbytes
        return handles


_NO_UNITS = np.zeros(0, dtype=np.int32)
_NO_UNITS.flags.writeable = False


def _joined(on_done: FrameDone, num_results: int) -> FrameDone:
    """`on_done` once, after `num_results` calls, with the first error among them."""
    if num_results == 1:
        return on_done  # the usual frame: one WRITE of page units
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
