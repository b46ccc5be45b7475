"""The `shm` transport: one-sided writes into a same-node peer's KV pool.

The destination rank keeps its pool in a shared-memory file
(`KVPool(shape, shm_path=...)`); after the KV-layout registration this
side maps the same file and scatters each gathered frame straight into the
destination slots named by the job, then the sender's completion message
(`job.notify`) tells the peer the data is there. This is the CPU analogue of
an RDMA write: the destination cannot refuse a write, so the *sender* must
never write pages the destination may have reused. The protocol guarantees
it: on abort the control plane calls `KVSender.cancel(room)` and acks only
after `KVSender.drain(room)`, and the destination keeps the pages until the
ack (one-sided transports never release on timeout alone).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.transfer.endpoint import Endpoint, check_address
from pdcluster.runtime.transfer.frames import KVFrameHeader, PoolGeometry
from pdcluster.runtime.transfer.job import TransferJob, check_job
from pdcluster.runtime.transfer.sender import FrameDone
from pdcluster.runtime.transfer.staging import scatter_bytes


class ShmTransport:
    """Maps registered peers' pools and writes frames into them."""

    wants_checksum = False  # no wire to corrupt: the bytes are copied in place

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._lock = threading.Lock()
        self._pools: dict[str, KVPool] = {}

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
        pool = KVPool(shape, shm_path=shm_path)
        with self._lock:
            self._pools[peer] = pool

    def unregister_peer(self, peer: str) -> None:
        """Unmap `peer`'s pool (drain its rooms first)."""
        with self._lock:
            self._pools.pop(peer, None)

    def peer_pool(self, peer: str) -> KVPool:
        with self._lock:
            pool = self._pools.get(peer)
        if pool is None:
            raise ValueError(f"no shared-memory pool registered for peer {peer}")
        return pool

    def check(self, job: TransferJob, src: PoolGeometry) -> None:
        check_job(job, src, self.peer_pool(job.peer).shape)

    def send_frame(
        self, job: TransferJob, header: KVFrameHeader, payload: torch.Tensor, on_done: FrameDone
    ) -> None:
        try:
            dst = self.peer_pool(job.peer)
        except ValueError:
            on_done("peer_unregistered")
            return
        assert job.dst_slots is not None  # check() guarantees it
        start = header.token_start - job.token_start
        end = header.token_end - job.token_start
        slots = np.asarray(job.dst_slots[start:end], dtype=np.int64)
        data = payload.view(torch.uint8).numpy()  # [L, 2, n, h, D * itemsize]
        scatter_bytes(dst, header.layers, slots, (header.head_start, header.head_end), data)
        on_done(None)

    def discard(self, room: int) -> None:
        """Nothing to withdraw: every write finished inside send_frame."""

    def notify(self, peer: str, data: bytes) -> None:
        self.endpoint.send_control(peer, data)
