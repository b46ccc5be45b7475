"""`LocalCluster.supervise` performs the supervisor's decisions on real processes.

The processes are small HTTP stand-ins (no engine) that log every call they
get, so a test reads what the launcher told whom: decode's `fail_peer`, the
router's hold and admit, each with the cluster token.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pdcluster.runtime.local.launcher import STATE_FILE, LocalCluster
from pdcluster.runtime.local.liveness import LivenessPolicy
from pdcluster.runtime.local.plan import LocalPlan, ProcessSpec
from pdcluster.runtime.local.supervision import InstanceKey
from pdcluster.runtime.ports import free_ports
from pdcluster.runtime.spec import RestartPolicySpec, Role

TOKEN = "supervise-loop-token"
# Probed five times a second; two misses in a row kill.
LIVENESS = LivenessPolicy(period_s=0.2, timeout_s=0.5, failure_threshold=2)
# Answers 200 to everything (`peers_down` empty on /get_server_info) and logs each call
# but the probes.
STANDIN = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def _answer(self):
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n).decode() if n else ""
        if self.path not in ("/health", "/health/live"):  # probes
            auth = self.headers.get("authorization", "")
            print("CALL", self.command, self.path, auth, body, flush=True)
        out = json.dumps({"peers_down": {}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    do_GET = do_POST = _answer
    def log_message(self, *a):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def standin(name: str, role: Any, instance: int, port: int, bport: int | None) -> ProcessSpec:
    argv = (sys.executable, "-c", STANDIN, str(port))
    return ProcessSpec(name, role, instance, argv, port, bootstrap_port=bport)


def make_plan() -> LocalPlan:
    ports = free_ports(6)
    workers = (
        standin("prefill-0", Role.prefill, 0, ports[0], ports[1]),
        standin("prefill-1", Role.prefill, 1, ports[2], ports[3]),
        standin("decode-0", Role.decode, 0, ports[4], None),
    )
    return LocalPlan("loop", workers, standin("router", "router", 0, ports[5], None))


class Supervised:
    def __init__(self, cluster: LocalCluster, thread: threading.Thread) -> None:
        self.cluster = cluster
        self.thread = thread
        self.reason: str | None = None
        self.lines: list[str] = []

    def calls(self, name: str) -> list[str]:
        path = self.cluster.state_dir / "logs" / f"{name}.log"
        return [line for line in path.read_text().splitlines() if line.startswith("CALL ")]

    def state(self, name: str) -> dict[str, Any]:
        state = json.loads((self.cluster.state_dir / STATE_FILE).read_text())
        return next(p for p in state["processes"] if p["name"] == name)


@pytest.fixture
def supervised(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Supervised]:
    budget = getattr(request, "param", 5)
    policy = RestartPolicySpec(backoff_seconds=0.1, budget=budget)
    cluster = LocalCluster(make_plan(), tmp_path / "state", token=TOKEN)
    cluster.start()
    try:
        cluster.wait_ready(30)
        box: list[Supervised] = []
        stop = threading.Event()

        def run() -> None:
            sup = box[0]
            sup.reason = cluster.supervise(
                {Role.prefill: policy, Role.decode: policy},
                on_action=sup.lines.append,
                stop=stop,
                liveness=LIVENESS,
            )

        thread = threading.Thread(target=run, daemon=True)
        box.append(Supervised(cluster, thread))
        thread.start()
        yield box[0]
        stop.set()
        thread.join(10)
        assert not thread.is_alive()
    finally:
        cluster.stop(grace=2)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_lost_prefill_is_reported_held_out_restarted_on_its_ports_and_admitted(
    supervised: Supervised,
) -> None:
    cluster = supervised.cluster
    victim = cluster.plan.workers[1]
    old_pid = cluster.procs["prefill-1"].pid
    os.kill(old_pid, signal.SIGKILL)

    fail_peer = f'"peer":"127.0.0.1:{victim.bootstrap_port}","reason":"prefill_pod_lost"'
    wait_for(lambda: any(fail_peer in c for c in supervised.calls("decode-0")), "fail_peer")
    (told,) = [c for c in supervised.calls("decode-0") if "/admin/fail_peer" in c]
    assert f"Bearer {TOKEN}" in told and '"gone":true' in told
    wait_for(lambda: supervised.lines[-1:] == ["prefill-1 is back"], "prefill-1 back")
    row = supervised.state("prefill-1")
    assert row["state"] == "running"
    assert row["restarts"] == 1 and row["last_exit"] == "killed by SIGKILL"
    assert row["pid"] != old_pid and cluster.procs["prefill-1"].poll() is None
    router = supervised.calls("router")
    hold = [c for c in router if "/admin/hold_worker" in c]
    admit = [c for c in router if "/admin/admit_worker" in c]
    assert len(hold) == 1 and victim.url in hold[0] and "prefill-1 killed by SIGKILL" in hold[0]
    assert len(admit) == 1 and victim.url in admit[0]
    assert router.index(hold[0]) < router.index(admit[0])
    # Nobody else was touched.
    assert supervised.state("prefill-0")["restarts"] == 0
    assert supervised.calls("prefill-0") == [] and supervised.calls("prefill-1") == []

    # The router's exit ends the supervision with the reason.
    os.kill(cluster.procs["router"].pid, signal.SIGKILL)
    supervised.thread.join(10)
    assert supervised.reason == (
        "router exited (killed by SIGKILL); the cluster cannot serve without it"
    )


def test_a_process_that_stops_answering_is_killed_restarted_and_admitted(
    supervised: Supervised,
) -> None:
    # Stopped, not gone: no exit to see; only the liveness probe can tell.
    cluster = supervised.cluster
    old_pid = cluster.procs["prefill-0"].pid
    os.kill(old_pid, signal.SIGSTOP)
    try:
        wait_for(lambda: supervised.lines[-1:] == ["prefill-0 is back"], "prefill-0 restarted")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_pid, signal.SIGCONT)
    why = "killed after 2 failed liveness probes in a row"
    row = supervised.state("prefill-0")
    assert row["state"] == "running" and row["restarts"] == 1 and row["last_exit"] == why
    assert row["pid"] != old_pid and cluster.procs["prefill-0"].poll() is None
    (lost,) = [line for line in supervised.lines if line.startswith("prefill-0 lost")]
    assert f"prefill-0 {why}" in lost
    hold = [c for c in supervised.calls("router") if "/admin/hold_worker" in c]
    assert len(hold) == 1 and f"prefill-0 {why}" in hold[0]
    assert any("/admin/fail_peer" in c for c in supervised.calls("decode-0"))
    # The live ones were probed all along and left alone.
    assert supervised.state("prefill-1")["restarts"] == 0
    assert supervised.state("decode-0")["restarts"] == 0


@pytest.mark.parametrize("supervised", [0], indirect=True)
def test_with_no_budget_the_first_loss_ends_supervision_with_the_reason(
    supervised: Supervised,
) -> None:
    os.kill(supervised.cluster.procs["decode-0"].pid, signal.SIGKILL)
    supervised.thread.join(10)
    assert supervised.reason == (
        "decode-0 exited (killed by SIGKILL) and the decode restart budget is spent (0 per hour)"
    )
    assert not any("/admin/" in c for c in supervised.calls("router"))
    assert supervised.cluster.procs["prefill-0"].poll() is None, "giving up stops nothing itself"


def test_an_adopted_instance_is_restarted_and_a_released_one_exits_without_a_restart(
    supervised: Supervised,
) -> None:
    cluster = supervised.cluster
    port, bport = free_ports(2)
    new = standin("prefill-2", Role.prefill, 2, port, bport)
    cluster.add_scaled([new])
    assert supervised.state("prefill-2")["state"] == "starting"
    # Not supervised yet: its exit is autoscaling's business, not a loss.
    assert cluster.adopt(InstanceKey(Role.prefill, 2), [new])
    assert supervised.state("prefill-2")["state"] == "running"
    assert cluster.instance_phases()[InstanceKey(Role.prefill, 2)] == "running"

    old_pid = cluster.procs["prefill-2"].pid
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: supervised.lines[-1:] == ["prefill-2 is back"], "prefill-2 restarted")
    assert supervised.state("prefill-2")["restarts"] == 1

    # Released for a drain: "draining", and its exit restarts nothing.
    key = InstanceKey(Role.prefill, 1)
    assert cluster.release(key) == [cluster.plan.workers[1]]
    assert supervised.state("prefill-1")["state"] == "draining"
    lines = len(supervised.lines)
    cluster.remove_scaled(cluster.release(InstanceKey(Role.prefill, 2)) or [])
    names = [s.name for s in cluster.plan.workers]
    assert names == ["prefill-0", "prefill-1", "decode-0"]
    os.kill(cluster.procs["prefill-1"].pid, signal.SIGKILL)
    wait_for(lambda: cluster.procs["prefill-1"].poll() is not None, "prefill-1 gone")
    cluster.remove_scaled([cluster.plan.workers[1]])
    assert [s.name for s in cluster.plan.workers] == ["prefill-0", "decode-0"]
    assert supervised.thread.is_alive() and supervised.lines[lines:] == []
    # Releasing what is not there is refused and changes nothing.
    assert cluster.release(key) is None
    assert supervised.state("prefill-0")["restarts"] == 0
