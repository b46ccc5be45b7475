"""The router's prefix index: for each worker, an exact copy of the page keys
it has cached, and how many of a prompt's leading pages each worker holds.

Each worker's copy is a `prefix_events.KeyReplica`, built from the worker's
snapshot and kept current by its events (`prefix_feed.py` does the I/O).
A worker with no replica (not followed yet, its feed broken, or it left the
pool) counts as holding nothing, so it is chosen only by load.

Keys are computed once per distinct (salt, page size) among the candidates,
with the scheme the engine uses (`prefix_keys.chain_page_keys`). A prompt the
router tokenized from text is matched only against workers whose tokenizer
fingerprint equals the router's: another tokenizer would give other ids.

Per worker URL, not per role: prefill, colocated and decode workers (a
decode keeps the prompt pages it received, `pd/prefix_reuse.py`) are
indexed the same way, each with its own salt.

Pure module: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdcluster.runtime.prefix_events import Apply, EventBatch, KeyReplica, Snapshot
from pdcluster.runtime.prefix_keys import PageKey, PageKeyError, chain_page_keys

__all__ = ["PrefixIndex", "PromptTokens"]


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A request's prompt as the workers will see it."""

    ids: tuple[int, ...]
    # Fingerprint of the tokenizer that made ``ids`` from text; None: the
    # client sent token ids, which every worker reads the same.
    tokenizer: str | None = None


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

    def cached_pages(self, urls: Iterable[str], prompt: PromptTokens) -> dict[str, int]:
        """Leading full pages of ``prompt`` that each worker holds (0 when unknown).

        The last prompt token is left out, as the engine does: it always
        computes at least one token, so a page ending on it is never a hit.
        """
        ids = prompt.ids[:-1]
        chains: dict[tuple[bytes, int], list[PageKey]] = {}
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
                try:
                    chains[group] = chain_page_keys(ids, replica.page_size, replica.root)
                except PageKeyError:
                    chains[group] = []  # ids the workers will refuse anyway
            out[url] = replica.num_cached_pages(chains[group])
        return out
