"""Prefix cache index: the key chain over full pages, match, insert, refcounts, LRU."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.engine.prefix_cache import (
    KEY_BYTES,
    PrefixCache,
    PrefixCacheError,
    chain_page_keys,
    root_key,
)

PAGE = 4
SALT = b"model-fingerprint:kv=bf16"

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=6 * PAGE)


def prompt(num_tokens: int, start: int = 100) -> list[int]:
    return list(range(start, start + num_tokens))


def test_a_key_hashes_the_parent_key_and_the_pages_token_ids() -> None:
    # The scheme other components (decode-side reuse, the router index) rely on.
    tokens = prompt(2 * PAGE)
    keys = PrefixCache(PAGE, SALT).keys_for(tokens)
    root = hashlib.blake2b(SALT, digest_size=16, person=b"pdcluster.root").digest()
    parent = root
    for i, key in enumerate(keys):
        page = struct.pack(f"<{PAGE}I", *tokens[i * PAGE : (i + 1) * PAGE])
        parent = hashlib.blake2b(parent + page, digest_size=16, person=b"pdcluster.page").digest()
        assert key == parent
    assert [len(k) for k in keys] == [KEY_BYTES, KEY_BYTES]


@given(shared=token_lists, a=token_lists, b=token_lists)
def test_same_prefix_gives_same_keys_on_every_cache(
    shared: list[int], a: list[int], b: list[int]
) -> None:
    shared = shared[: len(shared) // PAGE * PAGE]  # page-aligned shared prefix
    keys_a = PrefixCache(PAGE, SALT).keys_for(shared + a)
    keys_b = PrefixCache(PAGE, SALT).keys_for(shared + b)
    n = len(shared) // PAGE
    assert keys_a[:n] == keys_b[:n]
    assert len(keys_a) == len(shared + a) // PAGE


@given(tokens=st.lists(st.integers(0, 1000), min_size=PAGE, max_size=6 * PAGE), data=st.data())
def test_one_different_token_changes_every_key_from_its_page_on(
    tokens: list[int], data: st.DataObject
) -> None:
    cache = PrefixCache(PAGE, SALT)
    pos = data.draw(st.integers(0, len(tokens) // PAGE * PAGE - 1))
    changed = [*tokens]
    changed[pos] += 1
    before, after = cache.keys_for(tokens), cache.keys_for(changed)
    page = pos // PAGE
    assert before[:page] == after[:page]
    assert all(x != y for x, y in zip(before[page:], after[page:], strict=True))


def test_salt_changes_every_key() -> None:
    tokens = prompt(5 * PAGE)
    keys = PrefixCache(PAGE, SALT).keys_for(tokens)
    other = PrefixCache(PAGE, SALT + b"x").keys_for(tokens)
    assert len(keys) == 5
    assert not set(keys) & set(other)


def test_same_tokens_in_another_position_get_another_key() -> None:
    page = prompt(PAGE)
    keys = PrefixCache(PAGE, SALT).keys_for(page * 3)
    assert len(set(keys)) == 3


@pytest.mark.parametrize("num_tokens", [0, 1, PAGE - 1, PAGE + 1, 3 * PAGE - 1])
def test_a_partial_last_page_gets_no_key_and_is_never_matched(num_tokens: int) -> None:
    cache = PrefixCache(PAGE, SALT)
    tokens = prompt(num_tokens)
    keys = cache.keys_for(tokens)
    assert len(keys) == num_tokens // PAGE
    cache.insert(keys, list(range(len(keys))))
    # The same prompt with its partial page completed differently matches the
    # full pages only.
    assert cache.match(tokens + [7] * PAGE).pages == tuple(range(len(keys)))


def test_a_chain_continues_from_a_parent_key() -> None:
    cache = PrefixCache(PAGE, SALT)
    tokens = prompt(4 * PAGE)
    keys = cache.keys_for(tokens)
    assert cache.keys_for(tokens[2 * PAGE :], parent=keys[1]) == keys[2:]
    assert chain_page_keys(tokens, PAGE, root_key(SALT)) == keys


def test_match_returns_the_longest_leading_run_and_stops_at_the_first_miss() -> None:
    cache = PrefixCache(PAGE, SALT)
    tokens = prompt(4 * PAGE)
    keys = cache.keys_for(tokens)
    # Pages 0, 2 and 3 cached, page 1 not: only page 0 is a usable prefix.
    cache.insert([keys[0], keys[2], keys[3]], [10, 12, 13])
    keys_hit, pages = cache.match(tokens)
    assert (keys_hit, pages) == ((keys[0],), (10,))
    assert cache.match(prompt(4 * PAGE, start=5000)).pages == ()


def test_match_counts_hits_and_misses_in_pages_unless_told_not_to() -> None:
    cache = PrefixCache(PAGE, SALT)
    tokens = prompt(3 * PAGE + 1)
    keys = cache.keys_for(tokens)
    cache.insert(keys[:2], [0, 1])
    cache.match(tokens)
    cache.match(tokens, record=False)
    m = cache.metrics()
    assert (m.hit_pages, m.miss_pages, m.inserted_pages, m.cached_pages) == (2, 1, 2, 2)


def test_insert_skips_pages_already_cached_and_keys_another_page_holds() -> None:
    cache = PrefixCache(PAGE, SALT)
    keys = cache.keys_for(prompt(3 * PAGE))
    assert cache.insert(keys[:2], [0, 1]) == (0, 1)
    # A sequence that matched pages 0, 1 inserts its whole chain: only 2 is new.
    assert cache.insert(keys, [0, 1, 2]) == (2,)
    # Another sequence computed the same prefix on pages 5, 6: it keeps them.
    assert cache.insert(keys[:2], [5, 6]) == ()
    assert not cache.is_cached(5)
    assert [cache.refcount(p) for p in (0, 1, 2)] == [1, 1, 1]


@pytest.mark.parametrize(
    ("keys_at", "pages", "message"),
    [
        ([0, 1], [2, 2], "page 2 listed twice"),
        ([0, 0], [2, 3], "listed twice"),
        ([0], [2, 3], "1 keys for 2 pages"),
        ([1, 2], [4, 0], "page 0 is already cached under another key"),
    ],
)
def test_bad_insert_raises_and_changes_nothing(
    keys_at: list[int], pages: list[int], message: str
) -> None:
    cache = PrefixCache(PAGE, SALT)
    keys = cache.keys_for(prompt(3 * PAGE))
    cache.insert(keys[:1], [0])
    with pytest.raises(PrefixCacheError, match=message):
        cache.insert([keys[i] for i in keys_at], pages)
    assert cache.num_cached == 1
    assert cache.match(prompt(3 * PAGE), record=False).pages == (0,)


@pytest.mark.parametrize(
    ("key", "page", "message"),
    [
        (b"short", 0, "16 bytes"),
        ("text", 0, "16 bytes"),
        (None, 0, "16 bytes"),
        (bytes(16), -1, "non-negative integer"),
        (bytes(16), True, "non-negative integer"),
        (bytes(16), "0", "non-negative integer"),
    ],
    ids=["short-key", "str-key", "no-key", "negative-page", "bool-page", "str-page"],
)
def test_insert_refuses_a_malformed_key_or_page(key: object, page: object, message: str) -> None:
    cache = PrefixCache(PAGE, SALT)
    good = cache.keys_for(prompt(PAGE))[0]
    with pytest.raises(PrefixCacheError, match=message):
        cache.insert([good, key], [5, page])  # type: ignore[list-item]
    assert cache.num_cached == 0


def test_a_referenced_page_is_never_evicted() -> None:
    cache = PrefixCache(PAGE, SALT)
    keys = cache.keys_for(prompt(2 * PAGE))
    cache.insert(keys, [0, 1])
    assert cache.num_evictable == 0
    with pytest.raises(PrefixCacheError, match="only 0 are unreferenced"):
        cache.evict(1)
    cache.release([0, 1])
    cache.acquire([1])  # a transfer reads page 1 again
    assert cache.evict(1) == [0]
    with pytest.raises(PrefixCacheError, match="only 0 are unreferenced"):
        cache.evict(1)
    assert cache.is_cached(1) and not cache.is_cached(0)
    assert cache.metrics().evicted_pages == 1


def test_release_queues_a_chains_tail_before_its_head() -> None:
    cache = PrefixCache(PAGE, SALT)
    a = cache.keys_for(prompt(3 * PAGE))
    b = cache.keys_for(prompt(2 * PAGE, start=900))
    cache.insert(a, [0, 1, 2])
    cache.insert(b, [3, 4])
    cache.release([3, 4])
    cache.release([0, 1, 2])
    assert cache.lru_pages() == [4, 3, 2, 1, 0]
    cache.acquire([3])  # a hit moves page 3 out; released again, it is the newest
    cache.release([3])
    assert cache.lru_pages() == [4, 2, 1, 0, 3]
    assert cache.evict(2) == [4, 2]


def test_refcounts_never_go_negative() -> None:
    cache = PrefixCache(PAGE, SALT)
    cache.insert(cache.keys_for(prompt(2 * PAGE)), [0, 1])
    cache.release([0])
    with pytest.raises(PrefixCacheError, match="page 0 holds no reference"):
        cache.release([1, 0])
    assert (cache.refcount(0), cache.refcount(1)) == (0, 1)


@pytest.mark.parametrize("call", ["acquire", "release"])
@pytest.mark.parametrize(
    ("pages", "message"), [([0, 9], "page 9 is not cached"), ([0, 0], "twice")]
)
def test_bad_acquire_or_release_raises_and_changes_nothing(
    call: str, pages: list[int], message: str
) -> None:
    cache = PrefixCache(PAGE, SALT)
    cache.insert(cache.keys_for(prompt(PAGE)), [0])
    with pytest.raises(PrefixCacheError, match=message):
        getattr(cache, call)(pages)
    assert cache.refcount(0) == 1


@pytest.mark.parametrize("n", [-1, 1.0, True, None])
def test_bad_evict_counts_are_rejected(n: object) -> None:
    with pytest.raises(PrefixCacheError, match="evict count"):
        PrefixCache(PAGE, SALT).evict(n)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [[-1] * PAGE, [2**32] * PAGE, [1.5] * PAGE, ["a"] * PAGE])
def test_bad_token_ids_are_rejected(bad: list[object]) -> None:
    with pytest.raises(PrefixCacheError, match="token ids must be integers"):
        PrefixCache(PAGE, SALT).keys_for(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("page_size", "salt"), [(0, b""), (True, b""), (2.0, b""), (4, "str")])
def test_bad_settings_are_rejected(page_size: object, salt: object) -> None:
    with pytest.raises(PrefixCacheError, match="page_size|salt"):
        PrefixCache(page_size, salt)  # type: ignore[arg-type]
