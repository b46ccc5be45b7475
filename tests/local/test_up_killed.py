"""A launcher killed outright (kill -9) leaves no process of its cluster serving.

Each process `pdcluster up` started notices it was re-parented and drains by
itself (`runtime/local/parent_watch.py`).

A file of its own, run after `test_multi_pod.py`: in two of three full-suite
runs where this test ran just before it, the first two-pod cluster there
never got ready (every worker up, the router admitting none); the cause is
not found yet, and the test that follows this one is worth watching.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.local.cluster import local_cluster, pid_alive

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_launcher_killed_outright_leaves_no_process_serving(tmp_path: Path) -> None:
    # kill -9 gives `pdcluster up` no chance to stop its processes: each of
    # them notices it was re-parented and drains by itself.
    state_dir = tmp_path / "state"
    with local_cluster(ROOT / "examples" / "colocated.yaml", state_dir) as cluster:
        pids = cluster.pids()
        assert all(pid_alive(p) for p in pids)
        cluster.proc.send_signal(signal.SIGKILL)
        cluster.proc.wait(10)
        deadline = time.monotonic() + 30
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if pid_alive(p)]
        assert not left, f"processes {left} still running 30 s after the launcher was killed"
