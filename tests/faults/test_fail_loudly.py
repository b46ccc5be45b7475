"""Failures that used to surface only as a timeout, now loud at once (real processes).

- a bootstrap server that starts listening late: the prefill ranks keep
  registering, /health says `unregistered` meanwhile (the router leaves the
  worker out), then the instance registers and serves every request;
- (a layout a prefill cannot write is refused at registration: on the shm
  cluster of test_policies.py, which starts one anyway);
- a hung prefill engine: /health turns 503 `engine_stalled` and a request in
  flight fails with `engine_stalled` well before any waiting timeout;
- more concurrent requests than `transfer.maxRooms`: they queue and all
  succeed; past `roomQueueLimit` the router answers 503 with Retry-After.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdcluster.runtime.pd_worker.backends import BOOTSTRAP_DELAY_ENV
from pdcluster.runtime.worker_main import HANG_ENV
from tests.faults.harness import (
    FaultCluster,
    base_spec,
    gen_body,
    make_prompts,
    post_leg,
    router_generate,
    wait_until,
)
from tests.pd_integration.reference import colocated_outputs


def _health(cluster: FaultCluster, name: str) -> tuple[int, dict[str, Any]] | None:
    try:
        resp = cluster.http.get(cluster.url(name) + "/health", timeout=2)
    except httpx.HTTPError:
        return None
    body = resp.json() if resp.status_code != 200 else {}
    return resp.status_code, body


def _router_post(cluster: FaultCluster, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True},
    }
    return httpx.post(cluster.endpoint + "/generate", json=body, timeout=30)


@pytest.fixture
def late_bootstrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultCluster]:
    # Longer than the old registration retries lasted (about 1.5 s in all).
    monkeypatch.setenv(BOOTSTRAP_DELAY_ENV, "4")
    spec = base_spec()
    spec["prefill"]["topology"]["tp"] = 2  # two ranks register: the follower too
    cluster = FaultCluster(tmp_path, "loud-late-bootstrap", spec)
    try:
        yield cluster
    finally:
        cluster.close()


def test_a_late_bootstrap_server_keeps_the_worker_not_ready_then_it_registers_and_serves(
    late_bootstrap: FaultCluster,
) -> None:
    cluster = late_bootstrap
    cluster.launcher.start()
    answer = wait_until(lambda: _health(cluster, "prefill-0"), 180, 0.1, "prefill-0 answering")
    status, body = answer
    assert status == 503, "a prefill whose ranks are not registered must not report healthy"
    assert body["reason"].startswith("unregistered: ")
    # Registration keeps going past the old give-up point; then every rank is in.
    cluster.wait_healthy("prefill-0", 60)
    cluster.launcher.wait_ready(60)
    for name in cluster.workers("decode"):
        cluster.wait_healthy(name, 60)
    assert cluster.stats("prefill-0").get("bootstrap_register_retry", 0) > 0
    prompts = make_prompts(4, seed=211, lo=8, hi=40)
    expected = colocated_outputs(cluster.manifest, prompts, 4)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: router_generate(cluster.endpoint, p, 4, 30), prompts))
    assert [r.status for r in results] == [200] * 4, [r.body for r in results]
    assert [r.output_ids for r in results] == expected
    cluster.assert_clean()


@pytest.fixture
def hung_prefill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultCluster]:
    # The prefill engine's first step blocks 30 s (a hung step or collective).
    monkeypatch.setenv(HANG_ENV, "prefill:1:30")
    spec = base_spec(waitingTimeoutSeconds=20.0, bootstrapTimeoutSeconds=20.0)
    spec["prefill"]["engine"] = {**spec["prefill"]["engine"], "stallTimeoutSeconds": 1.0}
    with FaultCluster(tmp_path, "loud-hung", spec) as cluster:
        yield cluster


def test_a_hung_prefill_engine_turns_health_503_and_fails_the_request_fast(
    hung_prefill: FaultCluster,
) -> None:
    cluster = hung_prefill
    prompt = make_prompts(1, seed=9, lo=16, hi=16)[0]
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(router_generate, cluster.endpoint, prompt, 4, 40)
        stalled = wait_until(
            lambda: (h := _health(cluster, "prefill-0")) is not None and h[0] == 503 and h,
            10,
            0.1,
            "prefill-0 to report the stall",
        )
        assert stalled[1]["reason"] == "engine_stalled"
        res = pending.result()
    elapsed = time.monotonic() - t0
    assert res.status >= 500 and "engine_stalled" in res.error, res.body
    # Failed on the stall bound (1 s), not after the 20 s waiting timeout.
    assert elapsed < 10, elapsed
    # The liveness probe reads the stall: the kubelet restarts such a pod.
    live = cluster.http.get(cluster.url("prefill-0") + "/health/live", timeout=2)
    assert live.status_code == 503 and live.json()["reason"] == "engine_stalled"
    decode = cluster.http.get(cluster.url("decode-0") + "/health/live", timeout=2)
    assert decode.status_code == 200


@pytest.fixture
def small_rooms(tmp_path: Path) -> Iterator[FaultCluster]:
    spec = base_spec(maxRooms=2, roomQueueLimit=6)
    with FaultCluster(tmp_path, "loud-queue", spec) as cluster:
        yield cluster


def test_requests_past_max_rooms_queue_and_succeed_and_only_past_the_queue_get_503(
    small_rooms: FaultCluster,
) -> None:
    cluster = small_rooms
    prompts = make_prompts(9, seed=33, lo=8, hi=30)
    expected = colocated_outputs(cluster.manifest, prompts, 4)
    # More concurrent requests than maxRooms (2): they wait their turn, none fails.
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: router_generate(cluster.endpoint, p, 4, 30), prompts[:8]))
    assert [r.status for r in results] == [200] * 8, [r.body for r in results]
    assert [r.output_ids for r in results] == expected[:8]
    cluster.assert_clean()

    # Fill every slot and the queue with prefill legs whose decode never comes
    # (they hold their rooms until the bootstrap timeout)...
    prefill = cluster.url("prefill-0")
    bootstrap = cluster.bootstrap("prefill-0")
    with ThreadPoolExecutor(8) as pool:
        orphans = [
            pool.submit(
                post_leg,
                prefill,
                gen_body(prompts[0], 4, bootstrap=bootstrap),
                30,
            )
            for _ in range(8)
        ]
        wait_until(lambda: cluster.info("prefill-0")["num_rooms"] >= 8, 10, 0.05, "8 rooms")
        # ...then one more request: past the queue bound, refused at once.
        refused = _router_post(cluster, prompts[8], 4)
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert "prefill_busy" in refused.text
        for orphan in orphans:
            assert orphan.result().status >= 500  # they end at their timeout, loudly
    # Once the rooms are gone, the same request is served.
    cluster.assert_clean()
    again = router_generate(cluster.endpoint, prompts[8], 4, 30)
    assert again.ok and again.output_ids == expected[8], again.body
