"""The router's prefix index: for each worker, an exact copy of the page keys
it has cached, and how many of a prompt's leading pages each worker holds.

Each worker's copy is a `prefix_events.KeyReplica`, built from the worker's
snapshot and kept current by its events (`prefix_feed.py` does the I/O).
A worker with no replica (not followed yet, its feed broken, or it left the
pool) counts as holding nothing, so it is chosen only by load.

Keys are computed once per distinct (salt, page size) among the candidates,
with the scheme the engine uses (`prefix_keys.chain_page_keys`), and never
past the longest prefix a worker of that group could hold: a worker holding
N keys has at most N leading pages of any prompt, so hashing stops at the
most keys any replica of the group holds (`key_plan`), whatever the prompt's
length. The router hashes ahead, off its event loop (`keyed`, with a plan
read on the loop), so a huge prompt never holds the other requests; the
lookups that remain on the loop are set probes, at most one per held page.
A prompt the router tokenized from text is matched only against workers
whose tokenizer fingerprint equals the router's: another tokenizer would
give other ids.

Per worker URL, not per role: prefill, colocated and decode workers (a
decode keeps the prompt pages it received, `pd/prefix_reuse.py`) are
indexed the same way, each with its own salt.

Pure module: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from pdcluster.runtime.prefix_events import Apply, EventBatch, KeyReplica, Snapshot
from pdcluster.runtime.prefix_keys import PageKey, PageKeyError, chain_page_keys

__all__ = ["KeyGroup", "PrefixIndex", "PromptTokens"]

# The workers whose keys are computed alike: (root key, page size).
KeyGroup = tuple[bytes, int]


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A request's prompt as the workers will see it."""

    ids: tuple[int, ...]
    # Fingerprint of the tokenizer that made ``ids`` from text; None: the
    # client sent token ids, which every worker reads the same.
    tokenizer: str | None = None
    # Its page keys per key group, hashed ahead (`PrefixIndex.keyed`); a
    # group missing here is hashed when looked up.
    keys: Mapping[KeyGroup, tuple[PageKey, ...]] = field(default_factory=dict, compare=False)


class PrefixIndex:
    def __init__(self) -> None:
        self._replicas: dict[str, KeyReplica] = {}

    def __contains__(self, url: object) -> bool:
        return url in self._replicas

    def replica(self, url: str) -> KeyReplica | None:
        return self._replicas.get(url)

    def reset(self, url: str, snapshot: Snapshot) -> None:
        """Start (or restart) following ``url`` from its snapshot."""
        self._replicas[url] = KeyReplica(snapshot)

    def apply(self, url: str, batch: EventBatch) -> Apply:
        """Fold events into ``url``'s replica; anything but `Apply.applied`
        drops the replica (the caller takes a new snapshot)."""
        replica = self._replicas.get(url)
        if replica is None:
            return Apply.gap
        result = replica.apply(batch)
        if result is not Apply.applied:
            del self._replicas[url]
        return result

    def forget(self, url: str) -> None:
        self._replicas.pop(url, None)

    def key_plan(self) -> dict[KeyGroup, int]:
        """Per key group, the most keys one of its replicas holds: no prompt page
        past that many can be a hit in the group (cheap; read it on the loop)."""
        plan: dict[KeyGroup, int] = {}
        for replica in self._replicas.values():
            group = (replica.root, replica.page_size)
            plan[group] = max(plan.get(group, 0), len(replica.keys))
        return plan

    def keyed(
        self, prompt: PromptTokens, plan: Mapping[KeyGroup, int] | None = None
    ) -> PromptTokens:
        """``prompt`` with its page keys for every group of ``plan`` (default: now).

        Touches no replica when given a plan, so it may run off the loop.
        """
        groups = self.key_plan() if plan is None else plan
        keys = {
            group: _bounded_chain(prompt.ids, group, max_pages)
            for group, max_pages in groups.items()
        }
        return replace(prompt, keys=keys)

    def cached_pages(self, urls: Iterable[str], prompt: PromptTokens) -> dict[str, int]:
        """Leading full pages of ``prompt`` that each worker holds (0 when unknown).

        The last prompt token is left out, as the engine does: it always
        computes at least one token, so a page ending on it is never a hit.
        """
        chains: dict[KeyGroup, tuple[PageKey, ...]] = dict(prompt.keys)
        plan: dict[KeyGroup, int] | None = None
        out: dict[str, int] = {}
        for url in urls:
            replica = self._replicas.get(url)
            if replica is None or (
                prompt.tokenizer is not None and prompt.tokenizer != replica.tokenizer
            ):
                out[url] = 0
                continue
            group = (replica.root, replica.page_size)
            if group not in chains:
                plan = self.key_plan() if plan is None else plan
                chains[group] = _bounded_chain(prompt.ids, group, plan.get(group, 0))
            out[url] = replica.num_cached_pages(chains[group])
        return out


def _bounded_chain(ids: tuple[int, ...], group: KeyGroup, max_pages: int) -> tuple[PageKey, ...]:
    """Keys of the first ``max_pages`` full pages of ``ids`` less its last token."""
    root, page_size = group
    try:
        head = ids[: min(len(ids) - 1, max_pages * page_size)] if ids else ()
        return tuple(chain_page_keys(head, page_size, PageKey(root)))
    except PageKeyError:
        return ()  # ids the workers will refuse anyway
