"""Page accounting with a prefix cache: a `PageAllocator` whose pool also holds
cached pages.

Every page is in exactly one of three states:
- unused: in the allocator's free heap, holding nothing;
- owned: handed out by ``allocate`` and not cached; only these may be
  ``free``d, and ``is_allocated`` is true exactly for them;
- cached: in the prefix cache (`prefix_cache.PrefixCache`), referenced
  (count > 0) or evictable (count 0, in the LRU queue).

Invariants (on top of the allocator's own):
- ``num_unused + num_owned + num_cached == num_total`` after every call;
- ``num_free`` (what ``allocate`` can hand out, what the scheduler sees) is
  ``num_unused + num_evictable``, and ``num_free + num_allocated == num_total``;
- ``allocate`` takes unused pages first and evicts the least recently released
  cached pages only for the shortfall; when it raises, nothing was evicted;
- a cached page is never freed (``free`` refuses it: release it instead) and
  never evicted while referenced;
- with ``enabled=False`` nothing is ever cached, and every call behaves as the
  plain `PageAllocator`'s (same pages, same errors).

``insert`` moves owned pages into the cache (the caller keeps one reference
each and releases it when done); ``evict`` moves evictable pages back to
unused.

Pure module: no I/O, no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from pdcluster.runtime.engine.page_allocator import OutOfPages, PageAllocator, PageAllocatorError
from pdcluster.runtime.engine.prefix_cache import (
    KeysListener,
    PageKey,
    PrefixCache,
    PrefixCacheError,
    PrefixCacheMetrics,
    PrefixMatch,
)

__all__ = ["CachingPageAllocator"]

_NO_MATCH = PrefixMatch((), ())


class CachingPageAllocator(PageAllocator):
    """A page pool whose unreferenced cached pages count as free until needed."""

    def __init__(self, num_pages: int, *, page_size: int, salt: bytes, enabled: bool) -> None:
        super().__init__(num_pages)
        # Built even when disabled, so bad settings fail the same either way.
        cache = PrefixCache(page_size, salt)
        self._cache: PrefixCache | None = cache if enabled else None

    @property
    def is_enabled(self) -> bool:
        return self._cache is not None

    # ---- counts ---------------------------------------------------------

    @property
    def num_unused(self) -> int:
        return len(self._free_heap)

    @property
    def num_cached(self) -> int:
        return 0 if self._cache is None else self._cache.num_cached

    @property
    def num_evictable(self) -> int:
        return 0 if self._cache is None else self._cache.num_evictable

    @property
    def num_owned(self) -> int:
        return self.num_total - self.num_unused - self.num_cached

    @property
    def num_free(self) -> int:
        return self.num_unused + self.num_evictable

    @property
    def num_allocated(self) -> int:
        return self.num_total - self.num_free

    # ---- the allocator's calls -----------------------------------------

    def can_allocate(self, n: int) -> bool:
        self._check_count(n)
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages: unused ones first, then the shortfall evicted from the
        cache's LRU; or raise OutOfPages and change nothing."""
        self._check_count(n)
        if n > self.num_free:
            raise OutOfPages(n, self.num_free, self.num_total)
        shortfall = n - len(self._free_heap)
        if shortfall > 0:
            self.evict(shortfall)
        return super().allocate(n)

    def free(self, pages: Iterable[int]) -> None:
        """Return owned pages; a cached page (or any bad page) rejects the call."""
        batch = list(pages)
        if self._cache is not None:
            for page in batch:
                if self._cache.is_cached(page):
                    raise PageAllocatorError(
                        f"page {page} is in the prefix cache: release it, do not free it"
                    )
        super().free(batch)

    def is_allocated(self, page: int) -> bool:
        """True for an owned page: allocated and not cached."""
        return super().is_allocated(page) and not self.is_cached(page)

    def is_cached(self, page: int) -> bool:
        self._check_page(page)
        return self._cache is not None and self._cache.is_cached(page)

    # ---- the prefix cache's calls ---------------------------------------

    def match(self, token_ids: Sequence[int], *, record: bool = True) -> PrefixMatch:
        """The longest cached run of leading full pages (nothing when disabled)."""
        if self._cache is None:
            return _NO_MATCH
        return self._cache.match(token_ids, record=record)

    def keys_for(self, token_ids: Sequence[int], parent: PageKey | None = None) -> list[PageKey]:
        """Keys of the full pages of ``token_ids`` (empty when disabled)."""
        if self._cache is None:
            return []
        return self._cache.keys_for(token_ids, parent)

    def insert(self, keys: Sequence[PageKey], pages: Sequence[int]) -> tuple[int, ...]:
        """Move owned, computed pages into the cache; returns those adopted (the
        caller holds one reference on each). The others stay the caller's: a
        page already cached under its key, or whose key another page holds.
        Disabled: adopts nothing."""
        if len(keys) != len(pages):
            raise PrefixCacheError(f"{len(keys)} keys for {len(pages)} pages")
        if self._cache is None:
            return ()
        for page in pages:
            self._check_page(page)
            if not self._cache.is_cached(page) and not super().is_allocated(page):
                raise PrefixCacheError(f"page {page} is not allocated: only owned pages are cached")
        # The page stays marked allocated in the heap's bookkeeping: it moves
        # from owned to cached without passing through free.
        return self._cache.insert(keys, pages)

    def acquire(self, pages: Iterable[int]) -> None:
        """One more reference on each cached page (a sequence, transfer or abort)."""
        batch = list(pages)
        if self._cache is None:
            _refuse_uncached(batch)
        else:
            self._cache.acquire(batch)

    def release(self, pages: Iterable[int]) -> None:
        """One reference less on each cached page; unreferenced ones become evictable."""
        batch = list(pages)
        if self._cache is None:
            _refuse_uncached(batch)
        else:
            self._cache.release(batch)

    def evict(self, n: int) -> list[int]:
        """Evict the ``n`` least recently released unreferenced pages back to
        unused (all or nothing); returns them."""
        if self._cache is None:
            self._check_count(n)
            if n:
                raise PrefixCacheError("the prefix cache is disabled: nothing to evict")
            return []
        pages = self._cache.evict(n)
        for page in pages:
            self._allocated[page] = 0
            heapq.heappush(self._free_heap, page)
        return pages

    def subscribe(self, listener: KeysListener) -> None:
        """Hear every change of the cache's key set (nothing when disabled)."""
        if self._cache is not None:
            self._cache.subscribe(listener)

    def refcount(self, page: int) -> int:
        """References held on a cached page (0: evictable)."""
        self._check_page(page)
        if self._cache is None:
            raise PrefixCacheError(f"page {page} is not cached (the prefix cache is disabled)")
        return self._cache.refcount(page)

    def lru_pages(self) -> list[int]:
        """Evictable pages, next to be evicted first."""
        return [] if self._cache is None else self._cache.lru_pages()

    def metrics(self) -> PrefixCacheMetrics:
        if self._cache is None:
            return PrefixCacheMetrics(0, 0, 0, 0, 0, 0)
        return self._cache.metrics()

    def __repr__(self) -> str:
        return (
            f"CachingPageAllocator(num_total={self.num_total}, num_unused={self.num_unused}, "
            f"num_cached={self.num_cached}, num_evictable={self.num_evictable})"
        )


def _refuse_uncached(batch: list[int]) -> None:
    # Disabled: no page is cached, so only an empty batch is a valid call.
    if batch:
        raise PrefixCacheError(f"page {batch[0]!r} is not cached (the prefix cache is disabled)")
