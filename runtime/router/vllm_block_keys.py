"""One vLLM worker's cached blocks as our page keys: what its events change.

vLLM names a cached block by its own hash (`kv_events.BlockStored`), which
the router cannot compute (vLLM's seed, hash function and extra keys). A
stored block also carries its token ids and its parent block's hash, so its
key in our scheme (`prefix_keys.page_key`: the parent's key, then the
page's tokens, from `root_key(salt)`) follows from the key of its parent.
`BlockKeyMap` keeps vLLM's hash → our key for the blocks the worker holds,
and `apply` turns a batch of vLLM events into the changes of the key set
(`KeyChange`), which `vllm_event_stream.py` numbers into the events a
`prefix_events.KeyReplica` folds.

Rules (each keeps the key set a subset of what the worker really holds, so
the router may miss a cached prefix but never claims one that is gone):
- a key is in the set while some hash maps to it; the last event about a
  hash wins: stored → held, removed → not held (vLLM does not deduplicate
  blocks, so a hash removed may still be held by a twin block: a miss);
- a block is keyed only if it is plain: in the cache the router routes by
  (`medium` GPU or unset, KV cache group 0 or unset), no LoRA, no extra
  hash keys, of the router's page size; its parent is the root or a block
  the map holds. A block that is not keyed leaves every block after it in
  the same event unkeyed too (their chain goes through it);
- a hash stored again refreshes its place; removed or unknown hashes change
  nothing but what they name; `AllBlocksCleared` empties the set;
- at most `max_blocks` hashes are kept: beyond it the oldest stored are
  forgotten (their keys leave the set) and counted.

Pure module: no I/O.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pdcluster.runtime.prefix_keys import PageKey, PageKeyError, page_key
from pdcluster.runtime.vllm.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

__all__ = ["DEFAULT_MAX_BLOCKS", "PRIMARY_MEDIA", "BlockKeyMap", "KeyChange"]

# A 80 GiB GPU holds ~10^5 blocks of a 7B model; a copy bounded at 2^18 blocks
# costs the router ~50 MiB per worker at most.
DEFAULT_MAX_BLOCKS = 1 << 18
# The tier the scheduler's prefix cache lives in (vLLM's MEDIUM_GPU; its CPU
# build reports the same). Offloaded tiers (CPU, STORAGE) are not followed.
PRIMARY_MEDIA = frozenset({None, "GPU"})
_PRIMARY_GROUPS = frozenset({None, 0})


@dataclass(frozen=True, slots=True)
class KeyChange:
    stored: bool  # True: the keys entered the set; False: they left it
    keys: tuple[PageKey, ...]


class _Changes:
    """Key changes in order, consecutive ones of a kind merged into one."""

    def __init__(self) -> None:
        self.items: list[KeyChange] = []

    def add(self, stored: bool, key: PageKey) -> None:
        if self.items and self.items[-1].stored == stored:
            last = self.items[-1]
            self.items[-1] = KeyChange(stored, (*last.keys, key))
        else:
            self.items.append(KeyChange(stored, (key,)))


class BlockKeyMap:
    def __init__(self, root: PageKey, page_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.root = root
        self.page_size = page_size
        self.max_blocks = max_blocks
        # vLLM hash → our key, oldest stored first.
        self._blocks: OrderedDict[BlockHash, PageKey] = OrderedDict()
        self._holders: Counter[PageKey] = Counter()  # hashes per key
        # Blocks not keyed or forgotten, by why (the caller exports them).
        self.skipped: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def keys(self) -> frozenset[PageKey]:
        return frozenset(self._holders)

    def key_of(self, block_hash: BlockHash) -> PageKey | None:
        return self._blocks.get(block_hash)

    def apply(self, events: Iterable[KVEvent]) -> list[KeyChange]:
        """Fold one batch in; the key set's changes, in order."""
        changes = _Changes()
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event, changes)
                self._bound(changes)
            elif isinstance(event, BlockRemoved):
                if event.medium in PRIMARY_MEDIA and event.group in _PRIMARY_GROUPS:
                    for block_hash in event.block_hashes:
                        self._forget(block_hash, changes)
            elif isinstance(event, AllBlocksCleared):
                for block_hash in list(self._blocks):
                    self._forget(block_hash, changes)
        return changes.items

    def _stored(self, event: BlockStored, changes: _Changes) -> None:
        if event.medium not in PRIMARY_MEDIA or event.group not in _PRIMARY_GROUPS:
            self.skipped["other_tier"] += len(event.block_hashes)
            return
        if event.lora is not None:
            self.skipped["lora"] += len(event.block_hashes)
            return
        if event.block_size != self.page_size:
            self.skipped["other_block_size"] += len(event.block_hashes)
            return
        parent = self.root if event.parent is None else self._blocks.get(event.parent)
        if parent is None:
            self.skipped["unknown_parent"] += len(event.block_hashes)
            return
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            if event.has_extra_keys[i]:
                self.skipped["extra_keys"] += len(event.block_hashes) - i
                return
            try:
                key = page_key(parent, event.token_ids[i * size : (i + 1) * size])
            except PageKeyError:  # the wire decoder checks token ids; kept for safety
                self.skipped["bad_tokens"] += len(event.block_hashes) - i
                return
            self._hold(block_hash, key, changes)
            parent = key

    def _bound(self, changes: _Changes) -> None:
        while len(self._blocks) > self.max_blocks:
            oldest = next(iter(self._blocks))
            self._forget(oldest, changes)
            self.skipped["over_bound"] += 1

    def _hold(self, block_hash: BlockHash, key: PageKey, changes: _Changes) -> None:
        known = self._blocks.get(block_hash)
        if known == key:
            self._blocks.move_to_end(block_hash)
            return
        if known is not None:  # the same hash over other tokens: trust the newest
            self._forget(block_hash, changes)
        self._blocks[block_hash] = key
        self._holders[key] += 1
        if self._holders[key] == 1:
            changes.add(True, key)

    def _forget(self, block_hash: BlockHash, changes: _Changes) -> None:
        key = self._blocks.pop(block_hash, None)
        if key is None:
            return
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            changes.add(False, key)
