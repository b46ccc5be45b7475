"""The scheduler's state machine again, with the prefix cache on.

Prompts come from a two-token alphabet so they share leading pages often.
The fake runner reads every chunk's context back from the slots its page
table names, so a cached page holding the wrong tokens, a cached page written
again, or a page evicted while a sequence still reads it changes an output
and fails the reference check. On top of the plain machine's checks: an owned
page has one holder, a cached page's reference count is the number of
holders (live page tables and pages deferred to the end of a step), and at
the end every page is free with nothing referenced.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from pdcluster.runtime.engine.caching_allocator import CachingPageAllocator
from pdcluster.runtime.engine.scheduler import Scheduler, SchedulerConfig
from pdcluster.runtime.engine.sequence import Sequence
from tests.engine.test_scheduler import (
    CONFIGS,
    POOL_TOKENS,
    REQUESTS,
    FakeRunner,
    SchedulerMachine,
)

SHARING_REQUESTS = REQUESTS.map(
    lambda seq: replace(seq, prompt_token_ids=[t % 2 for t in seq.prompt_token_ids])
)


class CachingSchedulerMachine(SchedulerMachine):
    @initialize(config=CONFIGS, pool_tokens=POOL_TOKENS)
    def setup(self, config: SchedulerConfig, pool_tokens: int) -> None:
        super().setup(config, pool_tokens)
        self.alloc = CachingPageAllocator(
            self.total, page_size=config.page_size, salt=b"test", enabled=True
        )
        self.sched = Scheduler(config, self.alloc)
        self.runner = FakeRunner(config.page_size)

    @rule(specs=st.lists(SHARING_REQUESTS, min_size=1, max_size=4))
    def add(self, specs: list[Sequence]) -> None:
        for spec in specs:
            self._add_one(spec)

    @invariant()
    def pages_have_one_owner(self) -> None:
        if not hasattr(self, "alloc"):
            return
        alloc = self.alloc
        holders = Counter(p for s in self.live.values() for p in s.page_table)
        holders.update(self.deferred)
        for page, n in holders.items():
            if alloc.is_cached(page):
                assert alloc.refcount(page) == n, f"cached page {page}: {n} holders"
            else:
                assert n == 1, f"owned page {page} belongs to {n} sequences"
        owned = [p for p in holders if not alloc.is_cached(p)]
        assert alloc.num_owned == len(owned), "page leak"
        referenced = sum(1 for p in holders if alloc.is_cached(p))
        assert alloc.num_cached - alloc.num_evictable == referenced

    def teardown(self) -> None:
        super().teardown()
        if hasattr(self, "alloc"):
            assert self.alloc.num_owned == 0
            assert self.alloc.num_evictable == self.alloc.num_cached
            event("hit" if self.sched.num_hit_tokens else "no hit")
            event("evicted" if self.alloc.metrics().evicted_pages else "no eviction")


CachingSchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
TestCachingSchedulerMachine = CachingSchedulerMachine.TestCase
