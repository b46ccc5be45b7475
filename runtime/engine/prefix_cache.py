"""The prefix cache's index: which full pages hold which token prefix.

A page's key is a 128-bit BLAKE2b digest of its parent's key and its own token
ids, so a key names the whole prefix up to the end of its page, not just that
page's tokens. The first page's parent is a root key derived from the cache's
salt (the model fingerprint and every setting that changes KV bytes), so a
change of salt changes every key. Only full pages get keys: a partial last
page is never cached.

The index does not own pages; `caching_allocator.CachingPageAllocator` does the
page accounting around it. Here each cached page has a reference count (a
sequence reading it, a transfer sending from it, a pending abort that may still
see a write land in it each hold one), and a cached page whose count is zero
sits in an LRU queue, the only pages ``evict`` may take.

Invariants:
- a key maps to one page and a page to one key, both ways (``_page_of`` and
  ``_key_of`` are inverse);
- a page is in the LRU queue exactly when it is cached and its count is zero:
  a referenced page is never evicted;
- counts never go negative: a release below zero is refused;
- every call checks its whole batch before it changes anything, so a bad call
  changes nothing (same as the page allocator);
- the LRU queue is in the order pages became unreferenced; one ``release``
  queues its pages last page first, so a chain's tail is evicted before its
  head (a head evicted first would strand its tail, unreachable by ``match``);
- a subscribed listener hears every change of the key set (keys adopted by
  ``insert``, keys removed by ``evict``), once, after it is made and in the
  order made, so a copy of the key set built from what it heard is exact.

The key scheme itself lives in `pdcluster.runtime.prefix_keys`, shared with
the router's index.

Pure module: no I/O, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pdcluster.runtime import prefix_keys
from pdcluster.runtime.engine.page_allocator import PageAllocatorError
from pdcluster.runtime.prefix_keys import KEY_BYTES, PageKey, PageKeyError

__all__ = [
    "KEY_BYTES",
    "KeysListener",
    "PageKey",
    "PrefixCache",
    "PrefixCacheError",
    "PrefixCacheMetrics",
    "PrefixMatch",
    "chain_page_keys",
    "root_key",
]

# Told ``(stored, keys)`` after the index gained (True) or lost (False) keys;
# a worker publishes these to the router (`prefix_events.py`).
KeysListener = Callable[[bool, Sequence[PageKey]], None]


class PrefixCacheError(PageAllocatorError):
    """A call the prefix cache refuses; the message names the page or key."""


def root_key(salt: bytes) -> PageKey:
    """The parent key of a prompt's first page, for caches with this salt."""
    try:
        return prefix_keys.root_key(salt)
    except PageKeyError as err:
        raise PrefixCacheError(str(err)) from None


def chain_page_keys(token_ids: Sequence[int], page_size: int, parent: PageKey) -> list[PageKey]:
    """Keys of the full pages of ``token_ids``, chained from ``parent``
    (`prefix_keys.chain_page_keys`, the scheme the router shares)."""
    try:
        return prefix_keys.chain_page_keys(token_ids, page_size, parent)
    except PageKeyError as err:
        raise PrefixCacheError(str(err)) from None


def _page_key(parent: bytes, page_tokens: Sequence[int]) -> PageKey:
    try:
        return prefix_keys.page_key(parent, page_tokens)
    except PageKeyError as err:
        raise PrefixCacheError(str(err)) from None


def _check_page_size(page_size: int) -> None:
    try:
        prefix_keys.check_page_size(page_size)
    except PageKeyError as err:
        raise PrefixCacheError(str(err)) from None


class PrefixMatch(NamedTuple):
    """The longest cached run of a prompt's leading full pages."""

    keys: tuple[PageKey, ...]
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefixCacheMetrics:
    """Counters (pages, since start) and gauges (pages, now) of one cache."""

    hit_pages: int  # leading full pages ``match`` found cached
    miss_pages: int  # full pages ``match`` looked for and did not find
    inserted_pages: int  # pages ``insert`` adopted
    evicted_pages: int  # pages ``evict`` removed
    cached_pages: int  # gauge: pages in the index
    evictable_pages: int  # gauge: cached pages nobody references


class PrefixCache:
    """Key → page index with reference counts and an LRU of unreferenced pages."""

    def __init__(self, page_size: int, salt: bytes) -> None:
        _check_page_size(page_size)
        self.page_size = page_size
        self.root = root_key(salt)
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._refs: dict[int, int] = {}
        # Unreferenced cached pages, least recently released first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._hits = self._misses = self._inserted = self._evicted = 0
        self._listeners: list[KeysListener] = []

    # ---- queries --------------------------------------------------------

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def refcount(self, page: int) -> int:
        """References held on a cached page (0: evictable)."""
        if page not in self._refs:
            raise PrefixCacheError(f"page {page!r} is not cached")
        return self._refs[page]

    def lru_pages(self) -> list[int]:
        """Evictable pages, next to be evicted first."""
        return list(self._lru)

    def keys_for(self, token_ids: Sequence[int], parent: PageKey | None = None) -> list[PageKey]:
        """Keys of the full pages of ``token_ids`` (from the root unless ``parent``)."""
        return chain_page_keys(token_ids, self.page_size, self.root if parent is None else parent)

    def match(self, token_ids: Sequence[int], *, record: bool = True) -> PrefixMatch:
        """The longest cached run of leading full pages of ``token_ids``.

        Stops at the first page not cached (hashing no further). Takes no
        reference: the caller acquires the pages it keeps. With ``record`` the
        hit and miss counters count this prompt's full pages; a caller that
        asks again for the same prompt passes ``record=False``. A caller that
        must compute at least one token passes the prompt without its last.
        """
        num_full = len(token_ids) // self.page_size
        keys: list[PageKey] = []
        pages: list[int] = []
        parent = self.root
        for i in range(num_full):
            start = i * self.page_size
            key = _page_key(parent, token_ids[start : start + self.page_size])
            page = self._page_of.get(key)
            if page is None:
                break
            keys.append(key)
            pages.append(page)
            parent = key
        if record:
            self._hits += len(pages)
            self._misses += num_full - len(pages)
        return PrefixMatch(tuple(keys), tuple(pages))

    def metrics(self) -> PrefixCacheMetrics:
        return PrefixCacheMetrics(
            hit_pages=self._hits,
            miss_pages=self._misses,
            inserted_pages=self._inserted,
            evicted_pages=self._evicted,
            cached_pages=len(self._key_of),
            evictable_pages=len(self._lru),
        )

    def subscribe(self, listener: KeysListener) -> None:
        """Call ``listener`` after every change of the key set (not of counts)."""
        self._listeners.append(listener)

    def _tell(self, stored: bool, keys: Sequence[PageKey]) -> None:
        if keys:
            for listener in self._listeners:
                listener(stored, keys)

    # ---- changes --------------------------------------------------------

    def insert(self, keys: Sequence[PageKey], pages: Sequence[int]) -> tuple[int, ...]:
        """Cache ``pages`` under ``keys`` (page i holds the prefix keyed by keys[i]).

        Returns the pages adopted; each starts with one reference, the
        inserter's. A page already cached under its key is skipped (a sequence
        that matched it inserts its whole chain again); a key already cached on
        another page is skipped too (two sequences computed the same prefix):
        that page stays the caller's. A page cached under another key, a key
        or page listed twice, or a malformed key rejects the whole call.
        """
        if len(keys) != len(pages):
            raise PrefixCacheError(f"{len(keys)} keys for {len(pages)} pages")
        for key, page in zip(keys, pages, strict=True):
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise PrefixCacheError(f"a key is {KEY_BYTES} bytes, got {key!r}")
            if not isinstance(page, int) or isinstance(page, bool) or page < 0:
                raise PrefixCacheError(f"a page is a non-negative integer, got {page!r}")
        _check_unique(pages, "page")
        _check_unique(keys, "key")
        adopt: list[tuple[PageKey, int]] = []
        for key, page in zip(keys, pages, strict=True):
            held = self._key_of.get(page)
            if held is not None and held != key:
                raise PrefixCacheError(f"page {page} is already cached under another key")
            if held is None and key not in self._page_of:
                adopt.append((key, page))
        for key, page in adopt:
            self._page_of[key] = page
            self._key_of[page] = key
            self._refs[page] = 1
        self._inserted += len(adopt)
        self._tell(True, [key for key, _ in adopt])
        return tuple(page for _, page in adopt)

    def acquire(self, pages: Iterable[int]) -> None:
        """Take one reference on each cached page; it leaves the LRU queue."""
        batch = self._checked_batch(pages)
        for page in batch:
            self._refs[page] += 1
            self._lru.pop(page, None)

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference on each page; those left unreferenced join the
        LRU queue, the last page of ``pages`` first."""
        batch = self._checked_batch(pages)
        for page in batch:
            if self._refs[page] == 0:
                raise PrefixCacheError(f"page {page} holds no reference to release")
        for page in reversed(batch):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._lru[page] = None

    def evict(self, n: int) -> list[int]:
        """Remove the ``n`` least recently released unreferenced pages from the
        index and return them (all or nothing); the caller frees them."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise PrefixCacheError(f"evict count must be a non-negative integer, got {n!r}")
        if n > len(self._lru):
            raise PrefixCacheError(
                f"asked to evict {n} pages but only {len(self._lru)} are unreferenced"
            )
        evicted = []
        gone: list[PageKey] = []
        for _ in range(n):
            page, _ = self._lru.popitem(last=False)
            key = self._key_of.pop(page)
            del self._page_of[key]
            del self._refs[page]
            evicted.append(page)
            gone.append(key)
        self._evicted += n
        self._tell(False, gone)
        return evicted

    def _checked_batch(self, pages: Iterable[int]) -> list[int]:
        batch = list(pages)
        _check_unique(batch, "page")
        for page in batch:
            if page not in self._key_of:
                raise PrefixCacheError(f"page {page!r} is not cached")
        return batch

    def __repr__(self) -> str:
        return f"PrefixCache(cached={self.num_cached}, evictable={self.num_evictable})"


def _check_unique(items: Sequence[object], what: str) -> None:
    seen: set[object] = set()
    for item in items:
        if item in seen:
            raise PrefixCacheError(f"{what} {item!r} listed twice in one call")
        seen.add(item)
