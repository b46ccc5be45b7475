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

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from pdcluster.runtime.engine.caching_allocator import CachingPageAllocator
from pdcluster.runtime.engine.scheduler import RequestRejected, Scheduler, SchedulerConfig
from pdcluster.runtime.engine.sequence import Sequence
from pdcluster.runtime.pd.prefix_reuse import num_reusable_pages
from pdcluster.runtime.spec import pages_for
from tests.engine.test_scheduler import (
    CONFIGS,
    DEFAULTS,
    POOL_TOKENS,
    REQUESTS,
    FakeRunner,
    SchedulerMachine,
    admissible,
    next_token,
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

    @rule(spec=SHARING_REQUESTS)
    def add_reusing(self, spec: Sequence) -> None:
        """Decode-side reuse: a prefilled sequence whose leading full pages are
        cached pages referenced for it; only the rest is written ("sent")."""
        if not spec.prompt_token_ids or self.batch is not None:
            return
        seq = replace(spec, rid=f"r{self.count}", mode="prefilled")
        self.count += 1
        size, alloc = self.cfg.page_size, self.alloc
        n = seq.num_prompt_tokens
        hits = alloc.match(seq.prompt_token_ids, record=False).pages
        hits = hits[: num_reusable_pages(len(hits), n, size)]
        need = pages_for(n, size) - len(hits)
        evictable = sum(1 for p in hits if alloc.refcount(p) == 0)
        if need + evictable > alloc.num_free or not admissible(self.cfg, self.total, seq):
            return
        alloc.acquire(hits)
        pages = [*hits, *alloc.allocate(need)]
        start = len(hits) * size
        self.runner.write(pages, start, seq.prompt_token_ids[start:])
        seq = replace(
            seq,
            page_table=pages,
            num_computed_tokens=n,
            output_token_ids=[next_token(seq.prompt_token_ids)],
        )
        if hits:
            event("decode reused cached pages")
        self.live[seq.rid] = seq
        self.sched.add(seq)
        if seq.status.name == "FINISHED":
            del self.live[seq.rid]

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


def _caching(num_pages: int = 16) -> tuple[Scheduler, CachingPageAllocator, FakeRunner]:
    cfg = CONFIGS_EXAMPLE
    alloc = CachingPageAllocator(num_pages, page_size=cfg.page_size, salt=b"t", enabled=True)
    return Scheduler(cfg, alloc), alloc, FakeRunner(cfg.page_size)


CONFIGS_EXAMPLE = replace(DEFAULTS, max_running_requests=4, max_model_len=96)


def _prefilled(rid: str, prompt: list[int], pages: list[int]) -> Sequence:
    return Sequence(
        rid=rid,
        prompt_token_ids=prompt,
        max_tokens=4,
        mode="prefilled",  # type: ignore[arg-type]
        page_table=pages,
        num_computed_tokens=len(prompt),
        output_token_ids=[next_token(prompt)],
        ignore_eos=True,
    )


def test_a_received_prompt_is_cached_and_a_later_one_reuses_its_pages() -> None:
    sched, alloc, _ = _caching()
    prompt = list(range(1, 11))  # 2 full pages of 4 + 2 tokens
    first = alloc.allocate(3)
    sched.add(_prefilled("a", prompt, first))
    assert [alloc.is_cached(p) for p in first] == [True, True, False]
    # What decode's admission does for the next room with this prompt.
    hits = alloc.match(prompt, record=False).pages
    assert hits == tuple(first[:2])
    alloc.acquire(hits)
    second = [*hits, *alloc.allocate(1)]
    sched.add(_prefilled("b", [*prompt[:8], 77, 78], second))
    assert [alloc.refcount(p) for p in hits] == [2, 2]
    sched.abort("a")
    sched.abort("b")
    assert alloc.num_owned == 0 and alloc.num_free == alloc.num_total


def test_a_cached_page_nobody_referenced_for_the_sequence_is_refused() -> None:
    sched, alloc, _ = _caching()
    prompt = list(range(1, 11))
    first = alloc.allocate(3)
    sched.add(_prefilled("a", prompt, first))
    sched.abort("a")  # its cached pages are now evictable, referenced by nobody
    assert alloc.num_evictable == 2
    tail = alloc.allocate(1)
    with pytest.raises(RequestRejected, match="holds no reference"):
        sched.add(_prefilled("b", prompt, [*first[:2], *tail]))
    assert sched.get("b") is None and alloc.num_evictable == 2
    alloc.free(tail)
    assert alloc.num_free == alloc.num_total
