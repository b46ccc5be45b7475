"""Scenario 10: hundreds of requests through the router while clients and peers vanish.

600 short requests go through the router of the shared two-by-two cluster,
24 at a time. A fifth of the clients walk away (a stream closed after its
first event, or a request abandoned after a few milliseconds). Meanwhile
prefill-1 is killed with SIGKILL and restarted, and decode-1 is hung with
SIGSTOP, resumed, then killed and restarted.

docs/design.md §14 must hold for the whole run: every answer that says 200 equals
the colocated output, every other answer is a readable error, nothing
outlives the router's deadline, every refusal is counted by the router, and
once the dust settles every worker holds all its pages and no room.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.faults.harness import FaultCluster, make_prompts, parse_counter, wait_until
from tests.pd_integration.reference import colocated_outputs

NUM_REQUESTS = 600
CONCURRENCY = 24
MAX_TOKENS = 6


@dataclass
class Outcome:
    index: int
    mode: str  # "whole" | "stream_left" | "gave_up"
    status: int | None
    output: list[int] | None
    error: str | None
    elapsed: float


def one_request(endpoint: str, index: int, prompt: list[int], mode: str, wait: float) -> Outcome:
    body: dict[str, Any] = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
    }
    t0 = time.monotonic()
    try:
        if mode == "gave_up":
            try:
                with httpx.Client(timeout=httpx.Timeout(5.0, read=wait)) as h:
                    resp = h.post(endpoint + "/generate", json=body)
                return Outcome(index, mode, resp.status_code, None, None, time.monotonic() - t0)
            except httpx.ReadTimeout:
                return Outcome(index, mode, None, None, None, time.monotonic() - t0)
        if mode == "stream_left":
            body["stream"] = True
            with httpx.Client(timeout=45) as h:
                with h.stream("POST", endpoint + "/generate", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data:"):
                            break  # the client leaves after its first event
                    return Outcome(index, mode, resp.status_code, None, None, time.monotonic() - t0)
        resp = httpx.post(endpoint + "/generate", json=body, timeout=45)
    except httpx.HTTPError as err:
        return Outcome(index, mode, None, None, f"client transport: {err!r}", time.monotonic() - t0)
    elapsed = time.monotonic() - t0
    data = resp.json()
    if resp.status_code == 200:
        return Outcome(index, mode, 200, data["output_ids"], None, elapsed)
    message = data.get("error", {}).get("message") if isinstance(data, dict) else None
    return Outcome(index, mode, resp.status_code, None, message, elapsed)


class Chaos:
    """Kills, hangs and restarts victims as the run crosses request-count marks."""

    def __init__(self, cluster: FaultCluster) -> None:
        self.cluster = cluster
        self.done = 0
        self.lock = threading.Lock()
        self.log: list[str] = []
        self.plan = [
            (0.10, lambda: cluster.kill("prefill-1"), "kill -9 prefill-1"),
            (0.30, lambda: cluster.restart("prefill-1", wait=False), "restart prefill-1"),
            (0.40, lambda: cluster.hang("decode-1"), "SIGSTOP decode-1"),
            (0.47, lambda: cluster.cont("decode-1"), "SIGCONT decode-1"),
            (0.55, lambda: cluster.kill("decode-1"), "kill -9 decode-1"),
            (0.70, lambda: cluster.restart("decode-1", wait=False), "restart decode-1"),
        ]

    def tick(self) -> None:
        with self.lock:
            self.done += 1
            progress = self.done / NUM_REQUESTS
            while self.plan and progress >= self.plan[0][0]:
                _, act, what = self.plan.pop(0)
                act()
                self.log.append(f"{self.done}: {what}")


def router_counts(endpoint: str) -> Counter[str]:
    text = httpx.get(endpoint + "/metrics", timeout=5).text
    return Counter(parse_counter(text, "pdcluster_router_requests", "code"))


@pytest.mark.slow
def test_many_requests_with_disconnects_and_peer_kills(pd: FaultCluster) -> None:
    rng = random.Random(2024)
    pool = make_prompts(40, seed=141, lo=1, hi=48)
    expected = colocated_outputs(pd.manifest, pool, MAX_TOKENS)
    picks = [rng.randrange(len(pool)) for _ in range(NUM_REQUESTS)]
    modes = rng.choices(["whole", "stream_left", "gave_up"], weights=[80, 10, 10], k=NUM_REQUESTS)
    waits = [rng.uniform(0.005, 0.15) for _ in range(NUM_REQUESTS)]
    deadline = pd.manifest.spec.router.request_timeout_seconds
    counts_before = router_counts(pd.endpoint)
    chaos = Chaos(pd)

    def run(i: int) -> Outcome:
        try:
            return one_request(pd.endpoint, i, pool[picks[i]], modes[i], waits[i])
        finally:
            chaos.tick()

    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as ex:
        outcomes = list(ex.map(run, range(NUM_REQUESTS)))
    took = time.monotonic() - started
    assert len(chaos.log) == 6, chaos.log

    whole = [o for o in outcomes if o.mode == "whole"]
    ok = [o for o in whole if o.status == 200]
    failed = [o for o in whole if o.status != 200]
    assert len(outcomes) >= 500
    for o in ok:
        assert o.output == expected[picks[o.index]], f"request {o.index}: output != colocated"
    for o in failed:
        assert o.status is not None and o.status >= 400, o
        assert o.error, f"request {o.index}: error without a message ({o.status})"
    for o in outcomes:
        assert o.elapsed <= deadline + 2, f"request {o.index} took {o.elapsed:.1f}s"
    # Most requests are served: the faults cost only the requests they touched.
    assert len(ok) >= 0.6 * len(whole), (len(ok), len(whole), Counter(o.error for o in failed))

    # Every answer the clients saw is in the router's own count, by status code.
    counts = router_counts(pd.endpoint) - counts_before
    seen = Counter(str(o.status) for o in whole)
    for code, n in seen.items():
        assert counts[code] >= n, (code, n, counts)

    # The victims come back and every worker returns to its initial state.
    for name in ("prefill-1", "decode-1"):
        pd.wait_healthy(name)
    pd.assert_clean(timeout=20)
    wait_until(lambda: pd.is_clean("decode-0"), 5)
    print(
        f"chaos: {len(outcomes)} requests in {took:.1f}s; {len(ok)} ok, "
        f"{Counter(o.status for o in failed)} failed; {chaos.log}"
    )
