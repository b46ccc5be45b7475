"""`pdcluster up` supervises its instances like the operator (a real local cluster).

Two prefill instances and one decode, restart budget 1: kill -9 prefill-1
during a burst → its requests fail fast, the cluster keeps serving through
prefill-0 (outputs equal colocated), prefill-1 comes back on its ports
(`ps`: restarts 1, killed by SIGKILL); a second kill spends the budget and
ends `pdcluster up` with the reason.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdcluster.runtime.spec import TransferSpec, parse_manifest
from tests.faults.harness import make_prompts
from tests.local.cluster import RunningCluster, local_cluster, ps_rows, write_manifest
from tests.pd_integration.reference import colocated_outputs

MAX_TOKENS = 4
SPEC: dict[str, Any] = {
    "model": {"name": "tiny"},
    "kvCache": {"pageSize": 16, "numPages": 1024},
    # Decode probes its prefills every 0.5 s: a restarted prefill is seen answering soon.
    "transfer": {"heartbeat": {"intervalSeconds": 0.5}},
    "prefill": {"replicas": 2, "restart": {"backoffSeconds": 0.2, "budget": 1}},
    "decode": {"replicas": 1},
    "router": {"healthCheckIntervalSeconds": 0.5},
}


def fast_failure_bound(transfer: TransferSpec) -> float:
    """How long a request on a killed prefill may take to fail: halfway to the room
    timeouts a request that missed the loss would wait out instead.

    The loss is seen at once (the leg's connection breaks) or on the heartbeat
    verdict (`failureThreshold` probes `intervalSeconds` apart, ~1 s here): the
    bound leaves that path 10x its time on a loaded box and still fails a request
    that only a timeout ended.
    """
    hb = transfer.heartbeat
    verdict_s = hb.failure_threshold * hb.interval_seconds + hb.interval_seconds / 2
    bound = min(transfer.bootstrap_timeout_seconds, transfer.waiting_timeout_seconds) / 2
    assert bound >= 10 * verdict_s, f"a {bound:.1f}s bound cannot tell a {verdict_s:.1f}s verdict"
    return bound


def generate(cluster: RunningCluster, prompt: list[int]) -> tuple[int, dict[str, Any], float]:
    """POST /generate through the router; (status, body, monotonic end)."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
    }
    try:
        resp = httpx.post(cluster.endpoint + "/generate", json=body, timeout=60)
        data = (
            resp.json()
            if resp.headers.get("content-type", "").startswith("application/json")
            else {}
        )
        return resp.status_code, data, time.monotonic()
    except httpx.HTTPError as err:
        return 599, {"error": repr(err)}, time.monotonic()


def assert_served_like_colocated(
    pool: concurrent.futures.ThreadPoolExecutor,
    cluster: RunningCluster,
    prompts: list[list[int]],
    expected: list[list[int]],
) -> None:
    """Every prompt through the router at once: each answered 200 with its colocated output."""
    outputs = list(pool.map(lambda p: generate(cluster, p), prompts))
    assert [s for s, _, _ in outputs] == [200] * len(prompts), outputs
    assert [b["output_ids"] for _, b, _ in outputs] == expected


def seen_as(state_dir: Path, name: str = "prefill-1") -> tuple[str, int]:
    """(state, restarts) of a process in the state file `ps` reads (cheaper than `ps`)."""
    state = json.loads((state_dir / "supervised" / "state.json").read_text())
    entry = next(p for p in state["processes"] if p["name"] == name)
    return entry["state"], entry["restarts"]


def wait_for(cond: Any, timeout: float, what: str, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)


def live_rooms(cluster: RunningCluster, name: str) -> int:
    url = cluster.worker(name)["url"]
    try:
        resp = httpx.get(url + "/admin/rooms", headers=cluster.auth, timeout=2)
    except httpx.HTTPError:
        return 0
    return sum(1 for r in resp.json()["rooms"] if r["state"] not in ("Success", "Failed"))


def burst_until_live(
    pool: concurrent.futures.ThreadPoolExecutor,
    cluster: RunningCluster,
    prompts: list[list[int]],
    name: str,
) -> list[concurrent.futures.Future[tuple[int, dict[str, Any], float]]]:
    """Sends `prompts` at once through the router, again until a room is seen live on the
    worker `name` (a fast machine can finish a burst between two polls of /admin/rooms);
    the futures of every request sent."""
    burst: list[concurrent.futures.Future[tuple[int, dict[str, Any], float]]] = []
    deadline = time.monotonic() + 60
    while True:
        burst += [pool.submit(generate, cluster, p) for p in prompts]
        seen_until, seen = time.monotonic() + 5, False
        while not seen and time.monotonic() < seen_until:
            seen = live_rooms(cluster, name) > 0
        if seen:
            return burst
        assert time.monotonic() < deadline, f"no room seen live on {name}"


@pytest.mark.slow
def test_a_killed_prefill_is_restarted_and_a_spent_budget_stops_the_cluster(
    tmp_path: Path,
) -> None:
    path = write_manifest(tmp_path, "supervised", SPEC)
    manifest = parse_manifest(yaml.safe_load(path.read_text()))
    victims = make_prompts(4, seed=41, lo=2500, hi=4000)
    after = make_prompts(6, seed=42, lo=1, hi=200)
    expected = colocated_outputs(manifest, after, MAX_TOKENS)
    state_dir = tmp_path / "state"
    with (
        local_cluster(path, state_dir) as cluster,
        concurrent.futures.ThreadPoolExecutor(16) as pool,
    ):
        up_log = state_dir.parent / "up-supervised.log"
        burst = burst_until_live(pool, cluster, victims, "prefill-1")
        killed_at = time.monotonic()
        os.kill(cluster.worker("prefill-1")["pid"], signal.SIGKILL)

        # Requests on the killed prefill fail fast; the others succeed.
        results = [f.result(timeout=60) for f in burst]
        lost = [(s, b, end) for s, b, end in results if s != 200]
        assert lost, "no request was on the killed prefill"
        assert len(lost) < len(burst), "requests on prefill-0 failed too"
        bound = fast_failure_bound(manifest.spec.transfer)
        for status, body, end in lost:
            assert status in (502, 504), body
            assert "timeout" not in json.dumps(body), f"failed by a timeout, not the loss: {body}"
            assert end - killed_at < bound, f"a lost request took {end - killed_at:.1f}s to fail"

        # The supervisor saw the loss: the cluster keeps serving through prefill-0.
        wait_for(lambda: seen_as(state_dir) != ("running", 0), 5, "the loss to be seen")
        assert_served_like_colocated(pool, cluster, after, expected)

        # prefill-1 comes back on its ports and serves again.
        wait_for(lambda: seen_as(state_dir) == ("running", 1), 120, "prefill-1 back", 0.2)
        rows = ps_rows(state_dir)
        assert (rows["prefill-1"]["RESTARTS"], rows["prefill-1"]["LAST EXIT"]) == (
            "1",
            "killed by SIGKILL",
        ), rows["prefill-1"]
        assert rows["prefill-1"]["URL"] == cluster.worker("prefill-1")["url"]
        assert (rows["prefill-0"]["RESTARTS"], rows["prefill-0"]["LAST EXIT"]) == ("0", "-")
        again = list(pool.map(lambda p: generate(cluster, p), after[:2]))
        assert [b.get("output_ids") for _, b, _ in again] == expected[:2], again

        # A second loss spends the budget (1 per hour): `pdcluster up` ends and says why.
        os.kill(int(ps_rows(state_dir)["prefill-1"]["PID"]), signal.SIGKILL)
        assert cluster.proc.wait(30) == 1
        text = up_log.read_text()
        assert "prefill-1 lost (prefill-1 killed by SIGKILL)" in text
        assert "prefill restart budget is spent (1 per hour)" in text
    assert not (state_dir / "supervised" / "state.json").exists()
