"""The `nixl` transport's WRITEs in flight, and the notifications held behind them.

A WRITE may finish later, not inside the call that posts it. A frame's
`on_done` fires only when NIXL reports its handle DONE (or ERR, with NIXL's
status text), so the sender keeps the room `in_flight` until then: the
control plane acks an abort, and sends Success, only after every handle of
the room finished. A WRITE that NIXL reports DONE from the posting call
itself (UCX over TCP and shared memory finish small and medium WRITEs
there) is completed on the posting thread at once; only WRITEs still in
progress go to the progress thread, whose hand-off (a thread wake-up per
frame) costs a loaded host more than the WRITE.

Invariants:
- a notification (`notify`) to a peer is sent only after every WRITE posted
  to that peer before it finished, as it is behind the frames of `tcp`, and
  in the order the notifications were given per peer; it is dropped if one
  of those WRITEs failed (the room's failure is reported instead);
- a handle still in progress after `handle_timeout_s` is cancelled (NIXL
  releases an in-flight request only once the backend confirmed the
  abort); until that release succeeds it stays in flight, and the room's
  pages on the decode side stay quarantined.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.transfer.nixl_agent import NixlAgent
from pdcluster.runtime.transfer.sender import FrameDone

log = logging.getLogger(__name__)

# A WRITE still in progress after this long is cancelled (the peer is hung or gone).
HANDLE_TIMEOUT_S = 30.0
# Poll period of the progress thread while handles are in flight: short after a
# post or a completion (a WRITE over CUDA IPC or RDMA finishes on its own within
# milliseconds, and each poll period of delay adds to the transfer), doubling
# while nothing finishes, so a slow peer costs no more than a poll every MAX.
MIN_POLL_S = 0.00005
MAX_POLL_S = 0.0005


@dataclass(eq=False)  # compared by identity: one posted WRITE each
class _Write:
    room: int
    peer: str
    handle: Any
    on_done: FrameDone
    started: float
    failed: bool = False


@dataclass(eq=False)
class _Note:
    """A notification held back until the WRITEs posted before it to its peer finished."""

    peer: str
    data: bytes
    waits_for: list[_Write]


class PostedWrites:
    """Posts WRITE handles, polls them on its own thread, and sends each notification
    once the WRITEs before it finished (`send` is the endpoint's control send)."""

    def __init__(
        self,
        agent: NixlAgent,
        send: Callable[[str, bytes], None],
        handle_timeout_s: float = HANDLE_TIMEOUT_S,
    ) -> None:
        self.agent = agent
        self.send = send
        self.handle_timeout_s = handle_timeout_s
        self._lock = threading.Condition()
        self._writes: list[_Write] = []
        self._notes: list[_Note] = []  # in the order they were sent
        self._closed = False
        self._stats: dict[str, int] = {"errors": 0, "done_at_post": 0}
        self._posted = 0  # handles handed to the progress thread, ever
        self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._thread.start()

    def post(self, room: int, peer: str, handles: list[Any], on_done: FrameDone) -> None:
        """Post `handles`; `on_done` is called once per handle, as each finishes."""
        for handle in handles:
            state, why = self.agent.post(handle)
            if state == "ERR":
                self.agent.release(handle)
                with self._lock:
                    self._stats["errors"] += 1
                on_done(f"nixl_write_failed: {why}")
                continue
            if state == "DONE":
                # Finished inside the call: nothing of it can land any more, so the
                # frame is done here, without waking the progress thread.
                self.agent.release(handle)
                with self._lock:
                    self._stats["done_at_post"] += 1
                on_done(None)
                continue
            with self._lock:
                self._writes.append(_Write(room, peer, handle, on_done, time.monotonic()))
                self._posted += 1
                self._lock.notify_all()

    def notify(self, peer: str, data: bytes) -> None:
        """Send `data` to `peer` once every WRITE posted to it so far finished."""
        with self._lock:
            earlier = [w for w in self._writes if w.peer == peer]
            if earlier or any(n.peer == peer for n in self._notes):
                self._notes.append(_Note(peer, data, earlier))
                self._lock.notify_all()
                return
        self.send(peer, data)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._writes)

    def counts(self) -> dict[str, int]:
        """How posted WRITEs ended: errors, and those done inside the posting call."""
        with self._lock:
            return dict(self._stats)

    def num_held_notes(self) -> int:
        """Notifications still waiting for WRITEs posted before them."""
        with self._lock:
            return len(self._notes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(2)

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
                self.send(note.peer, note.data)
            except Exception as err:
                log.warning("nixl: notification to %s failed: %s", note.peer, err)

    def _progress(self) -> None:
        pause, seen = MIN_POLL_S, 0
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._writes or self._notes or self._closed)
                if self._closed:
                    return
                writes = list(self._writes)
                if self._posted != seen:
                    pause, seen = MIN_POLL_S, self._posted
            now = time.monotonic()
            finished: list[tuple[_Write, str | None]] = []
            for w in writes:
                state = self.agent.state_of(w.handle)
                if state == "DONE":
                    finished.append((w, None))
                elif state == "ERR":
                    finished.append((w, "nixl_write_failed: the peer's agent is unreachable"))
                elif now - w.started > self.handle_timeout_s and self.agent.release(w.handle):
                    # NIXL confirmed the abort: nothing of it can land any more.
                    finished.append((w, "nixl_write_timeout"))
                    w.handle = None
            with self._lock:
                done = {id(w) for w, _ in finished}
                self._writes = [w for w in self._writes if id(w) not in done]
                for w, err in finished:
                    w.failed = err is not None
                if any(err for _, err in finished):
                    self._stats["errors"] += sum(1 for _, err in finished if err)
                notes = self._due_notes()
            for w, err in finished:
                if w.handle is not None:
                    self.agent.release(w.handle)
                try:
                    w.on_done(err)
                except Exception:
                    log.exception("nixl: frame callback of room %d failed", w.room)
            self._send_notes(notes)
            if finished or notes:
                pause = MIN_POLL_S
            else:
                time.sleep(pause)
                pause = min(2 * pause, MAX_POLL_S)
