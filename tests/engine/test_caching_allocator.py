"""Page accounting with the prefix cache: evictable pages count as free, a cached
page is never freed or evicted while referenced, nothing changes when disabled."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdcluster.runtime.engine.caching_allocator import CachingPageAllocator
from pdcluster.runtime.engine.page_allocator import OutOfPages, PageAllocator, PageAllocatorError
from pdcluster.runtime.engine.prefix_cache import PageKey, PrefixCacheError

PAGE = 4
SALT = b"fingerprint"


def pool(num_pages: int, *, enabled: bool = True) -> CachingPageAllocator:
    return CachingPageAllocator(num_pages, page_size=PAGE, salt=SALT, enabled=enabled)


def cache_prompt(alloc: CachingPageAllocator, tokens: list[int]) -> list[int]:
    """What a sequence does: allocate, compute, insert, release."""
    keys = alloc.keys_for(tokens)
    pages = alloc.allocate(len(keys))
    assert alloc.insert(keys, pages) == tuple(pages)
    alloc.release(pages)
    return pages


def test_evictable_pages_count_as_free_and_are_evicted_only_when_unused_pages_run_out() -> None:
    alloc = pool(6)
    cached = cache_prompt(alloc, list(range(3 * PAGE)))  # pages 0, 1, 2
    assert (alloc.num_free, alloc.num_unused, alloc.num_evictable) == (6, 3, 3)
    assert alloc.allocate(3) == [3, 4, 5]  # unused first: the cache survives
    assert alloc.num_cached == 3
    # Two more: the LRU's first two go, tail of the chain first.
    assert alloc.allocate(2) == [1, 2]
    assert alloc.match(list(range(3 * PAGE))).pages == (cached[0],)
    assert alloc.metrics().evicted_pages == 2


def test_allocation_that_does_not_fit_evicts_nothing() -> None:
    alloc = pool(4)
    cache_prompt(alloc, list(range(2 * PAGE)))
    alloc.allocate(1)
    with pytest.raises(OutOfPages, match="requested 4 pages but only 3 of 4"):
        alloc.allocate(4)
    assert (alloc.num_cached, alloc.num_evictable) == (2, 2)


def test_a_referenced_cached_page_is_not_free_and_not_evicted() -> None:
    alloc = pool(3)
    tokens = list(range(2 * PAGE))
    pages = cache_prompt(alloc, tokens)
    alloc.acquire(alloc.match(tokens).pages)  # a new sequence reads both pages
    assert alloc.num_free == 1
    assert not alloc.can_allocate(2)
    assert alloc.allocate(1) == [2]
    assert [alloc.refcount(p) for p in pages] == [1, 1]


def test_a_cached_page_is_released_never_freed() -> None:
    alloc = pool(4)
    pages = alloc.allocate(2)
    alloc.insert(alloc.keys_for(list(range(PAGE))), pages[:1])
    with pytest.raises(PageAllocatorError, match="page 0 is in the prefix cache"):
        alloc.free(pages)
    assert alloc.is_allocated(pages[1])  # the owned page was not freed either
    assert not alloc.is_allocated(pages[0]) and alloc.is_cached(pages[0])
    alloc.free(pages[1:])
    alloc.release(pages[:1])
    assert alloc.num_free == 4


@pytest.mark.parametrize(("freed", "page"), [([], 1), ([0], 0)])
def test_only_owned_pages_are_inserted(freed: list[int], page: int) -> None:
    alloc = pool(4)
    alloc.allocate(1)  # page 0 owned, the others never allocated
    alloc.free(freed)
    with pytest.raises(PrefixCacheError, match=f"page {page} is not allocated"):
        alloc.insert(alloc.keys_for(list(range(2 * PAGE))), [page, 3])
    assert alloc.num_cached == 0
    assert alloc.num_free == 4 - 1 + len(freed)


def test_a_page_whose_prefix_another_page_holds_stays_the_callers() -> None:
    alloc = pool(4)
    tokens = list(range(PAGE))
    first = cache_prompt(alloc, tokens)
    dup = alloc.allocate(1)
    assert alloc.insert(alloc.keys_for(tokens), dup) == ()
    assert alloc.is_allocated(dup[0])
    alloc.free(dup)
    assert alloc.match(tokens).pages == tuple(first)


def test_disabled_caches_nothing() -> None:
    alloc = pool(4, enabled=False)
    tokens = list(range(2 * PAGE))
    pages = alloc.allocate(2)
    assert alloc.keys_for(tokens) == []
    assert alloc.insert([], []) == ()
    assert alloc.match(tokens) == ((), ())
    with pytest.raises(PrefixCacheError, match="disabled"):
        alloc.release(pages)
    with pytest.raises(PrefixCacheError, match="disabled"):
        alloc.evict(1)
    assert alloc.evict(0) == []
    alloc.free(pages)
    assert alloc.num_free == 4
    assert alloc.metrics().cached_pages == 0


ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(-1, 7)),
        st.tuples(st.just("free"), st.lists(st.integers(-1, 9), max_size=4)),
    ),
    max_size=40,
)


@given(total=st.integers(1, 8), trace=ops)
def test_disabled_behaves_as_the_plain_allocator(
    total: int, trace: list[tuple[str, object]]
) -> None:
    plain, caching = PageAllocator(total), pool(total, enabled=False)

    def outcome(alloc: PageAllocator, op: str, arg: object) -> object:
        try:
            return getattr(alloc, op)(arg)
        except PageAllocatorError as exc:
            return (type(exc), str(exc))

    for op, arg in trace:
        assert outcome(caching, op, arg) == outcome(plain, op, arg)
        assert (caching.num_free, caching.num_allocated) == (plain.num_free, plain.num_allocated)
        assert [caching.is_allocated(p) for p in range(total)] == [
            plain.is_allocated(p) for p in range(total)
        ]


# Prompts made of a few page contents, so prompts share prefixes of 0..4 pages.
_PAGE_CONTENTS = [[c] * PAGE for c in range(3)]
prompts = st.lists(st.sampled_from(_PAGE_CONTENTS), min_size=1, max_size=4).map(
    lambda pages: [t for page in pages for t in page]
)


class CachingAllocatorMachine(RuleBasedStateMachine):
    """allocate/free/insert/match/acquire/release/evict against a model of every
    page's state: unused, owned, or cached (with its key and count) and the LRU."""

    @initialize(total=st.integers(1, 12))
    def setup(self, total: int) -> None:
        self.total = total
        self.alloc = pool(total)
        self.owned: set[int] = set()
        self.key_of: dict[int, PageKey] = {}
        self.refs: dict[int, int] = {}
        self.lru: list[int] = []

    # ---- model helpers ----

    @property
    def unused(self) -> set[int]:
        return set(range(self.total)) - self.owned - set(self.key_of)

    def _forget(self, pages: list[int]) -> None:
        for page in pages:
            assert self.refs.pop(page) == 0, f"evicted page {page} was referenced"
            del self.key_of[page]
            self.lru.remove(page)

    # ---- rules ----

    @rule(n=st.integers(0, 6))
    def allocate(self, n: int) -> None:
        free = len(self.unused) + len(self.lru)
        if n > free:
            with pytest.raises(OutOfPages):
                self.alloc.allocate(n)
            return
        shortfall = max(0, n - len(self.unused))
        evicted = self.lru[:shortfall]
        expected = sorted(self.unused | set(evicted))[:n]
        assert self.alloc.allocate(n) == expected
        self._forget(evicted)
        self.owned.update(expected)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        pages = data.draw(st.lists(st.sampled_from(sorted(self.owned)), unique=True))
        self.alloc.free(pages)
        self.owned.difference_update(pages)

    @precondition(lambda self: self.key_of)
    @rule(data=st.data())
    def free_a_cached_page_is_refused(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(sorted(self.key_of)))
        with pytest.raises(PageAllocatorError, match="prefix cache"):
            self.alloc.free([*sorted(self.owned)[:1], page])

    @rule(tokens=prompts, data=st.data())
    def insert(self, tokens: list[int], data: st.DataObject) -> None:
        """A sequence that matched a prefix, acquired it and computed the rest
        on owned pages inserts its whole chain."""
        keys = self.alloc.keys_for(tokens)
        hit = list(self.alloc.match(tokens, record=False).pages)
        fresh = sorted(self.owned)[: len(keys) - len(hit)]
        keys, pages = keys[: len(hit) + len(fresh)], hit + fresh
        if data.draw(st.booleans()):
            self.acquire_pages(hit)
        adopted = self.alloc.insert(keys, pages)
        expected = [
            p
            for k, p in zip(keys, pages, strict=True)
            if p in fresh and k not in self.key_of.values()
        ]
        assert list(adopted) == expected
        for key, page in zip(keys, pages, strict=True):
            if page in adopted:
                self.owned.discard(page)
                self.key_of[page] = key
                self.refs[page] = 1

    @rule(tokens=prompts)
    def match(self, tokens: list[int]) -> None:
        page_of = {k: p for p, k in self.key_of.items()}
        expected: list[int] = []
        for key in self.alloc.keys_for(tokens):
            if key not in page_of:
                break
            expected.append(page_of[key])
        before = self.alloc.metrics()
        assert list(self.alloc.match(tokens).pages) == expected
        after = self.alloc.metrics()
        assert after.hit_pages - before.hit_pages == len(expected)
        assert after.miss_pages - before.miss_pages == len(tokens) // PAGE - len(expected)

    @precondition(lambda self: self.key_of)
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        self.acquire_pages(data.draw(st.lists(st.sampled_from(sorted(self.key_of)), unique=True)))

    def acquire_pages(self, pages: list[int]) -> None:
        self.alloc.acquire(pages)
        for page in pages:
            self.refs[page] += 1
            if page in self.lru:
                self.lru.remove(page)

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held = sorted(p for p, n in self.refs.items() if n)
        pages = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
        self.alloc.release(pages)
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.lru.append(page)

    @precondition(lambda self: self.lru)
    @rule(data=st.data())
    def release_below_zero_is_refused(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.lru))
        with pytest.raises(PrefixCacheError, match="no reference"):
            self.alloc.release([page])

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        if n > len(self.lru):
            with pytest.raises(PrefixCacheError, match="unreferenced"):
                self.alloc.evict(n)
            return
        expected = self.lru[:n]
        assert self.alloc.evict(n) == expected
        self._forget(expected)

    # ---- invariants ----

    @invariant()
    def every_page_in_exactly_one_state(self) -> None:
        a = self.alloc
        assert a.num_unused + a.num_owned + a.num_cached == self.total
        assert (a.num_owned, a.num_cached) == (len(self.owned), len(self.key_of))
        assert a.num_free == len(self.unused) + len(self.lru)
        assert a.num_free + a.num_allocated == self.total
        for page in range(self.total):
            owned, cached = a.is_allocated(page), a.is_cached(page)
            assert not (owned and cached), f"page {page} both owned and cached"
            assert owned == (page in self.owned)
            assert cached == (page in self.key_of)

    @invariant()
    def refcounts_match_and_are_never_negative(self) -> None:
        for page, n in self.refs.items():
            assert self.alloc.refcount(page) == n >= 0

    @invariant()
    def lru_holds_exactly_the_unreferenced_pages_in_release_order(self) -> None:
        assert self.alloc.lru_pages() == self.lru
        assert {p for p, n in self.refs.items() if n == 0} == set(self.lru)

    def teardown(self) -> None:
        if hasattr(self, "alloc"):
            a = self.alloc
            for page, n in self.refs.items():
                for _ in range(n):
                    a.release([page])
            a.free(sorted(self.owned))
            assert a.num_free == self.total
            a.evict(a.num_evictable)
            assert a.num_unused == self.total


CachingAllocatorMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
TestCachingAllocatorMachine = CachingAllocatorMachine.TestCase


def test_a_listener_hears_every_key_stored_and_evicted_in_order() -> None:
    from pdcluster.runtime.prefix_events import KeyEventLog

    alloc = pool(6)
    log = KeyEventLog("e", salt=SALT, page_size=PAGE)
    heard: list[tuple[bool, int]] = []
    alloc.subscribe(log.record)
    alloc.subscribe(lambda stored, keys: heard.append((stored, len(keys))))
    cache_prompt(alloc, list(range(3 * PAGE)))
    keys = alloc.keys_for(list(range(3 * PAGE)))
    again = alloc.allocate(3)
    assert alloc.insert(keys, again) == ()  # all cached already: no event
    alloc.free(again)
    alloc.allocate(5)  # evicts two of the three cached pages
    assert heard == [(True, 3), (False, 2)]
    assert log.snapshot().keys == set(alloc.keys_for(list(range(PAGE))))
    # A disabled cache has no key set to report.
    off = pool(4, enabled=False)
    off.subscribe(lambda stored, keys: heard.append((stored, len(keys))))
    off.allocate(2)
    assert len(heard) == 2
