"""The pod watch loop against a scripted API (no apiserver here yet).

The fake stands in for `CoreV1Api` + `watch.Watch` only at the boundary: pods
are plain API-JSON dicts, and the loop's list → watch → relist cycle, its
error backoff and its hand-off to the event loop are the real code.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from pdcluster.runtime.router.discovery import KubernetesDiscoverySettings
from pdcluster.runtime.router.kube_watch import KubernetesDiscovery
from pdcluster.runtime.router.workers import WorkerTarget

from .harness import LoopThread, wait_until
from .test_discovery import pod


class ScriptedApi:
    """Each list returns the next scripted pod list; `None` raises an API error."""

    def __init__(self, lists: list[list[dict[str, Any]] | None]) -> None:
        self.lists = lists
        self.calls: list[dict[str, Any]] = []
        self.api_client = SimpleNamespace(sanitize_for_serialization=lambda obj: obj)

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> Any:
        self.calls.append({"namespace": namespace, **kwargs})
        items = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
        if items is None:
            raise RuntimeError("apiserver unavailable")
        rv = str(len(self.calls))
        return SimpleNamespace(items=items, metadata=SimpleNamespace(resource_version=rv))


class ScriptedWatch:
    """Streams events put on a shared queue; a `None` ends the stream (timeout)."""

    def __init__(self, events: queue.Queue[dict[str, Any] | None]) -> None:
        self.events = events
        self.stopped = threading.Event()
        self.kwargs: dict[str, Any] = {}

    def stream(self, func: Any, namespace: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        self.kwargs = kwargs
        while not self.stopped.is_set():
            try:
                event = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if event is None:
                return
            yield event

    def stop(self) -> None:
        self.stopped.set()


def test_list_watch_relist_keeps_the_published_workers_current(loop: LoopThread) -> None:
    settings = KubernetesDiscoverySettings(namespace="ns", label_selector="app=demo")
    prefill = pod("p0", ip="10.0.0.1")
    decode = pod("d0", role="decode", ip="10.0.0.2")
    api = ScriptedApi([[prefill], [decode]])
    events: queue.Queue[dict[str, Any] | None] = queue.Queue()
    watches: list[ScriptedWatch] = []

    def new_watch() -> ScriptedWatch:
        watches.append(ScriptedWatch(events))
        return watches[-1]

    published: list[list[WorkerTarget]] = []
    discovery = KubernetesDiscovery(
        settings, published.append, loop.loop, api=api, new_watch=new_watch
    )
    discovery.start()
    try:
        wait_until(lambda: len(published) == 1)
        assert [t.url for t in published[0]] == ["http://10.0.0.1:8000"]
        events.put({"type": "ADDED", "object": decode})
        wait_until(lambda: len(published) == 2)
        assert sorted(t.url for t in published[1]) == [
            "http://10.0.0.1:8000",
            "http://10.0.0.2:8000",
        ]
        # A pod turning NotReady leaves at once.
        events.put({"type": "MODIFIED", "object": pod("p0", ip="10.0.0.1", ready="False")})
        wait_until(lambda: len(published) == 3)
        assert [t.url for t in published[2]] == ["http://10.0.0.2:8000"]
        # The watch ends (server timeout): a fresh list replaces the cache.
        events.put(None)
        wait_until(lambda: len(api.calls) == 2)
        wait_until(lambda: len(watches) == 2)
        assert watches[1].kwargs["resource_version"] == "2"
        assert all(call == {"namespace": "ns", "label_selector": "app=demo"} for call in api.calls)
        # An ERROR event (e.g. 410 Gone) relists too.
        events.put({"type": "ERROR", "object": {"code": 410}})
        wait_until(lambda: len(api.calls) == 3)
    finally:
        discovery.stop()
        discovery.join(5)


def test_api_errors_back_off_and_retry(loop: LoopThread) -> None:
    settings = KubernetesDiscoverySettings(namespace="ns")
    api = ScriptedApi([None, [pod("p0")]])
    events: queue.Queue[dict[str, Any] | None] = queue.Queue()
    published: list[list[WorkerTarget]] = []
    discovery = KubernetesDiscovery(
        settings, published.append, loop.loop, api=api, new_watch=lambda: ScriptedWatch(events)
    )
    discovery.start()
    try:
        wait_until(lambda: len(published) == 1, timeout=5)
        assert len(api.calls) == 2  # the failed list, then the retry after the backoff
    finally:
        discovery.stop()
        discovery.join(5)
