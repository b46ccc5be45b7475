"""A steady completion load for the scale-up-and-back-down tests, in local mode
(`tests/local/test_autoscale_up.py`) and on Kubernetes (`e2e/test_operator.py`):
while the block runs, each thread posts one request after another, and every
failure is kept for the test to assert there was none."""

from __future__ import annotations

import threading
from typing import Any

import httpx


class CompletionLoad:
    """`body` posted to `url` back to back from `num_threads` threads until the block exits.

    `done` counts answered requests and `failures` names each one that raised or
    came back other than 200; `timeout_s` bounds one request, and the exit waits
    that long (plus a margin) for an in-flight request to finish.
    """

    def __init__(
        self, url: str, body: dict[str, Any], *, num_threads: int, timeout_s: float
    ) -> None:
        self.url = url
        self.body = body
        self.timeout_s = timeout_s
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(num_threads)]

    def _run(self) -> None:
        with httpx.Client(trust_env=False, timeout=self.timeout_s) as http:
            while not self.stop.is_set():
                try:
                    resp = http.post(self.url, json=self.body)
                except httpx.HTTPError as err:
                    self.failures.append(f"{type(err).__name__}: {err}")
                    continue
                if resp.status_code != 200:
                    self.failures.append(f"{resp.status_code}: {resp.text[:300]}")
                self.done += 1

    def __enter__(self) -> CompletionLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=self.timeout_s + 30)
