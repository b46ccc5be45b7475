"""Page allocator: all-or-nothing allocation, loud double free, no leak."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from pdcluster.runtime.engine.page_allocator import OutOfPages, PageAllocator, PageAllocatorError


@pytest.mark.parametrize("num_pages", [0, -1, 2.0, True, "4", None])
def test_pool_size_must_be_a_positive_integer(num_pages: object) -> None:
    with pytest.raises(PageAllocatorError, match="num_pages"):
        PageAllocator(num_pages)  # type: ignore[arg-type]


def test_pages_are_handed_out_lowest_first_and_reused_lowest_first() -> None:
    alloc = PageAllocator(8)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(2) == [3, 4]
    alloc.free([1, 3])
    assert alloc.allocate(3) == [1, 3, 5]


def test_same_calls_give_same_pages_on_every_run() -> None:
    def run() -> list[list[int]]:
        alloc = PageAllocator(16)
        a, b = alloc.allocate(5), alloc.allocate(4)
        alloc.free(a[1:4])
        alloc.free(b[:1])
        return [alloc.allocate(6), alloc.allocate(2)]

    assert run() == run()


@pytest.mark.parametrize(("total", "taken", "request_n"), [(4, 0, 5), (4, 3, 2), (1, 1, 1)])
def test_allocation_is_all_or_nothing(total: int, taken: int, request_n: int) -> None:
    alloc = PageAllocator(total)
    held = alloc.allocate(taken)
    assert not alloc.can_allocate(request_n)
    with pytest.raises(OutOfPages, match=f"requested {request_n} pages") as info:
        alloc.allocate(request_n)
    assert info.value.available == total - taken
    assert alloc.num_free == total - taken
    assert all(alloc.is_allocated(p) for p in held)
    assert not any(alloc.is_allocated(p) for p in range(total) if p not in held)


def test_zero_pages_is_an_empty_allocation() -> None:
    alloc = PageAllocator(2)
    assert alloc.can_allocate(0)
    assert alloc.allocate(0) == []
    assert alloc.num_free == 2


@pytest.mark.parametrize("n", [-1, 1.5, True, "2", None])
def test_bad_counts_are_rejected(n: object) -> None:
    alloc = PageAllocator(4)
    with pytest.raises(PageAllocatorError, match="page count"):
        alloc.allocate(n)  # type: ignore[arg-type]
    with pytest.raises(PageAllocatorError, match="page count"):
        alloc.can_allocate(n)  # type: ignore[arg-type]
    assert alloc.num_free == 4


@pytest.mark.parametrize(
    ("bad_batch", "message"),
    [
        ([0, 3], "page 3 is not allocated"),  # 3 was never allocated
        ([0, 0], "listed twice"),
        ([0, 8], "unknown page 8"),
        ([0, -1], "unknown page -1"),
        ([0, True], "unknown page True"),
        ([0, "1"], "unknown page '1'"),
    ],
)
def test_bad_free_raises_and_changes_nothing(bad_batch: list[object], message: str) -> None:
    alloc = PageAllocator(8)
    alloc.allocate(3)
    with pytest.raises(PageAllocatorError, match=message):
        alloc.free(bad_batch)  # type: ignore[arg-type]
    # The good page before the bad one is still allocated: the call was atomic.
    assert alloc.is_allocated(0)
    assert alloc.num_free == 5


def test_double_free_raises() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(PageAllocatorError, match="double free"):
        alloc.free(pages[:1])
    assert alloc.num_free == 4


def test_free_accepts_any_iterable() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(3)
    alloc.free(p for p in pages if p != 1)
    assert [alloc.is_allocated(p) for p in range(4)] == [False, True, False, False]


@pytest.mark.parametrize("page", [-1, 4, 1.0])
def test_is_allocated_rejects_unknown_pages(page: object) -> None:
    with pytest.raises(PageAllocatorError, match="unknown page"):
        PageAllocator(4).is_allocated(page)  # type: ignore[arg-type]


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free traffic against a model of who holds which page."""

    grants = Bundle("grants")

    @initialize(total=st.integers(1, 40))
    def setup(self, total: int) -> None:
        self.total = total
        self.alloc = PageAllocator(total)
        self.held: set[int] = set()

    @rule(target=grants, n=st.integers(0, 12))
    def allocate(self, n: int) -> list[int]:
        free_before = self.alloc.num_free
        if n > free_before:
            with pytest.raises(OutOfPages):
                self.alloc.allocate(n)
            assert self.alloc.num_free == free_before
            return []
        pages = self.alloc.allocate(n)
        assert pages == sorted(set(range(self.total)) - self.held)[:n]
        self.held.update(pages)
        return pages

    @rule(pages=consumes(grants))
    def free(self, pages: list[int]) -> None:
        self.alloc.free(pages)
        self.held.difference_update(pages)

    @precondition(lambda self: len(self.held) < self.total)
    @rule(data=st.data())
    def free_a_free_page(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(sorted(set(range(self.total)) - self.held)))
        mixed = [*sorted(self.held)[:1], page]
        with pytest.raises(PageAllocatorError, match="not allocated"):
            self.alloc.free(mixed)

    @invariant()
    def matches_model(self) -> None:
        assert self.alloc.num_free == self.total - len(self.held)
        assert self.alloc.num_allocated == len(self.held)
        assert all(self.alloc.is_allocated(p) == (p in self.held) for p in range(self.total))

    def teardown(self) -> None:
        if hasattr(self, "alloc"):
            self.alloc.free(sorted(self.held))
            assert self.alloc.num_free == self.total


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase
