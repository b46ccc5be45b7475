"""The router's prefix index matches what the worker's own cache would match:
a real `PrefixCache` publishes its changes into a `KeyEventLog`, the index
follows it through snapshot + events, and for any prompt the index counts
exactly the pages `PrefixCache.match` finds (the engine leaves the prompt's
last token to compute, and so does the index).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.engine.prefix_cache import PrefixCache
from pdcluster.runtime.prefix_events import Apply, EventBatch, KeyEventLog
from pdcluster.runtime.router.prefix_index import PrefixIndex, PromptTokens

URL = "http://127.0.0.1:9000"
OTHER = "http://127.0.0.1:9001"


class Worker:
    """A prefix cache as the engine drives it, publishing to a key-event log."""

    def __init__(self, salt: bytes = b"model-a", page_size: int = 2, tokenizer: str = "tok"):
        self.cache = PrefixCache(page_size, salt)
        self.log = KeyEventLog("e", salt=salt, page_size=page_size, tokenizer=tokenizer)
        self.cache.subscribe(self.log.record)
        self._next_page = 0

    def compute(self, prompt: list[int]) -> None:
        """Prefill ``prompt``: hit what is cached, insert the rest, then finish."""
        hit = self.cache.match(prompt[:-1]).pages
        keys = self.cache.keys_for(prompt)
        self.cache.acquire(hit)
        fresh = list(range(self._next_page, self._next_page + len(keys) - len(hit)))
        self._next_page += len(fresh)
        adopted = self.cache.insert(keys[len(hit) :], fresh)
        self.cache.release([*hit, *adopted])

    def evict(self, n: int) -> None:
        self.cache.evict(min(n, self.cache.num_evictable))


def follow(index: PrefixIndex, url: str, worker: Worker) -> None:
    if url not in index:
        index.reset(url, worker.log.snapshot())
    replica = index.replica(url)
    assert replica is not None
    assert index.apply(url, worker.log.events_after(replica.epoch, replica.seq)) is Apply.applied


_tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("compute"), _tokens), st.tuples(st.just("evict"), st.integers(1, 6))
    ),
    max_size=30,
)


@settings(max_examples=300)
@given(ops=_ops, probes=st.lists(_tokens, min_size=1, max_size=8), join=st.integers(0, 30))
def test_the_index_counts_exactly_the_pages_the_worker_would_hit(
    ops: list[tuple[str, object]], probes: list[list[int]], join: int
) -> None:
    worker = Worker()
    index = PrefixIndex()
    for step, (kind, arg) in enumerate(ops):
        if kind == "compute":
            worker.compute(arg)  # type: ignore[arg-type]
        else:
            worker.evict(arg)  # type: ignore[arg-type]
        if step >= join:
            follow(index, URL, worker)
    follow(index, URL, worker)
    for probe in probes:
        got = index.cached_pages([URL], PromptTokens(tuple(probe)))[URL]
        assert got == len(worker.cache.match(probe[:-1], record=False).pages)


def test_workers_with_other_salts_or_page_sizes_are_matched_with_their_own_keys() -> None:
    a, b, c = Worker(b"model-a", 2), Worker(b"model-b", 2), Worker(b"model-a", 4)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    for w in (a, b, c):
        w.compute(prompt)
    index = PrefixIndex()
    urls = ["http://a:1", "http://b:1", "http://c:1"]
    for url, w in zip(urls, (a, b, c), strict=True):
        follow(index, url, w)
    got = index.cached_pages(urls, PromptTokens(tuple(prompt)))
    assert got == {"http://a:1": 4, "http://b:1": 4, "http://c:1": 2}
    # The same tokens under model-b's salt are not model-a's pages.
    b_keys = b.cache.keys_for(prompt)
    assert not set(b_keys) & set(a.log.snapshot().keys)


def test_a_text_prompt_is_matched_only_against_workers_with_the_same_tokenizer() -> None:
    same, other = Worker(tokenizer="tok-1"), Worker(tokenizer="tok-2")
    prompt = [1, 2, 1, 2, 1]
    same.compute(prompt)
    other.compute(prompt)
    index = PrefixIndex()
    follow(index, URL, same)
    follow(index, OTHER, other)
    from_text = PromptTokens(tuple(prompt), tokenizer="tok-1")
    assert index.cached_pages([URL, OTHER], from_text) == {URL: 2, OTHER: 0}
    from_ids = PromptTokens(tuple(prompt))
    assert index.cached_pages([URL, OTHER], from_ids) == {URL: 2, OTHER: 2}


def test_an_unknown_worker_holds_nothing_and_a_broken_feed_drops_its_replica() -> None:
    worker = Worker()
    worker.compute([1, 2, 1, 2, 1])
    index = PrefixIndex()
    prompt = PromptTokens((1, 2, 1, 2, 1))
    assert index.cached_pages([URL], prompt) == {URL: 0}
    follow(index, URL, worker)
    assert index.cached_pages([URL], prompt) == {URL: 2}
    assert index.apply(URL, EventBatch("another-epoch", (), 0)) is Apply.other_epoch
    assert URL not in index
    assert index.cached_pages([URL], prompt) == {URL: 0}
    assert index.apply(URL, EventBatch("e", (), 0)) is Apply.gap  # no replica: snapshot first
    follow(index, URL, worker)
    index.forget(URL)
    assert index.cached_pages([URL], prompt) == {URL: 0}


@pytest.mark.parametrize("ids", [(), (5,), (2**40, 1, 2, 3, 4)])
def test_prompts_without_a_full_page_or_with_ids_no_worker_accepts_match_nothing(
    ids: tuple[int, ...],
) -> None:
    worker = Worker()
    worker.compute([1, 2, 3, 4, 5])
    index = PrefixIndex()
    follow(index, URL, worker)
    assert index.cached_pages([URL], PromptTokens(ids)) == {URL: 0}
