"""Local autoscaling's drain against the real router: an instance is stopped only
once the router confirmed it sends it nothing and nothing is in flight.

The router is the real app in front of stand-in workers (tests/router); the
drain is `LocalAutoscaler._drain` with the launcher replaced by a record of
what it was asked to stop. Each case used to stop the instance too early:
a worker whose `/metrics` timed out was read as idle, and a hold the router
never confirmed was assumed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from pdcluster.runtime.http.auth import bearer_headers
from pdcluster.runtime.local.autoscaling import LocalAutoscaler
from pdcluster.runtime.local.plan import ProcessSpec
from pdcluster.runtime.local.supervision import InstanceKey
from pdcluster.runtime.spec import PDCluster, Role
from tests.router.harness import Cluster, LoopThread, start_cluster

TOKEN = "drain-token"
MANIFEST = PDCluster.model_validate(
    {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": "drain"},
        "spec": {"model": {"name": "tiny"}, "prefill": {}, "decode": {}},
    }
)


@dataclass
class Launcher:
    """What the drain asks of the launcher: its router, and stopping the instance."""

    endpoint: str
    stopped: list[tuple[float, list[str]]] = field(default_factory=list)
    token: str = TOKEN

    @property
    def plan(self) -> Any:
        return SimpleNamespace(endpoint=self.endpoint, workers=())

    @property
    def lock(self) -> threading.Lock:
        return threading.Lock()

    def remove_scaled(self, specs: list[ProcessSpec]) -> None:
        self.stopped.append((time.monotonic(), [s.name for s in specs]))


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def cluster(loop: LoopThread) -> Iterator[Cluster]:
    with start_cluster(
        loop, prefill=1, decode=2, worker_token=TOKEN, health_check_interval_s=0.05
    ) as started:
        yield started


def decode_spec(cluster: Cluster, index: int) -> ProcessSpec:
    port = int(cluster.decode[index].url.rsplit(":", 1)[1])
    return ProcessSpec(name=f"decode-{index}", role=Role.decode, instance=index, argv=(), port=port)


def drain_in_background(
    launcher: Launcher, spec: ProcessSpec, timeout_s: float = 30.0
) -> tuple[LocalAutoscaler, list[str], threading.Thread]:
    lines: list[str] = []
    scaler = LocalAutoscaler(
        launcher,  # type: ignore[arg-type]
        MANIFEST,
        "drain.yaml",
        "python",
        on_line=lines.append,
        drain_timeout_s=timeout_s,
    )
    http = httpx.Client(timeout=0.5, trust_env=False, headers=bearer_headers(TOKEN))
    key = InstanceKey(Role.decode, spec.instance)

    def run() -> None:
        try:
            scaler._drain(key, [spec], http)
        finally:
            http.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return scaler, lines, thread


def test_a_worker_whose_metrics_time_out_is_busy_not_idle(cluster: Cluster) -> None:
    worker = cluster.decode[1]
    worker.behaviour.set(metrics_delay_s=1.0)  # past the drain's 0.5 s client timeout
    launcher = Launcher(cluster.router_url)
    scaler, lines, thread = drain_in_background(launcher, decode_spec(cluster, 1))
    try:
        time.sleep(1.5)
        assert launcher.stopped == [], lines
        assert any("worker /metrics" in line and "ReadTimeout" in line for line in lines), lines
        # It answers again, and with nothing in flight: now it is stopped.
        worker.behaviour.set(metrics_delay_s=0.0)
        thread.join(10)
        assert [names for _, names in launcher.stopped] == [["decode-1"]]
    finally:
        scaler._stop.set()
        thread.join(5)


def test_requests_in_flight_at_the_worker_hold_the_stop(cluster: Cluster) -> None:
    worker = cluster.decode[1]
    worker.behaviour.set(in_flight=2)
    launcher = Launcher(cluster.router_url)
    scaler, lines, thread = drain_in_background(launcher, decode_spec(cluster, 1))
    try:
        time.sleep(0.8)
        assert launcher.stopped == []
        assert any("2 requests in flight" in line for line in lines), lines
        # Held out at the router: no new leg reaches it meanwhile.
        health = httpx.get(cluster.router_url + "/health", timeout=2).json()
        (entry,) = [w for w in health["workers"] if w["url"] == worker.url]
        assert entry["healthy"] is False
        worker.behaviour.set(in_flight=0)
        thread.join(10)
        assert launcher.stopped and launcher.stopped[0][1] == ["decode-1"]
    finally:
        scaler._stop.set()
        thread.join(5)


def test_an_unconfirmed_hold_never_stops_the_instance(cluster: Cluster) -> None:
    """The router does not answer: it may still send to the instance, whatever the
    drain timeout says (an instance stopped under it fails requests not begun)."""
    launcher = Launcher("http://127.0.0.1:9")  # nothing listens there
    scaler, lines, thread = drain_in_background(launcher, decode_spec(cluster, 1), timeout_s=0.2)
    try:
        time.sleep(1.5)
        assert launcher.stopped == []
        (said,) = [line for line in lines if "has not confirmed" in line]
        assert "ConnectError" in said
    finally:
        scaler._stop.set()
        thread.join(5)
    assert launcher.stopped == []
