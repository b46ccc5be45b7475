"""Kubernetes pod watch feeding the worker pool (the thin I/O half of discovery).

The synchronous `kubernetes` client runs in one daemon thread: list pods,
publish, then watch from the list's resourceVersion until the server ends the
watch (every `relist_interval_s`), then list again. Any API error waits a
short backoff and relists, so a dropped watch or an expired resourceVersion
(410 Gone) heals itself. Targets reach the event loop through
`call_soon_threadsafe`, so the pool is only touched from the loop.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from pdcluster.runtime.router.discovery import (
    KubernetesDiscoverySettings,
    PodCache,
    targets_from_pods,
)
from pdcluster.runtime.router.workers import WorkerTarget

log = logging.getLogger(__name__)

ERROR_BACKOFF_S = 1.0


def _kube(name: str) -> Any:
    # The client's config helpers are untyped; keep them behind Any here.
    return importlib.import_module(f"kubernetes.{name}")


def _load_api(settings: KubernetesDiscoverySettings) -> Any:
    client, config = _kube("client"), _kube("config")
    if settings.kubeconfig:
        config.load_kube_config(config_file=settings.kubeconfig)
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    return client.CoreV1Api()


@dataclass(eq=False)
class KubernetesDiscovery:
    settings: KubernetesDiscoverySettings
    publish: Callable[[list[WorkerTarget]], None]
    loop: asyncio.AbstractEventLoop
    _: KW_ONLY
    # A CoreV1Api and a Watch factory; None: the real client's.
    api: Any = None
    new_watch: Callable[[], Any] | None = None
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _watch: Any = field(default=None, init=False, repr=False)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="router-kube-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.stop()

    def _emit(self, cache: PodCache) -> None:
        targets = targets_from_pods(cache.pods(), self.settings)
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.publish, targets)

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        new_watch = self.new_watch or _kube("watch").Watch
        cache = PodCache()
        api = self.api
        while not self._stop.is_set():
            try:
                if api is None:
                    api = _load_api(self.settings)
                listed = api.list_namespaced_pod(
                    self.settings.namespace, label_selector=self.settings.label_selector
                )
                serialize = api.api_client.sanitize_for_serialization
                cache.replace(serialize(p) for p in listed.items)
                self._emit(cache)
                self._watch = new_watch()
                for event in self._watch.stream(
                    api.list_namespaced_pod,
                    self.settings.namespace,
                    label_selector=self.settings.label_selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=max(1, int(self.settings.relist_interval_s)),
                ):
                    if self._stop.is_set():
                        break
                    kind = str(event.get("type", ""))
                    if kind == "ERROR":
                        break
                    if cache.apply(kind, serialize(event["object"])):
                        self._emit(cache)
            except Exception as err:  # any API failure means "relist later"
                log.warning("kubernetes discovery: %s; relisting in %.1fs", err, ERROR_BACKOFF_S)
                self._stop.wait(ERROR_BACKOFF_S)
