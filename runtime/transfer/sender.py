"""The sending side of the transfer engine, common to every transport.

`KVSender.submit(job)` queues a `TransferJob`; one worker thread plans it
into frames, gathers each frame into a reusable staging buffer and hands it
to the transport, so gathering the next frame overlaps moving the last one
(and the engine keeps computing meanwhile). A transport that can read the
pool itself (`DirectCopy`, e.g. shm from a CPU pool) skips the staging copy.
Once every frame of a job was handed over, `job.notify` goes to the peer;
transports deliver it behind those frames.

Per-room accounting is what the control plane relies on for aborts:
- `in_flight(room)` counts jobs queued or running whose data may still move;
  a job leaves it only once its transport released every frame (tcp: libzmq
  let go of the payload; shm: the write into the peer's pool returned);
- `cancel(room)` drops the room's queued jobs, stops a running one at the
  next frame boundary and refuses later submits, so after `cancel` and a
  successful `drain` nothing of that room is written any more;
- a failed frame fails its room once, through `on_failure(room, generation,
  reason)`, and cancels the room's remaining work.

Timing (`stats`): `sent_bytes` of jobs that completed and `busy_us`, the
time at least one job was moving (from its first frame handed over to its
last frame done; time queued is not counted, overlapping jobs count once).
Their ratio is the rate a transport reaches while it has work, the figure
a reader-side connector reports as bytes over READ time.

Callbacks (`on_complete`, `on_failure`) run on the sender's worker thread or
on the transport's I/O thread, before the job leaves `in_flight`: they must
return quickly and must not call `drain` (it would wait for themselves).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol, runtime_checkable

import msgspec
import numpy as np
import torch

from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.spec import KVDtype
from pdcluster.runtime.telemetry.request_log import request_fields
from pdcluster.runtime.transfer.checksum import compute_checksum
from pdcluster.runtime.transfer.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MIN_FRAME_BYTES,
    DEFAULT_PIPELINE_DEPTH,
    KVFrameHeader,
    PoolGeometry,
    plan_frames,
)
from pdcluster.runtime.transfer.job import TransferJob
from pdcluster.runtime.transfer.staging import (
    StagingClosed,
    StagingPool,
    StagingTimeout,
    frame_view,
    gather_into,
)

log = logging.getLogger(__name__)

FrameDone = Callable[[str | None], None]  # None, or why the frame was not delivered
CompleteCallback = Callable[[TransferJob], None]
FailureCallback = Callable[[int, int, str], None]  # (room, generation, reason)


class Transport(Protocol):
    """Moves one gathered frame to a job's destination."""

    wants_checksum: bool

    def check(self, job: TransferJob, src: PoolGeometry) -> None:
        """Raise ValueError if this transport cannot run `job` from a pool of `src`:
        `check_job`'s rules (with the destination's geometry, where the transport
        knows it) and its own. The sender checks a job with this call alone."""

    def send_frame(
        self, job: TransferJob, header: KVFrameHeader, payload: torch.Tensor, on_done: FrameDone
    ) -> None:
        """Start moving `payload` ([L, 2, n, h, D], CPU); call `on_done` exactly once."""

    def notify(self, peer: str, data: bytes) -> None:
        """Send a control message to `peer`, after every frame already sent to it."""

    def discard(self, room: int) -> None:
        """Withdraw `room`'s frames that wait for their peer (their on_done still fires)."""


@runtime_checkable
class DirectCopy(Protocol):
    """A transport that reads a CPU pool itself (one copy, no staging buffer)."""

    def copy_frame(
        self,
        job: TransferJob,
        header: KVFrameHeader,
        pool: KVPool,
        slots: np.ndarray,  # [n] int64: the frame's source slots (host indices)
        on_done: FrameDone,
    ) -> None:
        """Copy the frame's tokens from `pool` to the destination; call `on_done` once."""


@dataclass(frozen=True)
class SenderConfig:
    """Sender settings. Sizes in bytes, times in seconds."""

    src_rank: int = 0  # this rank's id, stamped on every frame
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    min_frame_bytes: int = DEFAULT_MIN_FRAME_BYTES
    pipeline_depth: int = DEFAULT_PIPELINE_DEPTH  # frames a medium job is split into
    staging_buffers: int = 4  # frames gathered but not yet released by the transport
    staging_timeout: float = 30.0  # longest wait for a free staging buffer
    checksum: bool = False  # stamp a CRC-32 on frames (if the transport checks them)
    max_closed_rooms: int = 65536  # remembered cancelled/failed rooms (oldest forgotten)


def job_bytes_per_token(job: TransferJob, src: PoolGeometry) -> int:
    """Bytes one token of `job` occupies in a frame (its layers, K and V, its heads)."""
    item_size = KVDtype.itemsize_of(src.dtype)
    if item_size is None:
        raise ValueError(f"kv dtype {src.dtype!r} is not one of {[d.value for d in KVDtype]}")
    return len(job.src_layers) * 2 * job.num_heads * src.head_dim * item_size


def plan_job_frames(
    job: TransferJob, src: PoolGeometry, config: SenderConfig
) -> list[tuple[int, int]]:
    """The frames, as job-relative token ranges, that a sender cuts `job` into.

    Cuts fall on the destination's page boundaries (positions are the same on
    both sides), so whole pages move in one copy when gathering and scattering.
    """
    return plan_frames(
        job.num_tokens,
        job_bytes_per_token(job, src),
        config.max_frame_bytes,
        config.min_frame_bytes,
        config.pipeline_depth,
        align_tokens=src.page_size,
        first_token=job.token_start,
    )


@dataclass
class _Run:
    """One job being executed; guarded by the sender's condition."""

    job: TransferJob
    pending: int = 1  # frames not yet done, +1 while the worker still plans frames
    error: str | None = None
    stopped: bool = False  # cancelled between frames
    nbytes: int = 0  # the job's KV bytes
    moving: bool = False  # counted in the sender's busy time


class KVSender:
    """Executes TransferJobs from a local pool through one transport."""

    def __init__(
        self,
        pool: KVPool,
        transport: Transport,
        config: SenderConfig | None = None,
        *,
        on_complete: CompleteCallback | None = None,
        on_failure: FailureCallback | None = None,
    ) -> None:
        self.pool = pool
        self.transport = transport
        # A transport with the pool registered (nixl) reads a device pool too. Decided
        # once: a runtime Protocol check costs tens of microseconds, every frame.
        self._direct: DirectCopy | None = None
        if isinstance(transport, DirectCopy) and (
            pool.device.type == "cpu" or getattr(transport, "reads_device_pool", False)
        ):
            self._direct = transport
        self.config = config or SenderConfig()
        self.on_complete = on_complete
        self.on_failure = on_failure
        plan_frames(1, 1, self.config.max_frame_bytes, self.config.min_frame_bytes)  # validates
        self._staging = StagingPool(
            self.config.staging_buffers, pin_memory=pool.device.type == "cuda"
        )
        self._scratch: torch.Tensor | None = None  # device-side gather target (GPU pools)
        self._cond = threading.Condition()
        self._queue: deque[TransferJob] = deque()
        self._in_flight: dict[int, int] = {}
        self._closed_rooms: OrderedDict[int, str] = OrderedDict()  # room -> why
        self._state = "new"
        self._thread: threading.Thread | None = None
        self.num_refused = 0  # submits refused because their room was closed
        # Completed jobs' bytes and the time any job was moving (see the module doc).
        self.stats: dict[str, int] = {"sent_jobs": 0, "sent_bytes": 0, "busy_us": 0}
        self._moving = 0  # jobs between their first frame and their last frame done
        self._moving_since = 0.0

    # ---- lifecycle -------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._state != "new":
                raise RuntimeError(f"sender already {self._state}")
            self._state = "running"
        self._thread = threading.Thread(target=self._work, name="kv-sender", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker; queued jobs fail their rooms with "sender_closed"."""
        with self._cond:
            if self._state in ("closing", "closed"):
                return
            was_new = self._state == "new"
            self._state = "closing"
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._staging.close()
        for job in dropped:
            self._fail_room(job, "sender_closed")
            with self._cond:
                self._in_flight_done(job.room)
                self._cond.notify_all()
        if self._thread is threading.current_thread():
            return  # closed from a callback on the worker: it stops after returning
        if self._thread is not None and not was_new:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"KV sender worker still busy after {timeout}s")
        with self._cond:
            self._state = "closed"

    # ---- control-plane API -----------------------------------------------

    def submit(self, job: TransferJob) -> bool:
        """Queue `job`. False (nothing queued) if its room was cancelled or failed.

        Raises ValueError for a job that cannot run, RuntimeError if closed.
        """
        self.transport.check(job, self.pool.shape)  # check_job's rules and the transport's
        with self._cond:
            if self._state != "running":
                raise RuntimeError(f"sender is {self._state}")
            if job.room in self._closed_rooms:
                self.num_refused += 1
                return False
            self._in_flight[job.room] = self._in_flight.get(job.room, 0) + 1
            self._queue.append(job)
            self._cond.notify_all()
        return True

    def timing(self) -> dict[str, int]:
        """A copy of `stats`: completed jobs, their bytes, the time any job was moving."""
        with self._cond:
            return dict(self.stats)

    def in_flight(self, room: int) -> int:
        with self._cond:
            return self._in_flight.get(room, 0)

    def drain(self, room: int, timeout: float | None = None) -> bool:
        """Wait until no job of `room` can move data any more; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: room not in self._in_flight, timeout)

    def cancel(self, room: int) -> None:
        """Stop sending `room`: drop its queued jobs, stop its running one, refuse more."""
        with self._cond:
            self._close_room(room, "cancelled")
            kept: deque[TransferJob] = deque()
            for job in self._queue:
                if job.room == room:
                    self._in_flight_done(room)
                else:
                    kept.append(job)
            self._queue = kept
            self._cond.notify_all()
        self._discard(room)

    def forget(self, room: int) -> None:
        """Accept jobs for `room` again (the control plane retired it)."""
        with self._cond:
            self._closed_rooms.pop(room, None)

    def is_closed_room(self, room: int) -> bool:
        with self._cond:
            return room in self._closed_rooms

    # ---- worker ----------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._state != "running")
                if self._state != "running":
                    return
                job = self._queue.popleft()
                run = _Run(job)
            try:
                self._execute(run)
            except Exception as exc:  # a bug must fail the room, not kill the worker
                log.exception("KV sender: job for room %d failed", job.room)
                self._frame_done(run, None, f"internal_error: {exc}")
                continue
            self._frame_done(run, None, None)  # the worker's own hold on the run

    def _execute(self, run: _Run) -> None:
        job, cfg, pool = run.job, self.config, self.pool
        shape = pool.shape
        run.nbytes = job.num_tokens * job_bytes_per_token(job, shape)
        with self._cond:
            if not self._moving:
                self._moving_since = time.monotonic()
            self._moving += 1
            run.moving = True
        heads = slice(*job.src_heads)
        if job.src_heads == (0, shape.num_kv_heads):
            heads = slice(None)  # lets the pool take its whole-row fast path
        frame_shape = (len(job.src_layers), 2, 0, job.num_heads, shape.head_dim)
        plan = plan_job_frames(job, shape, cfg)
        direct = self._direct is not None
        # A direct transport takes slots as host indices (nixl plans descriptors from
        # them, shm indexes a host pool): no copy to a device and back per frame, and
        # no tensor (torch converts a list of ints one by one, ~40 us per 128 cold).
        host_slots = np.asarray(job.src_slots, dtype=np.int64)
        if not direct:
            bytes_per_token = job_bytes_per_token(job, shape)
            slots = torch.from_numpy(host_slots).to(pool.device)
        if direct and pool.device.type == "cuda":
            # The job's KV was queued on the stream before its submit (the prefill hook
            # fires after the forward is queued, not finished). A gather is ordered
            # behind it by the stream; a WRITE from the pool (UCX's copy engines) is
            # not, so the job waits here until the stream has written it.
            torch.cuda.current_stream(pool.device).synchronize()
        for index, (start, end) in enumerate(plan):
            with self._cond:
                if run.error is not None:
                    return  # a frame failed: the room is lost, send nothing more
                if self._state != "running":
                    closing = True
                elif job.room in self._closed_rooms:
                    run.stopped = True
                    return
                else:
                    closing = False
            if closing:
                self._fail_run(run, "sender_closed")
                return
            header = KVFrameHeader(
                room=job.room,
                generation=job.generation,
                src_rank=cfg.src_rank,
                layers=job.dst_layers,
                token_start=job.token_start + start,
                token_end=job.token_start + end,
                head_start=job.dst_heads[0],
                head_end=job.dst_heads[1],
                dtype=shape.dtype,
                shape=(*frame_shape[:2], end - start, *frame_shape[3:]),
                is_last=job.is_last and index == len(plan) - 1,
            )
            if direct:
                sent = self._send_direct(run, header, host_slots[start:end])
            else:
                sent = self._send_staged(run, header, slots[start:end], heads, bytes_per_token)
            if not sent:
                return
            with self._cond:
                withdrawn = run.error is not None or job.room in self._closed_rooms
            if withdrawn:
                # The room closed while this frame was being queued, maybe after
                # its discard: discard again, now that the frame is in the queue.
                self._discard(job.room)
                return
        if job.notify is not None:
            # Transports deliver a notification after the frames already handed
            # to them (tcp: same connection; shm: writes are done), so it need
            # not wait for libzmq to release the staging buffers.
            try:
                self.transport.notify(job.peer, job.notify)
            except Exception as exc:
                self._fail_run(run, f"notify_failed: {exc}")

    def _send_staged(
        self,
        run: _Run,
        header: KVFrameHeader,
        slots: torch.Tensor,
        heads: slice,
        bytes_per_token: int,
    ) -> bool:
        """Gather into a staging buffer, hand it over; False if the job must stop."""
        try:
            buf = self._staging.acquire(
                header.num_tokens * bytes_per_token, self.config.staging_timeout
            )
        except StagingTimeout:
            self._fail_run(run, "staging_timeout")
            return False
        except StagingClosed:
            self._fail_run(run, "sender_closed")
            return False
        try:
            payload = frame_view(buf, self.pool.dtype, header.shape)  # [L, 2, n, h, D]
            self._gather(run.job, slots, heads, payload)
        except BaseException:
            self._staging.release(buf)
            raise
        if self.config.checksum and self.transport.wants_checksum:
            raw = buf[: payload.numel() * payload.element_size()].numpy()
            data = raw.data if raw.flags.c_contiguous else memoryview(raw.tobytes())
            header = msgspec.structs.replace(header, checksum=compute_checksum(data))
        with self._cond:
            run.pending += 1
        try:
            self.transport.send_frame(run.job, header, payload, partial(self._frame_done, run, buf))
        except Exception as exc:
            self._frame_done(run, buf, f"send_failed: {exc}")
            return False
        return True

    def _send_direct(self, run: _Run, header: KVFrameHeader, slots: np.ndarray) -> bool:
        assert self._direct is not None
        with self._cond:
            run.pending += 1
        try:
            self._direct.copy_frame(
                run.job, header, self.pool, slots, partial(self._frame_done, run, None)
            )
        except Exception as exc:
            self._frame_done(run, None, f"send_failed: {exc}")
            return False
        return True

    def _gather(
        self, job: TransferJob, slots: torch.Tensor, heads: slice, out: torch.Tensor
    ) -> None:
        if self.pool.device.type == "cpu":
            gather_into(self.pool, job.src_layers, slots, heads, out)
            return
        numel = out.numel()
        if self._scratch is None or self._scratch.numel() < numel:
            self._scratch = torch.empty(numel, dtype=self.pool.dtype, device=self.pool.device)
        on_device = self._scratch[:numel].view(out.shape)
        gather_into(self.pool, job.src_layers, slots, heads, on_device)
        out.copy_(on_device)  # device -> pinned host; synchronous, so `out` is complete

    # ---- completion ------------------------------------------------------

    def _fail_run(self, run: _Run, reason: str) -> None:
        """Record the run's first error and report it now, not when its frames return."""
        with self._cond:
            if run.error is not None:
                return
            run.error = reason
        self._fail_room(run.job, reason)

    def _frame_done(self, run: _Run, buf: torch.Tensor | None, error: str | None) -> None:
        # Error first: the worker, woken by the released buffer, must see it.
        if error is not None:
            self._fail_run(run, error)
        if buf is not None:
            self._staging.release(buf)
        with self._cond:
            run.pending -= 1
            if run.pending:
                return
        self._finish(run)

    def _finish(self, run: _Run) -> None:
        # Callbacks run before the job leaves in_flight, so once drain(room)
        # returns, the room's outcome has been reported.
        job = run.job
        try:
            with self._cond:
                ok = run.error is None and not run.stopped and job.room not in self._closed_rooms
                if run.moving:
                    run.moving = False
                    self._moving -= 1
                    if not self._moving:
                        self.stats["busy_us"] += int((time.monotonic() - self._moving_since) * 1e6)
                    if ok:
                        self.stats["sent_jobs"] += 1
                        self.stats["sent_bytes"] += run.nbytes
            if not ok:
                return
            if self.on_complete is not None:
                self._call(self.on_complete, job)
        finally:
            with self._cond:
                self._in_flight_done(job.room)
                self._cond.notify_all()

    def _fail_room(self, job: TransferJob, reason: str) -> None:
        with self._cond:
            if job.room in self._closed_rooms:
                return  # already cancelled or failed: report a room once
            self._close_room(job.room, "failed")
            kept = deque(j for j in self._queue if j.room != job.room)
            for _ in range(len(self._queue) - len(kept)):
                self._in_flight_done(job.room)
            self._queue = kept
            self._cond.notify_all()
        log.warning(
            "KV transfer of room %d failed: %s", job.room, reason, extra=request_fields(job.room)
        )
        self._discard(job.room)
        if self.on_failure is not None:
            self._call(self.on_failure, job.room, job.generation, reason)

    def _discard(self, room: int) -> None:
        try:
            self.transport.discard(room)
        except RuntimeError:
            pass  # the endpoint is closed: it failed every queued frame itself

    def _close_room(self, room: int, why: str) -> None:
        self._closed_rooms[room] = why
        self._closed_rooms.move_to_end(room)
        while len(self._closed_rooms) > self.config.max_closed_rooms:
            self._closed_rooms.popitem(last=False)

    def _in_flight_done(self, room: int) -> None:
        left = self._in_flight.get(room, 0) - 1
        if left > 0:
            self._in_flight[room] = left
        else:
            self._in_flight.pop(room, None)

    @staticmethod
    def _call(callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("KV sender callback %r failed", callback)
