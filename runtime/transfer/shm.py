"""The `shm` transport: one-sided writes into a same-node peer's KV pool.

The destination rank keeps its pool in a shared-memory file
(`KVPool(shape, shm_path=...)`); after the KV-layout registration this
side maps the same file and copies each frame straight from its own pool
into the destination slots named by the job (`copy_frame`: one copy, page
run by page run; a GPU source is gathered and staged first), then the
sender's completion message
(`job.notify`) tells the peer the data is there. This is the CPU analogue of
an RDMA write: the destination cannot refuse a write, so the *sender* must
never write pages the destination may have reused. The protocol guarantees
it: on abort the control plane calls `KVSender.cancel(room)` and acks only
after `KVSender.drain(room)`, and the destination keeps the pages until the
ack (one-sided transports never release on timeout alone).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.transfer.endpoint import Endpoint, check_address
from pdcluster.runtime.transfer.frames import KVFrameHeader, PoolGeometry
from pdcluster.runtime.transfer.job import TransferJob, check_job
from pdcluster.runtime.transfer.peer_table import PeerTable
from pdcluster.runtime.transfer.sender import FrameDone
from pdcluster.runtime.transfer.staging import scatter_bytes

# Below this many bytes per run, per-run call overhead outweighs the saved copy.
MIN_RUN_BYTES = 64 * 1024


class ShmTransport:
    """Maps registered peers' pools and writes frames into them."""

    wants_checksum = False  # no wire to corrupt: the bytes are copied in place

    def __init__(self, endpoint: Endpoint, min_run_bytes: int = MIN_RUN_BYTES) -> None:
        self.endpoint = endpoint
        self.min_run_bytes = min_run_bytes  # shorter average runs: gather + scatter instead
        self._pools: PeerTable[KVPool] = PeerTable("shared-memory pool")

    def register_peer(self, peer: str, shm_path: str, shape: KVPoolShape) -> None:
        """Map `peer`'s pool file. Raises ValueError if it is missing or of another size."""
        check_address(peer)
        try:
            size = os.stat(shm_path).st_size
        except OSError as exc:
            raise ValueError(f"peer {peer} pool file {shm_path!r}: {exc.strerror}") from None
        if size != shape.nbytes:
            raise ValueError(
                f"peer {peer} pool file {shm_path!r} holds {size} bytes, "
                f"its registered layout needs {shape.nbytes}"
            )
        self._pools.put(peer, KVPool(shape, shm_path=shm_path))

    def unregister_peer(self, peer: str) -> None:
        """Unmap `peer`'s pool (drain its rooms first)."""
        self._pools.pop(peer)

    def peer_pool(self, peer: str) -> KVPool:
        return self._pools.get(peer)

    def check(self, job: TransferJob, src: PoolGeometry) -> None:
        check_job(job, src, self.peer_pool(job.peer).shape)

    def _destination(
        self, job: TransferJob, on_done: FrameDone
    ) -> tuple[KVPool, Sequence[int]] | None:
        """The peer's pool and the job's slots in it; None (the frame failed) once
        the peer is gone."""
        dst = self._pools.find(job.peer)
        if dst is None:
            on_done("peer_unregistered")
            return None
        assert job.dst_slots is not None  # check() guarantees it
        return dst, job.dst_slots

    def send_frame(
        self, job: TransferJob, header: KVFrameHeader, payload: torch.Tensor, on_done: FrameDone
    ) -> None:
        found = self._destination(job, on_done)
        if found is None:
            return
        dst, peer_slots = found
        start = header.token_start - job.token_start
        end = header.token_end - job.token_start
        slots = np.asarray(peer_slots[start:end], dtype=np.int64)
        data = payload.view(torch.uint8).numpy()  # [L, 2, n, h, D * itemsize]
        scatter_bytes(dst, header.layers, slots, (header.head_start, header.head_end), data)
        on_done(None)

    def copy_frame(
        self,
        job: TransferJob,
        header: KVFrameHeader,
        pool: KVPool,
        slots: np.ndarray,
        on_done: FrameDone,
    ) -> None:
        """Copy a frame from a CPU pool straight into the peer's pages: one copy.

        Tokens are copied in runs that are consecutive on both sides and stay
        inside one page on each (all layers and the head slice in one strided
        copy per run). When runs are short (tiny pages, scrambled offsets)
        the per-run cost would dominate, so the frame is gathered and
        scattered instead (two copies, no per-token calls).
        """
        found = self._destination(job, on_done)
        if found is None:
            return
        dst, peer_slots = found
        start = header.token_start - job.token_start
        dst_slots = np.asarray(peer_slots[start : start + header.num_tokens], dtype=np.int64)
        runs = copy_runs(slots, dst_slots, pool.shape.page_size, dst.shape.page_size)
        frame_bytes = (
            header.num_tokens
            * (len(header.layers) * 2 * header.num_heads * pool.shape.head_dim)
            * pool.buffer.element_size()
        )
        if frame_bytes // len(runs) < self.min_run_bytes:
            index = torch.from_numpy(slots)
            staged = pool.gather_tokens(job.src_layers, index, slice(*job.src_heads))
            self.send_frame(job, header, staged, on_done)
            return
        src_heads, dst_heads = slice(*job.src_heads), slice(*job.dst_heads)
        layer_pairs = _layer_pairs(job.src_layers, job.dst_layers)
        for src_slot, dst_slot, length in runs:
            src_view = _token_view(pool, src_slot, length, src_heads)  # [L, 2, len, h, D]
            dst_view = _token_view(dst, dst_slot, length, dst_heads)
            for src_layers, dst_layers in layer_pairs:
                dst_view[dst_layers].copy_(src_view[src_layers])
        on_done(None)

    def discard(self, room: int) -> None:
        """Nothing to withdraw: every write finished inside send_frame."""

    def notify(self, peer: str, data: bytes) -> None:
        self.endpoint.send_control(peer, data)


def copy_runs(
    src_slots: np.ndarray, dst_slots: np.ndarray, src_page_size: int, dst_page_size: int
) -> list[tuple[int, int, int]]:
    """Split a token list into (src_slot, dst_slot, length) runs that are
    consecutive on both sides and never cross a page boundary on either."""
    if len(src_slots) == 0:
        return []
    follows = (
        (np.diff(src_slots) == 1)
        & (np.diff(dst_slots) == 1)
        & (src_slots[1:] % src_page_size != 0)
        & (dst_slots[1:] % dst_page_size != 0)
    )
    starts = np.flatnonzero(~follows) + 1
    bounds = [0, *starts.tolist(), len(src_slots)]
    return [
        (int(src_slots[a]), int(dst_slots[a]), b - a)
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def _layer_pairs(
    src_layers: tuple[int, ...], dst_layers: tuple[int, ...]
) -> list[tuple[slice | int, slice | int]]:
    """Index pairs covering src_layers[i] -> dst_layers[i]: one pair of slices
    when both are ascending ranges (the usual pp case), else one pair per layer."""

    def as_range(layers: tuple[int, ...]) -> slice | None:
        if list(layers) == list(range(layers[0], layers[0] + len(layers))):
            return slice(layers[0], layers[0] + len(layers))
        return None

    src_range, dst_range = as_range(src_layers), as_range(dst_layers)
    if src_range is not None and dst_range is not None:
        return [(src_range, dst_range)]
    return list(zip(src_layers, dst_layers, strict=True))


def _token_view(pool: KVPool, slot: int, length: int, heads: slice) -> torch.Tensor:
    """[L, 2, length, h, D] view of `length` consecutive slots inside one page (any order)."""
    page, offset = divmod(slot, pool.shape.page_size)
    view: torch.Tensor = pool.logical[:, :, page, offset : offset + length, heads]
    return view
