"""Which in-flight requests still depend on which prefill worker.

With vLLM's pull connectors a request depends on its prefill until the
decode has read the prompt's KV, which the router sees as the decode's
first streamed event (or its whole answer when not streamed). A relay
watches its prefill for that long; when the router learns the prefill is
lost (a probe, its supervisor, discovery, a refused connection) `lost`
tells every watcher at once, so none waits for vLLM's own timeouts.

Invariants: a watcher is told at most once per watch; a watch taken after
`lost` is a new watch (a restarted worker may come back under the same
object); `lost` returns how many it told.

Pure module: watchers are plain callables, run synchronously.
"""

from __future__ import annotations

from collections.abc import Callable

from pdcluster.runtime.router.workers import Worker

LostCallback = Callable[[Worker, str], None]


class PrefillWatch:
    def __init__(self) -> None:
        self._watchers: dict[Worker, set[LostCallback]] = {}

    def watch(self, worker: Worker, callback: LostCallback) -> None:
        self._watchers.setdefault(worker, set()).add(callback)

    def unwatch(self, worker: Worker, callback: LostCallback) -> None:
        watchers = self._watchers.get(worker)
        if watchers is None:
            return
        watchers.discard(callback)
        if not watchers:
            del self._watchers[worker]

    def watching(self, worker: Worker) -> int:
        return len(self._watchers.get(worker, ()))

    def lost(self, worker: Worker, reason: str) -> int:
        """Tell every request that depends on `worker` that it is lost; how many."""
        watchers = self._watchers.pop(worker, set())
        for callback in watchers:
            callback(worker, reason)
        return len(watchers)
