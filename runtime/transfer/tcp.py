"""The `tcp` transport: KV frames over the ranks' ZMQ endpoints.

Sender: `TcpTransport` hands each gathered frame to the endpoint without a
copy; the staging buffer returns to the sender once libzmq released it.

Receiver: `KVReceiver.on_kv` (wired as the endpoint's `on_kv`) reads the
payload where libzmq received it, validates the header against the pool,
asks the control plane where the room's tokens live (`resolve`), verifies an
optional checksum and scatters the frame into those pages: on a CPU pool the
one copy on this side; a GPU pool gets one host-to-device copy first.

Safety rule (docs/design.md §5, §7): a frame is written only if `resolve(room,
generation)` returns the room's page table at the moment of the write. A
cleared, failed or unknown room, or an old generation, resolves to None and
the frame is dropped and counted, so a late frame can never touch pages that
now belong to another request. The control plane closes the remaining race
(a write already past `resolve`) with `quiesce(room)` after it stops
resolving a room and before it frees that room's pages.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.runtime.engine.kv_pool import DTYPES, KVPool
from pdcluster.runtime.telemetry.request_log import request_fields
from pdcluster.runtime.transfer.checksum import (
    CHECKSUM_MISMATCH,
    CHECKSUM_MISSING,
    is_checksum_valid,
)
from pdcluster.runtime.transfer.endpoint import Endpoint
from pdcluster.runtime.transfer.frames import (
    FrameError,
    KVFrameHeader,
    PoolGeometry,
    decode_header,
    encode_header,
    validate_header,
    validate_target,
)
from pdcluster.runtime.transfer.job import TransferJob, check_job
from pdcluster.runtime.transfer.sender import FrameDone
from pdcluster.runtime.transfer.staging import scatter_bytes

log = logging.getLogger(__name__)

Resolver = Callable[[int, int], Sequence[int] | None]  # (room, generation) -> page table
ProgressCallback = Callable[[int, int, "ReceiveProgress"], None]
FailureCallback = Callable[[int, int, str], None]  # (room, generation, reason)

ROOM_NOT_RECEIVING = "room_not_receiving"


class TcpTransport:
    """Sends frames through an endpoint; control notifications share its queue."""

    wants_checksum = True

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    def check(self, job: TransferJob, src: PoolGeometry) -> None:
        check_job(job, src)
        if job.dst_slots is not None:
            raise ValueError("tcp jobs leave placement to the receiver: dst_slots must be None")

    def send_frame(
        self, job: TransferJob, header: KVFrameHeader, payload: torch.Tensor, on_done: FrameDone
    ) -> None:
        raw = payload.reshape(-1).view(torch.uint8).numpy()  # shares the staging memory
        self.endpoint.send_kv(job.peer, encode_header(header), raw, on_done, tag=job.room)

    def discard(self, room: int) -> None:
        self.endpoint.discard(room)

    def notify(self, peer: str, data: bytes) -> None:
        self.endpoint.send_control(peer, data)


@dataclass(frozen=True)
class ReceiveProgress:
    """What one (room, generation) received so far."""

    num_frames: int = 0
    num_tokens: int = 0  # summed over frames (a token sent in two head slices counts twice)
    nbytes: int = 0
    last_from: frozenset[int] = frozenset()  # src ranks whose is_last frame arrived


class KVReceiver:
    """Places received KV frames into the local pool; see the module docstring."""

    def __init__(
        self,
        pool: KVPool,
        resolve: Resolver,
        *,
        on_progress: ProgressCallback | None = None,
        on_failure: FailureCallback | None = None,
        require_checksum: bool = False,
    ) -> None:
        self.pool = pool
        self.resolve = resolve
        self.on_progress = on_progress
        self.on_failure = on_failure
        self.require_checksum = require_checksum
        self._stats: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._writing: int | None = None  # room whose frame is between resolve and write
        self._progress: dict[int, dict[int, ReceiveProgress]] = {}

    @property
    def stats(self) -> dict[str, int]:
        """Frames dropped, by reason, plus "accepted"."""
        with self._cond:
            return dict(self._stats)

    def progress(self, room: int, generation: int) -> ReceiveProgress | None:
        with self._cond:
            return self._progress.get(room, {}).get(generation)

    def clear(self, room: int) -> None:
        """Forget the room's accounting (the control plane concluded it)."""
        with self._cond:
            self._progress.pop(room, None)

    def quiesce(self, room: int, timeout: float | None = None) -> bool:
        """Wait until no frame of `room` is being written; False on timeout.

        Call it after `resolve` stopped returning the room and before freeing
        its pages, without holding a lock that `resolve` takes.
        """
        with self._cond:
            return self._cond.wait_for(lambda: self._writing != room, timeout)

    def on_kv(self, header_bytes: bytes, payload: memoryview) -> None:
        """Endpoint callback: validate, resolve, verify and scatter one frame."""
        try:
            header = decode_header(header_bytes)
        except FrameError as exc:
            self._drop(exc.reason)
            return
        try:
            validate_header(header, self.pool.shape, payload.nbytes)
        except FrameError as exc:
            self._drop(exc.reason)
            # The sender of a live room is broken: fail the room now, not at its timeout.
            if self.resolve(header.room, header.generation) is not None:
                self._fail(header, f"bad_frame: {exc}")
            return
        with self._cond:
            self._writing = header.room
        try:
            accepted = self._place(header, payload)
        finally:
            with self._cond:
                self._writing = None
                self._cond.notify_all()
        if accepted:
            self._account(header, payload.nbytes)

    def _place(self, header: KVFrameHeader, payload: memoryview) -> bool:
        # Runs with the room marked as being written: quiesce(room) waits for us.
        table = self.resolve(header.room, header.generation)
        if table is None:
            self._drop(ROOM_NOT_RECEIVING)
            return False
        shape = self.pool.shape
        try:
            validate_target(header, len(table), shape.page_size)
        except FrameError as exc:
            self._drop(exc.reason)
            self._fail(header, f"bad_frame: {exc}")
            return False
        if header.checksum is None and self.require_checksum:
            self._drop(CHECKSUM_MISSING)
            self._fail(header, CHECKSUM_MISSING)
            return False
        if header.checksum is not None and not is_checksum_valid(payload, header.checksum):
            self._drop(CHECKSUM_MISMATCH)
            self._fail(header, CHECKSUM_MISMATCH)
            return False
        ps = shape.page_size
        first_page = header.token_start // ps
        pages = np.asarray(table[first_page : (header.token_end - 1) // ps + 1], dtype=np.int64)
        if int(pages.min()) < 0 or int(pages.max()) >= shape.num_pages:
            self._drop("bad_page_table")
            self._fail(header, "bad_page_table")
            return False
        positions = np.arange(header.token_start, header.token_end)
        slots = pages[positions // ps - first_page] * ps + positions % ps
        if self.pool.device.type == "cpu":
            # Straight from libzmq's receive buffer into the pages: the one copy.
            data = np.frombuffer(payload, dtype=np.uint8).reshape(*header.shape[:4], -1)
            scatter_bytes(
                self.pool, header.layers, slots, (header.head_start, header.head_end), data
            )
            return True
        frame = torch.frombuffer(payload, dtype=torch.uint8).view(DTYPES[header.dtype])
        frame = frame.view(tuple(header.shape)).to(self.pool.device)  # [L, 2, n, h, D]
        heads = slice(header.head_start, header.head_end)
        if header.head_start == 0 and header.head_end == shape.num_kv_heads:
            heads = slice(None)  # whole rows: the pool's fast path
        index = torch.from_numpy(slots).to(self.pool.device)
        self.pool.scatter_tokens(header.layers, index, frame, heads)
        return True

    def _account(self, header: KVFrameHeader, nbytes: int) -> None:
        with self._cond:
            self._stats["accepted"] += 1
            per_room = self._progress.setdefault(header.room, {})
            old = per_room.get(header.generation, ReceiveProgress())
            new = ReceiveProgress(
                num_frames=old.num_frames + 1,
                num_tokens=old.num_tokens + header.num_tokens,
                nbytes=old.nbytes + nbytes,
                last_from=old.last_from | {header.src_rank} if header.is_last else old.last_from,
            )
            per_room[header.generation] = new
        if self.on_progress is not None:
            try:
                self.on_progress(header.room, header.generation, new)
            except Exception:
                log.exception("KV receiver: on_progress failed for room %d", header.room)

    def _drop(self, reason: str) -> None:
        with self._cond:
            self._stats[reason] += 1

    def _fail(self, header: KVFrameHeader, reason: str) -> None:
        log.warning(
            "KV frame for room %d (generation %d, src rank %d) rejected: %s",
            header.room,
            header.generation,
            header.src_rank,
            reason,
            extra=request_fields(header.room),
        )
        if self.on_failure is not None:
            try:
                self.on_failure(header.room, header.generation, reason)
            except Exception:
                log.exception("KV receiver: on_failure failed for room %d", header.room)
