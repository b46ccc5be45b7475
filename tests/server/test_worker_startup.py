"""What a worker refuses at start, and where its torch store listens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.runtime.worker_main import store_host

EXAMPLE = Path(__file__).parents[2] / "examples" / "pd-1p1d.yaml"


@pytest.mark.parametrize(
    ("advertise", "bound"),
    [("10.1.2.3", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("127.0.3.4", "127.0.3.4")],
)
def test_the_torch_store_of_a_one_pod_instance_never_faces_the_pod_network(
    advertise: str, bound: str
) -> None:
    assert store_host(advertise) == bound


def test_the_pods_of_a_multi_pod_instance_meet_at_the_leader_pod() -> None:
    assert store_host("10.1.2.3", is_multi_pod=True) == "10.1.2.3"


def run_worker(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdcluster.runtime.cli", "worker", "-f", str(EXAMPLE)]
    argv += ["--role", "decode", "--port", "1", "--dist-port", "2", *extra]
    return subprocess.run(
        argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )


def test_a_worker_on_kubernetes_refuses_to_start_without_a_token() -> None:
    res = run_worker({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "PDCLUSTER_TOKEN": ""})
    assert res.returncode != 0
    assert "PDCLUSTER_TOKEN is empty" in res.stderr


def test_a_bad_prefill_peer_list_is_refused() -> None:
    res = run_worker({"PDCLUSTER_TOKEN": "t"}, "--prefill-peers", "127.0.0.1:99999")
    assert res.returncode != 0
    assert "--prefill-peers" in res.stderr and "bad bootstrap port" in res.stderr


TWO_PODS = Path(__file__).parents[2] / "examples" / "pd-prefill-tp2-2pods.yaml"


def run_pod(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdcluster.runtime.cli", "worker", "-f", str(TWO_PODS)]
    argv += ["--role", "decode", "--port", "1", "--dist-port", "2", *extra]
    full = {k: v for k, v in os.environ.items() if not k.startswith("PDCLUSTER_LEADER")}
    full.update({"PDCLUSTER_TOKEN": "t", **env})
    return subprocess.run(argv, env=full, capture_output=True, text=True, timeout=60)


def test_a_pod_index_outside_the_instance_is_refused() -> None:
    res = run_pod({}, "--pod-index", "2")
    assert res.returncode != 0
    assert "--pod-index 2: pod index 2 is outside the instance's 2 pods" in res.stderr


def test_a_non_leader_pod_without_a_leader_address_is_refused() -> None:
    res = run_pod({}, "--pod-index", "1")
    assert res.returncode != 0
    assert "a pod k > 0 needs its leader's address" in res.stderr


def test_a_bad_leader_address_is_refused() -> None:
    res = run_pod({}, "--pod-index", "1", "--leader-address", "10.0.0.1:29500")
    assert res.returncode != 0
    assert "must be a host without a port" in res.stderr


def test_a_leader_address_that_never_comes_stops_the_pod(tmp_path: Path) -> None:
    empty = tmp_path / "leader"
    empty.write_text("")  # the downward API's file before the annotation is set
    env = {"PDCLUSTER_LEADER_ADDRESS_FILE": str(empty), "PDCLUSTER_LEADER_WAIT_SECONDS": "0.5"}
    res = run_pod(env, "--pod-index", "1")
    assert res.returncode != 0
    assert f"no leader address in {empty}" in res.stderr


DP2 = Path(__file__).parents[2] / "examples" / "pd-prefill-dp2.yaml"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--dp-ports", "30001"), "--dp-ports and --dp-dist-ports go together"),
        (("--dp-ports", "30001,30002", "--dp-dist-ports", "30003"), "--dp-ports needs one port"),
        (("--dp-ports", "x", "--dp-dist-ports", "30003"), "--dp-ports: 'x' is not a port number"),
        (("--dp-ports", "2", "--dp-dist-ports", "30003"), "the dp ports must be distinct"),
    ],
)
def test_dp_ports_that_do_not_fit_the_instance_are_refused(
    extra: tuple[str, ...], message: str
) -> None:
    argv = [sys.executable, "-m", "pdcluster.runtime.cli", "worker", "-f", str(DP2)]
    argv += ["--role", "prefill", "--port", "1", "--dist-port", "2", "--bootstrap-port", "3"]
    res = subprocess.run(
        [*argv, *extra],
        env={**os.environ, "PDCLUSTER_TOKEN": "t"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0
    assert f"pdcluster worker: {message}" in res.stderr, res.stderr
