"""Multi-pod instances in local mode: each "pod" is a process group of its instance.

`examples/pd-prefill-tp2-2pods.yaml` (prefill tp2 and decode tp2, one rank
per pod) in one cluster start: PD output equals colocated; kill -9 the
non-leader prefill pod during a burst → the rooms on that instance fail
within the heartbeat bound, both of its pods are restarted as a gang, and
later requests equal colocated again. A leader started alone says which
ranks it is missing until its other pod joins. dp groups on pods of their
own (`examples/pd-prefill-dp2-2pods.yaml`, and one rank a pod) serve like
colocated, and both dp groups of each role serve requests.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdcluster.runtime.ports import free_ports
from pdcluster.runtime.spec import parse_manifest
from tests.faults.harness import make_prompts
from tests.local.cluster import local_cluster, ps_rows, stop_process_groups, write_manifest
from tests.local.test_supervise import (
    MAX_TOKENS,
    assert_served_like_colocated,
    burst_until_live,
    wait_for,
)
from tests.pd_integration.reference import colocated_outputs
from tests.pd_integration.test_topologies import assert_no_page_leak

EXAMPLE = Path(__file__).parents[2] / "examples" / "pd-prefill-tp2-2pods.yaml"
HEARTBEAT = {"intervalSeconds": 1.0, "failureThreshold": 2}
# Decode fails a dead prefill's rooms after this many seconds at the latest
# (failureThreshold missed probes, plus one probe in flight); the
# supervisor's fast path tells it sooner.
HEARTBEAT_BOUND_S = HEARTBEAT["intervalSeconds"] * (HEARTBEAT["failureThreshold"] + 1)


def example_spec(name: str) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec: dict[str, Any] = doc["spec"]
    assert spec["prefill"]["gpusPerPod"] == 1 and spec["prefill"]["topology"] == {"tp": 2}
    assert spec["decode"]["gpusPerPod"] == 1 and spec["decode"]["topology"] == {"tp": 2}
    spec["kvCache"]["numPages"] = 1024
    spec["transfer"] = {"heartbeat": HEARTBEAT}
    spec["prefill"]["restart"] = {"backoffSeconds": 0.2, "budget": 2}
    spec["router"] = {"healthCheckIntervalSeconds": 0.5}
    return spec


def state_of(state_dir: Path, cluster: str) -> dict[str, dict[str, Any]]:
    state = json.loads((state_dir / cluster / "state.json").read_text())
    return {p["name"]: p for p in state["processes"]}


@pytest.mark.slow
def test_a_two_pod_instance_serves_like_colocated_and_restarts_as_a_gang(
    tmp_path: Path,
) -> None:
    path = write_manifest(tmp_path, "twopods", example_spec("twopods"))
    manifest = parse_manifest(yaml.safe_load(path.read_text()))
    before = make_prompts(4, seed=51, lo=1, hi=200)
    victims = make_prompts(4, seed=52, lo=1500, hi=2500)
    after = make_prompts(4, seed=53, lo=1, hi=200)
    expected_before = colocated_outputs(manifest, before, MAX_TOKENS)
    expected_after = colocated_outputs(manifest, after, MAX_TOKENS)
    state_dir = tmp_path / "state"
    with (
        local_cluster(path, state_dir) as cluster,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):
        # `ps`: one row per pod, the leader's URL standing for its instance.
        rows = ps_rows(state_dir)
        assert {n: (r["POD"], r["RANKS"]) for n, r in rows.items() if n != "router"} == {
            "prefill-0-0": ("0/2", "0"),
            "prefill-0-1": ("1/2", "1"),
            "decode-0-0": ("0/2", "0"),
            "decode-0-1": ("1/2", "1"),
        }
        info = httpx.get(
            cluster.worker("prefill-0-0")["url"] + "/get_server_info", headers=cluster.auth
        ).json()
        assert (info["num_pods"], info["missing_ranks"]) == (2, [])

        assert_served_like_colocated(pool, cluster, before, expected_before)

        # A burst on the instance, then kill -9 its non-leader pod mid-flight.
        burst = burst_until_live(pool, cluster, victims, "prefill-0-0")
        old = state_of(state_dir, "twopods")
        killed_at = time.monotonic()
        os.kill(old["prefill-0-1"]["pid"], signal.SIGKILL)

        results = [f.result(timeout=120) for f in burst]
        lost = [(s, b, end) for s, b, end in results if s != 200]
        assert lost, "no request was on the killed instance"
        for status, body, end in lost:
            assert status in (502, 504), body
            assert end - killed_at < HEARTBEAT_BOUND_S, (
                f"a lost request took {end - killed_at:.1f}s to fail "
                f"(heartbeat bound {HEARTBEAT_BOUND_S:.0f}s)"
            )

        # The whole instance is restarted as a gang: both pods get new processes.
        def is_back() -> bool:
            now = state_of(state_dir, "twopods")
            pods = [now["prefill-0-0"], now["prefill-0-1"]]
            return all((p["state"], p["restarts"]) == ("running", 1) for p in pods)

        wait_for(is_back, 180, "prefill-0 back as a gang", 0.2)
        now = state_of(state_dir, "twopods")
        assert now["prefill-0-0"]["pid"] != old["prefill-0-0"]["pid"], "the leader was kept"
        assert now["prefill-0-1"]["pid"] != old["prefill-0-1"]["pid"]
        assert (now["decode-0-0"]["restarts"], now["decode-0-1"]["restarts"]) == (0, 0)
        rows = ps_rows(state_dir)
        assert rows["prefill-0-1"]["LAST EXIT"] == "killed by SIGKILL"
        up_log = (tmp_path / "up-twopods.log").read_text()
        assert "prefill-0 lost (prefill-0-1 killed by SIGKILL)" in up_log

        assert_served_like_colocated(pool, cluster, after, expected_after)

        # No page leak on decode (whose pages the lost rooms had reserved) nor prefill.
        cluster.state = json.loads((state_dir / "twopods" / "state.json").read_text())
        assert_no_page_leak(cluster, timeout=60)


def colocated_two_pods(tmp_path: Path) -> Path:
    spec = {
        "model": {"name": "tiny", "computeDtype": "float64"},
        "kvCache": {"pageSize": 16, "dtype": "float64", "numPages": 64},
        "colocated": {"topology": {"tp": 2}, "gpusPerPod": 1},
    }
    return write_manifest(tmp_path, "alone", spec)


def start_pod(
    manifest: Path, pod: int, port: int, dist_port: int, log: Path
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "pdcluster.runtime.cli", "worker", "-f", str(manifest)]
    argv += ["--role", "colocated", "--port", str(port), "--dist-port", str(dist_port)]
    argv += ["--pod-index", str(pod)]
    env = {**os.environ, "PDCLUSTER_TOKEN": "tok", "PDCLUSTER_LEADER_ADDRESS": "127.0.0.1"}
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        resp = httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return 0, {}
    is_json = resp.headers.get("content-type", "").startswith("application/json")
    return resp.status_code, resp.json() if is_json else {}


@pytest.mark.slow
def test_the_leader_says_which_ranks_are_missing_until_every_pod_joined(
    tmp_path: Path,
) -> None:
    manifest = colocated_two_pods(tmp_path)
    port, dist_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    procs = [start_pod(manifest, 0, port, dist_port, tmp_path / "pod0.log")]
    try:
        # Rank 0 proves itself first; from then on the leader waits for rank 1 only.
        wait_for(
            lambda: health(url + "/health")[1].get("missing_ranks") == [1],
            120,
            "the leader to wait for rank 1",
            0.1,
        )
        status, body = health(url + "/health")
        assert (status, body["reason"], body["missing_ranks"]) == (503, "ranks_missing", [1])
        assert body["waiting_for"] == "rank 1 (pod 1)"
        assert health(url + "/health/live")[0] == 200  # waiting is no reason to restart it
        assert procs[0].poll() is None

        procs.append(start_pod(manifest, 1, port, dist_port, tmp_path / "pod1.log"))
        wait_for(lambda: health(url + "/health")[0] == 200, 180, "the instance ready", 0.2)
        resp = httpx.post(
            url + "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
            headers={"Authorization": "Bearer tok"},
            timeout=60,
        )
        assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 2
    finally:
        stop_process_groups(procs)


def metric_total(text: str, name: str) -> float:
    """Sum of every sample of metric `name` in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# Prefill dp2 tp2 at one rank a pod: dp group 1 (ranks 2, 3) runs on pods 2 and 3,
# so pod 3 dials group 1's store at pod 2's published address, and the front on
# pod 0 forwards group 1's rooms to pod 2. Decode dp2: group 1 on pod 1.
ONE_RANK_A_POD = {
    "model": {"name": "tiny", "computeDtype": "float64"},
    "kvCache": {"pageSize": 16, "dtype": "float64", "numPages": 256},
    "prefill": {"topology": {"dp": 2, "tp": 2}, "gpusPerPod": 1},
    "decode": {"topology": {"dp": 2}, "gpusPerPod": 1},
}


# One rank a pod is the harder layout (a dp group over two pods, pods hosting no
# group's leader); the example itself (a whole dp group a pod) serves in float64
# in tests/pd_integration/test_prefix_cache_pd.py's every-topology test.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "ranks"),
    [
        (
            ONE_RANK_A_POD,
            {"prefill-0-0": "0", "prefill-0-1": "1", "prefill-0-2": "2", "prefill-0-3": "3"},
        ),
    ],
    ids=["one-rank-a-pod"],
)
def test_dp_groups_on_their_own_pods_serve_like_colocated(
    tmp_path: Path, spec: dict[str, Any], ranks: dict[str, str]
) -> None:
    path = write_manifest(tmp_path, "widedp", spec)
    manifest = parse_manifest(yaml.safe_load(path.read_text()))
    prompts = make_prompts(12, seed=61, lo=1, hi=120)
    expected = colocated_outputs(manifest, prompts, MAX_TOKENS)
    state_dir = tmp_path / "state"
    with (
        local_cluster(path, state_dir) as cluster,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        rows = ps_rows(state_dir)
        assert {n: r["RANKS"] for n, r in rows.items() if n != "router"} == {
            **ranks,
            "decode-0-0": "0",
            "decode-0-1": "1",
        }
        assert_served_like_colocated(pool, cluster, prompts, expected)

        # Both dp groups of both roles served some of them: each group's leader
        # counts the requests it finished itself (the front counts the relayed too).
        for role in ("prefill", "decode"):
            front = cluster.worker(f"{role}-0-0")
            (group1_port,) = front["dp_ports"]
            group1 = httpx.get(
                f"http://127.0.0.1:{group1_port}/metrics", headers=cluster.auth, timeout=10
            ).text
            front_page = httpx.get(front["url"] + "/metrics", headers=cluster.auth).text
            served_1 = metric_total(group1, "pdcluster_requests_total")
            served_all = metric_total(front_page, "pdcluster_requests_total")
            assert 0 < served_1 < len(prompts), (role, served_1)
            assert served_all == len(prompts), (role, served_all)
            # Group 1's internal API takes only the cluster token.
            denied = httpx.post(
                f"http://127.0.0.1:{group1_port}/generate",
                json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}},
                timeout=10,
            )
            assert denied.status_code == 401, denied.text


@pytest.mark.slow
def test_a_dp_leader_pod_without_the_token_is_refused_by_the_leader(tmp_path: Path) -> None:
    spec = {
        "model": {"name": "tiny", "computeDtype": "float64"},
        "kvCache": {"pageSize": 16, "dtype": "float64", "numPages": 64},
        "colocated": {"topology": {"dp": 2}, "gpusPerPod": 1},
    }
    manifest = write_manifest(tmp_path, "wrongpod", spec)
    port, dist, dist1, http1 = free_ports(4)
    argv = [sys.executable, "-m", "pdcluster.runtime.cli", "worker", "-f", str(manifest)]
    argv += ["--role", "colocated", "--port", str(port), "--dist-port", str(dist)]
    argv += ["--dp-dist-ports", str(dist1), "--dp-ports", str(http1)]
    procs = []
    logs = [tmp_path / "pod0.log", tmp_path / "pod1.log"]
    try:
        for pod, token in ((0, "tok"), (1, "not-the-token")):
            env = {**os.environ, "PDCLUSTER_TOKEN": token, "PDCLUSTER_LEADER_ADDRESS": "127.0.0.1"}
            with open(logs[pod], "ab") as out:
                procs.append(
                    subprocess.Popen(
                        [*argv, "--pod-index", str(pod)],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        # The leader checks pod 1's published address before starting any rank.
        assert procs[0].wait(120) != 0
        text = logs[0].read_text()
        assert "pod 1's address 127.0.0.1 was not published for wrongpod/colocated-0" in text, text
    finally:
        stop_process_groups(procs)


def stream_tokens(url: str, num_tokens: int, first_token: threading.Event) -> dict[str, Any]:
    """A streamed /generate of `num_tokens` tokens; sets `first_token` once one arrived."""
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": num_tokens, "ignore_eos": True},
        "stream": True,
    }
    last: dict[str, Any] = {}
    with httpx.stream(
        "POST", url + "/generate", json=body, headers={"Authorization": "Bearer tok"}, timeout=120
    ) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            last = json.loads(line.removeprefix("data:"))
            first_token.set()
    return last


@pytest.mark.slow
@pytest.mark.parametrize("signalled", ["group", "pod-process"])
def test_stopping_every_pod_of_an_instance_at_once_finishes_the_request_in_flight(
    tmp_path: Path, signalled: str
) -> None:
    """A node drain or `kubectl delete` stops every pod of an instance at once. The
    leader drains (finishes its requests); a pod k > 0 keeps its ranks running
    until the leader shut them down, whether SIGTERM reaches its process only
    (a kubelet signals the container's first process) or its whole process group
    (the e2e node agent and `pdcluster down`)."""
    manifest = colocated_two_pods(tmp_path)
    port, dist_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    procs = [start_pod(manifest, k, port, dist_port, tmp_path / f"pod{k}.log") for k in range(2)]
    try:
        wait_for(lambda: health(url + "/health")[0] == 200, 180, "the instance ready", 0.2)
        first = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            done = pool.submit(stream_tokens, url, 400, first)
            assert first.wait(60), "no token streamed"
            for proc in reversed(procs):  # the follower first: the worst order
                if signalled == "group":
                    os.killpg(proc.pid, signal.SIGTERM)
                else:
                    proc.send_signal(signal.SIGTERM)
            last = done.result(timeout=120)
        assert last["meta_info"]["finish_reason"]["type"] == "length", last
        assert last["meta_info"]["completion_tokens"] == 400
        # Both pods end once the leader drained: the follower's ranks by the
        # leader's shutdown, not by the signal.
        assert procs[0].wait(60) == 0
        assert procs[1].wait(60) == 0
    finally:
        stop_process_groups(procs)
