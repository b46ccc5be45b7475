"""cache_aware keeps a huge prompt's work off the router's event loop, and bounded.

Reading a prompt (parsing its body, tokenizing, checking its ids) and
hashing it into page keys take time in proportion to its length; on the
loop they held every other request for as long (an 8 MiB body: most of a
second). Here the hashing of one huge prompt is held mid-way, and other
requests must still be served meanwhile; and the keys hashed never go past
the longest prefix any followed worker could hold.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from pdcluster.runtime.prefix_events import Snapshot
from pdcluster.runtime.prefix_keys import PageKey, chain_page_keys, root_key
from pdcluster.runtime.router import prefix_index
from pdcluster.runtime.router.prefix_index import PrefixIndex, PromptTokens

from .harness import Cluster, LoopThread, start_cluster

PAGE = 4
SALT = b"loop-salt"
HUGE = 600_000  # prompt tokens: a ~5 MiB body of ids
CACHED_PAGES = HUGE // PAGE // 2  # the holder has the first half of it
HELD_AT = 10_000  # a hashing call over at least this many tokens is held


def snapshot(keys: Sequence[PageKey]) -> Snapshot:
    return Snapshot("epoch", 0, frozenset(keys), SALT, PAGE, "")


@pytest.fixture
def cluster(loop: LoopThread) -> Iterator[Cluster]:
    settings: dict[str, Any] = {
        "prefill_policy": "cache_aware",
        "decode_policy": "cache_aware",
        "max_body_bytes": 16 << 20,
    }
    with start_cluster(loop, prefill=2, decode=1, **settings) as started:
        state = started.state
        # The stand-ins publish no feed: the index is filled by hand, unfollowed.
        assert state.follower is not None
        loop.run(state.follower.close())
        state.follower = None
        yield started


class HeldHashing:
    """`chain_page_keys`, held on entry for a long input until `release` is set."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.thread: str | None = None

    def __call__(self, ids: Sequence[int], page_size: int, parent: PageKey) -> list[PageKey]:
        if len(ids) >= HELD_AT:
            self.thread = threading.current_thread().name
            self.entered.set()
            self.release.wait(20)
        return chain_page_keys(ids, page_size, parent)


def test_other_requests_are_served_while_a_huge_prompt_is_routed(
    cluster: Cluster, loop: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [7 + i % 1000 for i in range(HUGE)]
    keys = chain_page_keys(ids[: CACHED_PAGES * PAGE], PAGE, root_key(SALT))
    holder = cluster.prefill[1].url
    loop.call(cluster.state.prefix_index.reset, holder, snapshot(keys))
    held = HeldHashing()
    monkeypatch.setattr(prefix_index, "chain_page_keys", held)
    answer: dict[str, Any] = {}

    def huge() -> None:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
        resp = httpx.post(cluster.router_url + "/generate", json=body, timeout=60)
        answer["status"] = resp.status_code

    sender = threading.Thread(target=huge, daemon=True)
    sender.start()
    try:
        assert held.entered.wait(30), "the huge prompt was never hashed"
        # The hashing is held: the loop must still serve everyone else.
        with httpx.Client(base_url=cluster.router_url, timeout=5) as http:
            assert http.get("/health").status_code == 200
            small = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
            assert http.post("/generate", json=small).status_code == 200
        assert held.thread != loop._thread.name
    finally:
        held.release.set()
    sender.join(60)
    assert answer == {"status": 200}
    # It went to the worker holding its first half.
    assert len(cluster.prefill[1].bodies("/generate")) == 1


def test_keys_are_hashed_only_as_far_as_a_worker_could_hold_them() -> None:
    index = PrefixIndex()
    ids = tuple(range(1, 4001))
    held = chain_page_keys(ids[:40], PAGE, root_key(SALT))  # 10 pages
    index.reset("http://a", snapshot(held))
    index.reset("http://b", snapshot(held[:3]))
    prompt = PromptTokens(ids)
    keyed = index.keyed(prompt)
    # A worker holds 10 keys: no prompt page past the 10th can be a hit there.
    assert [len(chain) for chain in keyed.keys.values()] == [10]
    assert index.cached_pages(["http://a", "http://b", "http://c"], keyed) == {
        "http://a": 10,
        "http://b": 3,
        "http://c": 0,
    }
    # The same answer as hashing the whole prompt.
    assert index.cached_pages(["http://a", "http://b"], prompt) == {
        "http://a": 10,
        "http://b": 3,
    }
