"""The launcher's liveness prober: `GET /health/live` (vLLM: `/health`) of each target,
every period.

It runs on a thread of its own, so a probe that hangs until its timeout
never delays the supervision loop (which polls exits every 0.1 s). The
loop publishes what to probe (`set_targets`) and reads the results
(`drain`); what a result means is `liveness.py`'s to decide.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from dataclasses import dataclass

import httpx

from pdcluster.runtime.local.liveness import LivenessPolicy


@dataclass(frozen=True)
class ProbeTarget:
    process: str
    generation: int  # the start of the process the probe is for
    url: str  # the process's base URL
    path: str = "/health/live"  # what it answers liveness on (vLLM: /health)


@dataclass(frozen=True)
class ProbeResult:
    process: str
    generation: int
    ok: bool


class LivenessProber:
    def __init__(self, policy: LivenessPolicy) -> None:
        self.policy = policy
        self._targets: list[ProbeTarget] = []
        self._lock = threading.Lock()
        self._results: queue.SimpleQueue[ProbeResult] = queue.SimpleQueue()
        self._stopped = threading.Event()
        # trust_env=False: a proxy variable must never divert a probe.
        self._http = httpx.Client(timeout=policy.timeout_s, trust_env=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="liveness")
        self._thread = threading.Thread(target=self._run, name="liveness-prober", daemon=True)
        self._thread.start()

    def set_targets(self, targets: list[ProbeTarget]) -> None:
        with self._lock:
            self._targets = list(targets)

    def drain(self) -> list[ProbeResult]:
        out: list[ProbeResult] = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()
        self._pool.shutdown(wait=True)
        self._http.close()

    def _run(self) -> None:
        while not self._stopped.wait(self.policy.period_s):
            with self._lock:
                targets = list(self._targets)
            # Every target at once: one hung process must not hold the others' probes.
            for result in self._pool.map(self._probe, targets):
                self._results.put(result)

    def _probe(self, target: ProbeTarget) -> ProbeResult:
        try:
            ok = self._http.get(target.url + target.path).is_success
        except httpx.HTTPError:
            ok = False
        return ProbeResult(target.process, target.generation, ok)
