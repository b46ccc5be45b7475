"""Page ownership for one rank's KV pool: which pages are free, which are taken.

The allocator knows nothing about requests. The scheduler (for sequences it
computes) and the PD layer (for pages reserved for incoming KV) decide who
owns a page; this module only guarantees that a page is handed out once.

Invariants:
- every page in ``range(num_total)`` is either free or allocated, never both,
  and ``num_free + num_allocated == num_total`` at all times;
- ``allocate`` is all or nothing: when it raises, no page was taken;
- ``free`` checks the whole batch first (unknown page, page not allocated,
  page listed twice) and only then returns the pages, so a bad call changes
  nothing — a double free is loud, never a silent second owner later;
- free pages are handed out lowest index first, so the same sequence of calls
  yields the same pages on every run and every rank.

Pure module: no I/O, no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

__all__ = ["OutOfPages", "PageAllocator", "PageAllocatorError"]


class PageAllocatorError(Exception):
    """A call the allocator refuses; the message names the page or count."""


class OutOfPages(PageAllocatorError):
    """Fewer free pages than requested; nothing was allocated."""

    def __init__(self, requested: int, available: int, total: int) -> None:
        super().__init__(f"requested {requested} pages but only {available} of {total} are free")
        self.requested = requested
        self.available = available


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as a page index or count is a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


class PageAllocator:
    """Hands out page indices of a pool of ``num_pages`` pages."""

    def __init__(self, num_pages: int) -> None:
        if not _is_int(num_pages) or num_pages < 1:
            raise PageAllocatorError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_total: int = num_pages
        # A sorted list is already a valid min-heap.
        self._free_heap: list[int] = list(range(num_pages))
        self._allocated = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_allocated(self) -> int:
        return self.num_total - len(self._free_heap)

    def can_allocate(self, n: int) -> bool:
        self._check_count(n)
        return n <= len(self._free_heap)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (ascending), or raise OutOfPages and take none."""
        self._check_count(n)
        if n > len(self._free_heap):
            raise OutOfPages(n, len(self._free_heap), self.num_total)
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for page in pages:
            self._allocated[page] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return allocated pages; any bad page rejects the whole call."""
        batch = list(pages)
        seen: set[int] = set()
        for page in batch:
            self._check_page(page)
            if not self._allocated[page]:
                raise PageAllocatorError(f"page {page} is not allocated (double free?)")
            if page in seen:
                raise PageAllocatorError(f"page {page} listed twice in one free call")
            seen.add(page)
        for page in batch:
            self._allocated[page] = 0
            heapq.heappush(self._free_heap, page)

    def is_allocated(self, page: int) -> bool:
        self._check_page(page)
        return bool(self._allocated[page])

    def _check_count(self, n: int) -> None:
        if not _is_int(n) or n < 0:
            raise PageAllocatorError(f"page count must be a non-negative integer, got {n!r}")

    def _check_page(self, page: int) -> None:
        if not _is_int(page) or not 0 <= page < self.num_total:
            raise PageAllocatorError(
                f"unknown page {page!r}: pages are integers in [0, {self.num_total})"
            )

    def __repr__(self) -> str:
        return f"PageAllocator(num_total={self.num_total}, num_free={self.num_free})"
