"""vLLM's block hashes as our page keys (runtime/router/vllm_block_keys.py):
which blocks are keyed, what their keys are, and that the key set never
claims a block the worker no longer holds."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.prefix_keys import chain_page_keys, root_key
from pdcluster.runtime.router.vllm_block_keys import BlockKeyMap, KeyChange
from pdcluster.runtime.vllm.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

ROOT = root_key(b"test")
PAGE = 4


def stored(
    hashes: Sequence[BlockHash],
    tokens: Sequence[int],
    parent: BlockHash | None = None,
    *,
    block_size: int = PAGE,
    extra: Sequence[bool] | None = None,
    lora: str | None = None,
    medium: str | None = "GPU",
    group: int | None = 0,
) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes),
        parent=parent,
        token_ids=tuple(tokens),
        block_size=block_size,
        has_extra_keys=tuple(extra) if extra is not None else (False,) * len(hashes),
        lora=lora,
        medium=medium,
        group=group,
    )


def removed(*hashes: BlockHash, medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(tuple(hashes), medium, 0)


PROMPT = list(range(100, 112))  # three pages
KEYS = chain_page_keys(PROMPT, PAGE, ROOT)


def test_a_stored_chain_gets_the_keys_the_router_computes_for_the_prompt() -> None:
    blocks = BlockKeyMap(ROOT, PAGE)
    changes = blocks.apply([stored([1, 2], PROMPT[:8]), stored([3], PROMPT[8:], parent=2)])
    assert changes == [KeyChange(True, tuple(KEYS))]
    assert blocks.keys == frozenset(KEYS)
    assert [blocks.key_of(h) for h in (1, 2, 3)] == KEYS


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (stored([9], PROMPT[8:], parent=77), "unknown_parent"),
        (stored([9], PROMPT[:4], medium="CPU"), "other_tier"),
        (stored([9], PROMPT[:4], group=1), "other_tier"),
        (stored([9], PROMPT[:4], lora="adapter"), "lora"),
        (stored([9], PROMPT[:2], block_size=2), "other_block_size"),
        (stored([9], PROMPT[:4], extra=[True]), "extra_keys"),
    ],
)
def test_a_block_the_router_cannot_key_is_left_out_and_counted(
    event: BlockStored, reason: str
) -> None:
    blocks = BlockKeyMap(ROOT, PAGE)
    assert blocks.apply([event]) == []
    assert blocks.keys == frozenset() and blocks.key_of(9) is None
    assert blocks.skipped == {reason: 1}


def test_blocks_after_an_unkeyed_one_in_the_same_event_stay_unkeyed() -> None:
    blocks = BlockKeyMap(ROOT, PAGE)
    blocks.apply([stored([1, 2, 3], PROMPT, extra=[False, True, False])])
    assert blocks.keys == {KEYS[0]}
    assert blocks.skipped == {"extra_keys": 2}
    # And a later block chained to one of them has no known parent.
    blocks.apply([stored([4], [1, 2, 3, 4], parent=3)])
    assert blocks.skipped["unknown_parent"] == 1


def test_a_removed_block_leaves_and_other_tiers_removals_change_nothing() -> None:
    blocks = BlockKeyMap(ROOT, PAGE)
    blocks.apply([stored([1, 2, 3], PROMPT)])
    assert blocks.apply([removed(2, medium="CPU")]) == []
    assert blocks.apply([removed(2, 99)]) == [KeyChange(False, (KEYS[1],))]
    # Block 3 is still held (vLLM removes what it evicts, children first or not).
    assert blocks.keys == {KEYS[0], KEYS[2]}


def test_twin_blocks_keep_their_key_until_both_are_gone() -> None:
    blocks = BlockKeyMap(ROOT, PAGE)
    blocks.apply([stored([1], PROMPT[:4]), stored([5], PROMPT[:4])])
    assert blocks.keys == {KEYS[0]} and len(blocks) == 2
    assert blocks.apply([removed(1)]) == []
    assert blocks.apply([removed(5)]) == [KeyChange(False, (KEYS[0],))]


def test_a_hash_stored_again_over_other_tokens_follows_the_newest() -> None:
    blocks = BlockKeyMap(ROOT, PAGE)
    blocks.apply([stored([1], PROMPT[:4])])
    other = chain_page_keys([7, 7, 7, 7], PAGE, ROOT)[0]
    assert blocks.apply([stored([1], [7, 7, 7, 7])]) == [
        KeyChange(False, (KEYS[0],)),
        KeyChange(True, (other,)),
    ]
    # The same tokens again only refresh it.
    assert blocks.apply([stored([1], [7, 7, 7, 7])]) == []


def test_all_blocks_cleared_empties_the_set() -> None:
    blocks = BlockKeyMap(ROOT, PAGE)
    blocks.apply([stored([1, 2, 3], PROMPT)])
    assert blocks.apply([AllBlocksCleared()]) == [KeyChange(False, tuple(KEYS))]
    assert blocks.keys == frozenset() and len(blocks) == 0


def test_past_its_bound_the_oldest_stored_blocks_are_forgotten_and_counted() -> None:
    blocks = BlockKeyMap(ROOT, PAGE, max_blocks=2)
    blocks.apply([stored([1, 2], PROMPT[:8])])
    blocks.apply([stored([1], PROMPT[:4])])  # refreshed: now the newest
    changes = blocks.apply([stored([3], PROMPT[8:], parent=2)])
    assert changes == [KeyChange(True, (KEYS[2],)), KeyChange(False, (KEYS[1],))]
    assert blocks.keys == {KEYS[0], KEYS[2]} and blocks.skipped == {"over_bound": 1}
    with pytest.raises(ValueError, match="max_blocks"):
        BlockKeyMap(ROOT, PAGE, max_blocks=0)


# ---- any sequence of events -------------------------------------------------

_hash = st.integers(0, 7)
_tokens = st.lists(st.integers(0, 3), min_size=PAGE, max_size=PAGE)


@st.composite
def _stored_events(draw: st.DrawFn) -> BlockStored:
    n = draw(st.integers(1, 3))
    hashes = draw(st.lists(_hash, min_size=n, max_size=n))
    tokens = [t for _ in range(n) for t in draw(_tokens)]
    parent = draw(st.none() | _hash)
    return stored(
        hashes,
        tokens,
        parent,
        extra=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        medium=draw(st.sampled_from(["GPU", None, "CPU"])),
    )


_events = st.lists(
    st.lists(
        st.one_of(
            _stored_events(),
            st.lists(_hash, min_size=1, max_size=3).map(lambda hs: removed(*hs)),
            st.just(AllBlocksCleared()),
        ),
        max_size=4,
    ),
    max_size=12,
)


@settings(max_examples=300)
@given(_events, st.integers(1, 10))
def test_the_changes_rebuild_the_key_set_and_every_key_is_a_held_block(
    batches: list[list[KVEvent]], max_blocks: int
) -> None:
    blocks = BlockKeyMap(ROOT, PAGE, max_blocks=max_blocks)
    rebuilt: set[bytes] = set()
    held: set[BlockHash] = set()  # the worker's own view of its GPU tier
    for batch in batches:
        for change in blocks.apply(batch):
            for key in change.keys:
                assert (key not in rebuilt) == change.stored, "a change that changes nothing"
                (rebuilt.add if change.stored else rebuilt.discard)(key)
        for event in batch:
            if isinstance(event, BlockStored) and event.medium in (None, "GPU"):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.medium in (None, "GPU"):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
        assert rebuilt == blocks.keys
        assert len(blocks) <= max_blocks
        # Never more than the worker holds: every keyed hash is one it still has.
        assert {h for h in range(8) if blocks.key_of(h) is not None} <= held
