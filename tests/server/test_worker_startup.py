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
def test_the_torch_store_never_faces_the_pod_network(advertise: str, bound: str) -> None:
    assert store_host(advertise) == bound


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
