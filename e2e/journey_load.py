"""Load and observation for the user journeys: what a client saw, and when pods came and went.

- `burst`: N concurrent completions through the router, each outcome timed;
- `SteadyLoad`: a few clients sending requests back to back until stopped
  (a service in use while the cluster scales or rolls);
- `PodTimeline`: a watch on the cluster's pods recording, for each pod, when
  it was first seen terminating and when it was gone, on this machine's clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from e2e.cluster import ClusterInfo
from e2e.nodeagent.kubeapi import KubeApi


@dataclass(frozen=True)
class Outcome:
    status: int  # HTTP status, or 0 when the connection itself failed
    body: str
    started: float  # time.monotonic()
    ended: float
    completion_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200

    def overlaps(self, at: float) -> bool:
        return self.started <= at <= self.ended


def long_prompt(i: int, chars: int) -> str:
    """A distinct prompt of `chars` bytes (the tiny model's tokenizer: one token per byte)."""
    stem = f"request {i}: "
    return (
        stem
        + ("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[: chars - len(stem)]
    )


def complete(base_url: str, prompt: str, max_tokens: int, timeout_s: float = 120.0) -> Outcome:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    started = time.monotonic()
    try:
        resp = httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
    except httpx.HTTPError as err:
        return Outcome(0, repr(err), started, time.monotonic())
    ended = time.monotonic()
    tokens = 0
    if resp.status_code == 200:
        tokens = int(resp.json().get("usage", {}).get("completion_tokens", 0))
    return Outcome(resp.status_code, resp.text, started, ended, tokens)


class Burst:
    """`n` long requests sent at once, in the background; `result()` waits for all."""

    def __init__(self, base_url: str, n: int, prompt_chars: int, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._pool = ThreadPoolExecutor(max_workers=n)
        self._futures = [
            self._pool.submit(complete, base_url, long_prompt(i, prompt_chars), max_tokens)
            for i in range(n)
        ]

    def result(self, timeout_s: float = 180.0) -> list[Outcome]:
        try:
            return [f.result(timeout=timeout_s) for f in self._futures]
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class SteadyLoad:
    """`clients` loops sending one request after another to whatever `base_url()` says now."""

    base_url: Callable[[], str]
    clients: int = 4
    prompt_chars: int = 600
    max_tokens: int = 16
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> SteadyLoad:
        for c in range(self.clients):
            thread = threading.Thread(target=self._loop, args=(c,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _loop(self, client: int) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                url = self.base_url()
            except httpx.HTTPError:
                # The test's own lookup of the router (the Kubernetes API) failed,
                # not a request: no outcome, ask again.
                time.sleep(0.1)
                continue
            prompt = long_prompt(client * 100_000 + i, self.prompt_chars)
            self.outcomes.append(complete(url, prompt, self.max_tokens))
            i += 1

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)
        return list(self.outcomes)


@dataclass
class PodLife:
    name: str
    role: str
    uid: str
    ip: str | None = None
    terminating_at: float | None = None  # first seen with a deletionTimestamp
    gone_at: float | None = None  # DELETED seen


class PodTimeline:
    """Watches the pods of one PDCluster from a thread; times are time.monotonic()."""

    def __init__(self, info: ClusterInfo, namespace: str, cluster: str) -> None:
        self.pods: dict[str, PodLife] = {}
        self._stop = threading.Event()
        self._api = KubeApi(info.server, info.admin_token, info.ca_cert)
        self._path = f"/api/v1/namespaces/{namespace}/pods"
        self._cluster = cluster
        self._relist()  # what exists now is known before the constructor returns
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _see(self, pod: dict[str, Any], gone: bool) -> None:
        meta = pod["metadata"]
        if meta.get("labels", {}).get("pdcluster.io/cluster") != self._cluster:
            return
        life = self.pods.setdefault(
            meta["uid"],
            PodLife(meta["name"], meta.get("labels", {}).get("pdcluster.io/role", ""), meta["uid"]),
        )
        life.ip = (pod.get("status") or {}).get("podIP") or life.ip
        now = time.monotonic()
        if meta.get("deletionTimestamp") and life.terminating_at is None:
            life.terminating_at = now
        if gone and life.gone_at is None:
            life.gone_at = now
            if life.terminating_at is None:
                life.terminating_at = now

    def _relist(self) -> str:
        listed = self._api.get(self._path) or {}
        for pod in listed.get("items", []):
            self._see(pod, gone=False)
        return str((listed.get("metadata") or {}).get("resourceVersion", "0"))

    def _run(self) -> None:
        version = self._relist()
        while not self._stop.is_set():
            try:
                for kind, obj in self._api.watch(self._path, version, timeout_s=30):
                    if kind == "ERROR":  # e.g. 410 Gone: start again from a fresh list
                        version = self._relist()
                        break
                    version = obj.get("metadata", {}).get("resourceVersion", version)
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self._see(obj, gone=kind == "DELETED")
                    if self._stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - a broken watch is restarted from a fresh list
                time.sleep(0.5)
                version = self._relist()

    def replaced(
        self, since: float, roles: tuple[str, ...] = ("prefill", "decode")
    ) -> list[PodLife]:
        """Pods of `roles` that began terminating at or after `since`."""
        return [
            p
            for p in self.pods.values()
            if p.role in roles and p.terminating_at is not None and p.terminating_at >= since
        ]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(40)
        self._api.close()
