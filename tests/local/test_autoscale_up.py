"""`pdcluster up` runs the operator's planner: a load step scales prefill 1 -> 2,
the load gone brings it back to 1 through a drain, and no request fails."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdcluster.runtime.autoscale.samples import parse_worker_metrics
from tests.autoscaling_spec import PREFILL_AUTOSCALING
from tests.local.cluster import local_cluster, ps_rows, write_manifest
from tests.request_load import CompletionLoad

SPEC: dict[str, Any] = {
    "model": {"name": "tiny"},
    "kvCache": {"pageSize": 16, "numPages": 512},
    "prefill": {"replicas": 1, "autoscaling": PREFILL_AUTOSCALING},
    "decode": {"replicas": 1},
    "router": {"healthCheckIntervalSeconds": 0.5},
}


LOAD_BODY: dict[str, Any] = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4}


def wait_for(cond: Any, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def first_tokens(url: str) -> float:
    """Requests a worker has seen to their first token (its own /metrics)."""
    ttft = parse_worker_metrics(httpx.get(url + "/metrics", timeout=10).text).ttft
    return 0 if ttft is None else ttft.count


def prefill_rows(state_dir: Path) -> dict[str, str]:
    return {n: r["STATE"] for n, r in ps_rows(state_dir).items() if n.startswith("prefill")}


@pytest.mark.slow
def test_a_load_step_scales_prefill_up_and_back_down_with_no_failed_request(
    tmp_path: Path,
) -> None:
    path = write_manifest(tmp_path, "scaled", SPEC)
    state_dir = tmp_path / "state"
    with local_cluster(path, state_dir) as cluster:
        log = state_dir.parent / "up-scaled.log"
        assert prefill_rows(state_dir) == {"prefill-0": "running"}
        url = cluster.endpoint + "/v1/completions"
        with CompletionLoad(url, LOAD_BODY, num_threads=3, timeout_s=120) as load:
            wait_for(
                lambda: prefill_rows(state_dir).get("prefill-1") == "running",
                300,
                "prefill-1 started and running",
                log,
            )
            # It serves: the router sends it prompts, and the load keeps succeeding.
            url = ps_rows(state_dir)["prefill-1"]["URL"]
            wait_for(lambda: first_tokens(url) > 0, 120, "prefill-1 serving prompts", log)
        assert load.done > 0 and not load.failures, load.failures
        text = log.read_text()
        assert "Normal ScaledUp: prefill 1 -> 2: ttftP90Seconds" in text, text[-3000:]
        assert "prefill-1 is ready and serving" in text

        # Idle: the p90 reads 0, the scale-down window passes, prefill-1 is drained.
        wait_for(
            lambda: prefill_rows(state_dir) == {"prefill-0": "running"},
            300,
            "prefill back at one instance",
            log,
        )
        text = log.read_text()
        assert "Normal ScaledDown: prefill 2 -> 1" in text, text[-3000:]
        assert "prefill-1 drained in" in text
        health = httpx.get(cluster.endpoint + "/health", timeout=10).json()
        assert [w["url"] for w in health["workers"] if w["role"] == "prefill"] == [
            cluster.worker("prefill-0")["url"]
        ]
        # Greedy and past EOS: the count checks the drained cluster serves, not the sampler.
        body = {
            "model": "tiny",
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        resp = httpx.post(cluster.endpoint + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
