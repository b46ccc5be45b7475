"""`pdcluster up` end to end: real processes, the official openai client, clean stop."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.local.cluster import local_cluster, pid_alive, ps_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_colocated_cluster_serves_openai_and_stops_cleanly(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with local_cluster(ROOT / "examples" / "colocated.yaml", state_dir) as cluster:
        client = openai.OpenAI(base_url=cluster.endpoint + "/v1", api_key="unused")
        a = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        b = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        assert a.choices[0].text == b.choices[0].text
        assert a.usage is not None and a.usage.completion_tokens <= 8
        chunks = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
        )
        assert streamed == whole.choices[0].message.content
        ps = ps_text(state_dir)
        assert "colocated-0" in ps and "router" in ps and cluster.endpoint in ps
        pids = cluster.pids()
        assert all(pid_alive(p) for p in pids)
    assert not any(pid_alive(p) for p in pids), "processes left behind after Ctrl-C"
    assert not (state_dir / "colocated" / "state.json").exists()


# How long a worker may take to stop after its SIGTERM: the launcher's own
# stop grace (`LocalCluster.stop`), after which it would SIGKILL; plus slack
# for a loaded box. A worker nobody signals lives on indefinitely.
STOP_GRACE_S = 10.0 + 10.0


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init, which may not reap here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_workers_stop_when_pdcluster_up_is_killed(tmp_path: Path) -> None:
    """kill -9 of `pdcluster up` cannot stop its workers itself: each gets SIGTERM
    from the kernel (parent-death signal) and stops, instead of serving for hours."""
    # The smallest cluster (router and one worker): every child is spawned alike.
    state_dir = tmp_path / "state"
    with local_cluster(ROOT / "examples" / "colocated.yaml", state_dir) as cluster:
        pids = cluster.pids()
        assert len(pids) == 2 and all(is_running(p) for p in pids)  # router, colocated-0
        try:
            os.kill(cluster.proc.pid, signal.SIGKILL)
            cluster.proc.wait(10)
            deadline = time.monotonic() + STOP_GRACE_S
            while any(is_running(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = [p for p in pids if is_running(p)]
            assert not left, f"processes {left} outlived their killed `pdcluster up`"
        finally:
            for pid in pids:  # whatever the outcome, leave nothing running
                if is_running(pid):
                    os.kill(pid, signal.SIGKILL)
