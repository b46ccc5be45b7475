"""Decode admission: which waiting room gets its pages next.

A room needs every page of its prompt reserved in one step before any
prefill rank may write (all or nothing: a partial reservation would let a
prefill write into pages that are not ours yet). Admission is FIFO with
head-of-line blocking: if the head does not fit, nothing behind it jumps
ahead — a stream of small prompts must not starve a large one.

Transfer slots bound the rooms between admission and the end of their
transfer (success hand-off or failed-room release). With no free slot,
admission waits (backpressure); it never fails a request for it.

A prompt that can never fit (`num_pages > capacity_pages`) is refused at
`enqueue` with `prompt_too_long`, before anything is reserved.

Pages come from an allocator-like callable `allocate(n) -> pages | None`
(None: not enough free pages now); the engine's page allocator fits.

Pure module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdcluster.runtime.bounds import require_at_least

Allocate = Callable[[int], Sequence[int] | None]


class AdmissionError(ValueError):
    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Admitted:
    room: int
    pages: tuple[int, ...]


class DecodeAdmission:
    def __init__(self, num_slots: int, capacity_pages: int) -> None:
        require_at_least("admission", num_slots=(num_slots, 1), capacity_pages=(capacity_pages, 1))
        self.num_slots = num_slots
        self.capacity_pages = capacity_pages
        self._waiting: OrderedDict[int, int] = OrderedDict()  # room → pages needed, FIFO
        self._holding: set[int] = set()  # rooms holding a transfer slot

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - len(self._holding)

    def waiting_rooms(self) -> list[int]:
        return list(self._waiting)

    def head(self) -> int | None:
        """The room `admit` asks pages for next (None: nobody waits)."""
        return next(iter(self._waiting), None)

    def holds_slot(self, room: int) -> bool:
        return room in self._holding

    def check_fits(self, num_pages: int) -> None:
        """Raise AdmissionError(prompt_too_long) for a prompt that can never be admitted.

        Call it before creating the room, so an impossible request costs no
        peer traffic at all.
        """
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise AdmissionError(f"num_pages must be a positive int, got {num_pages!r}", "bad_size")
        if num_pages > self.capacity_pages:
            raise AdmissionError(
                f"prompt needs {num_pages} pages, more than this decode rank can ever hold "
                f"({self.capacity_pages})",
                "prompt_too_long",
            )

    def enqueue(self, room: int, num_pages: int) -> None:
        """Queue `room` for `num_pages` pages. Raises AdmissionError, queue unchanged."""
        self.check_fits(num_pages)
        if room in self._waiting or room in self._holding:
            raise AdmissionError(f"room {room} is already queued or admitted", "duplicate_room")
        self._waiting[room] = num_pages

    def cancel(self, room: int) -> bool:
        """Drop a waiting room (it failed before admission); True if it was waiting."""
        return self._waiting.pop(room, None) is not None

    def admit(self, allocate: Allocate) -> list[Admitted]:
        """Admit from the head while slots and pages last; stop at the first that does not fit.

        `allocate` is asked for the pages of `head()` (a caller that reuses
        cached pages per room reads it there)."""
        out: list[Admitted] = []
        while self._waiting and len(self._holding) < self.num_slots:
            room, need = next(iter(self._waiting.items()))
            pages = allocate(need)
            if pages is None:
                break
            if len(pages) != need:
                raise AdmissionError(
                    f"allocator returned {len(pages)} pages for a request of {need}",
                    "allocator_error",
                )
            del self._waiting[room]
            self._holding.add(room)
            out.append(Admitted(room, tuple(pages)))
        return out

    def release_slot(self, room: int) -> None:
        """The room's transfer ended (handed off or released). Raises if it held no slot."""
        if room not in self._holding:
            raise AdmissionError(f"room {room} holds no transfer slot", "no_slot")
        self._holding.remove(room)
