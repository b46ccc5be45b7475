"""The failover fast path against real HTTP workers on 127.0.0.1.

Each fake worker is a small FastAPI app speaking the workers' admin API
(token check, fail_peer, failure counters) under uvicorn, so the operator's
HTTP client, timeouts and concurrency are the real ones; the Kubernetes API
is the in-memory FakeApi.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdcluster.operator.failover.fast_path import Failover
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.settings import OperatorSettings
from pdcluster.runtime.ports import free_port
from pdcluster.runtime.spec import Role

from .helpers import NS, PD, FakeApi, body
from .podmaker import deleting, not_ready, terminated, worker_pod
from .served import serving

TOKEN = "s3cret-token"


@dataclass
class FakeWorker:
    """A PD worker's admin API: fail_peer fails `rooms_per_peer` rooms."""

    port: int
    rooms_per_peer: int = 1
    delay_s: float = 0.0
    calls: list[tuple[str, str]] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    # What /health answers: 200, or 503 with this reason (readiness.py).
    health_reason: str | None = None
    # Called as each fail_peer arrives; what it returns is kept in `observed`.
    observe: Callable[[], Any] | None = None
    observed: list[Any] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        def denied(request: Request) -> JSONResponse | None:
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"error": {"message": "wrong token"}}, 403)
            return None

        @app.post("/admin/fail_peer")
        async def fail_peer(request: Request) -> JSONResponse:
            if (no := denied(request)) is not None:
                return no
            await asyncio.sleep(self.delay_s)
            data = await request.json()
            self.calls.append((data["peer"], data["reason"]))
            if self.observe is not None:
                self.observed.append(self.observe())
            key = f"room_failed:{data['reason']}"
            self.failures[key] = self.failures.get(key, 0) + self.rooms_per_peer
            return JSONResponse({"peer": data["peer"], "reason": data["reason"]})

        @app.get("/health")
        async def health() -> JSONResponse:
            if self.health_reason is None:
                return JSONResponse({})
            return JSONResponse({"status": "not_ready", "reason": self.health_reason}, 503)

        @app.get("/admin/failures")
        async def failures(request: Request) -> JSONResponse:
            if (no := denied(request)) is not None:
                return no
            return JSONResponse({"failures": self.failures})

        return app


@pytest.fixture
async def workers() -> AsyncIterator[list[FakeWorker]]:
    started = [FakeWorker(free_port(), rooms_per_peer=rooms) for rooms in (2, 3)]
    async with serving(*((w.app(), w.port) for w in started)):
        yield started


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def make_failover(
    grace_s: float = 5.0, admin_timeout_s: float = 2.0, registration_warn_s: float = 60.0
) -> tuple[FakeApi, Failover, Clock]:
    api, clock = FakeApi(), Clock()
    api.store.objects[("PDCluster", "demo")] = body(PD)
    api.store.objects[("Secret", "demo-token")] = {
        "kind": "Secret",
        "metadata": {"name": "demo-token", "namespace": NS},
        "data": {"token": base64.b64encode(TOKEN.encode()).decode()},
    }
    settings = OperatorSettings(
        metrics_port=0,
        not_ready_grace_s=grace_s,
        admin_timeout_s=admin_timeout_s,
        registration_warn_s=registration_warn_s,
    )
    metrics = OperatorMetrics()
    recorder = EventRecorder(api, clock=clock, min_interval_s=30, host="test")
    return api, Failover(api, recorder, metrics, settings, clock=clock), clock


def decode_pods(workers: list[FakeWorker]) -> list[dict[str, Any]]:
    return [
        worker_pod(Role.decode, i, ip="127.0.0.1", http_port=w.port) for i, w in enumerate(workers)
    ]


def events(api: FakeApi) -> dict[str, tuple[int, str]]:
    return {e["reason"]: (e["count"], e["message"]) for e in api.events()}


async def add_decodes_and_a_prefill(
    failover: Failover, workers: list[FakeWorker]
) -> dict[str, Any]:
    """Tell `failover` of a decode pod per worker and of one prefill pod; that prefill pod."""
    for pod in decode_pods(workers):
        await failover.on_pod_event("ADDED", pod)
    prefill = worker_pod(Role.prefill, ip="127.0.0.99")
    await failover.on_pod_event("ADDED", prefill)
    return prefill


def metric(failover: Failover, name: str, **labels: str) -> float:
    value = failover.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def test_lost_prefill_makes_every_decode_fail_its_rooms_at_once(workers) -> None:
    api, failover, _ = make_failover()
    prefill = await add_decodes_and_a_prefill(failover, workers)
    started = time.monotonic()
    loss = await failover.on_pod_event("MODIFIED", terminated(prefill))
    elapsed = time.monotonic() - started
    assert loss is not None
    for w in workers:
        assert w.calls == [("127.0.0.99:8998", "prefill_pod_lost")]
    assert elapsed < 1.0
    count, message = events(api)["PrefillInstanceLost"]
    assert count == 1 and "its rooms failed at 2/2 decode workers" in message
    labels = {"role": "prefill", "cause": "failed"}
    assert metric(failover, "pdcluster_operator_failovers_total", **labels) == 1
    assert metric(failover, "pdcluster_operator_failover_seconds_count", role="prefill") == 1
    # The same loss seen again (the operator deletes the pod): nobody is told twice.
    await failover.on_pod_event("DELETED", deleting(terminated(prefill)))
    assert all(len(w.calls) == 1 for w in workers)
    # The counts the workers report become one aggregated Event: 2 + 3 rooms.
    await failover.poll_all()
    count, message = events(api)["RoomsFailed"]
    assert count == 5 and message == "rooms failed at decode workers: prefill_pod_lost"
    await failover.poll_all()
    assert events(api)["RoomsFailed"][0] == 5
    labels = {"role": "decode", "reason": "prefill_pod_lost"}
    assert metric(failover, "pdcluster_operator_rooms_failed_total", **labels) == 5
    await failover.aclose()


async def test_a_failover_is_counted_before_any_peer_hears_of_it(workers) -> None:
    # A decode answers its rooms' clients as fail_peer arrives: whoever reads the
    # operator's metrics after that answer finds the failover counted.
    _, failover, _ = make_failover()
    prefill = await add_decodes_and_a_prefill(failover, workers)
    labels = {"role": "prefill", "cause": "failed"}
    for w in workers:
        w.observe = lambda: metric(failover, "pdcluster_operator_failovers_total", **labels)
    assert await failover.on_pod_event("MODIFIED", terminated(prefill)) is not None
    assert [w.observed for w in workers] == [[1.0], [1.0]]
    await failover.aclose()


async def test_a_dead_or_slow_peer_does_not_hold_up_the_others(workers) -> None:
    api, failover, _ = make_failover(admin_timeout_s=0.3)
    workers[0].delay_s = 1.0
    pods = decode_pods(workers)
    dead = worker_pod(Role.decode, 7, ip="127.0.0.1", http_port=free_port())
    for pod in [*pods, dead]:
        await failover.on_pod_event("ADDED", pod)
    prefill = worker_pod(Role.prefill, ip="127.0.0.99")
    started = time.monotonic()
    await failover.on_pod_event("ADDED", deleting(prefill))
    # Bounded by the admin timeout, not by the slow peer.
    assert time.monotonic() - started < 0.9
    assert workers[1].calls == [("127.0.0.99:8998", "prefill_pod_lost")]
    _, message = events(api)["PrefillInstanceLost"]
    assert "1/3 decode workers" in message and "was deleted" in message
    await failover.aclose()


async def test_lost_decode_is_reported_to_prefill_by_its_address(workers) -> None:
    api, failover, _ = make_failover()
    prefills = [
        worker_pod(Role.prefill, i, ip="127.0.0.1", http_port=w.port) for i, w in enumerate(workers)
    ]
    for pod in prefills:
        await failover.on_pod_event("ADDED", pod)
    decode = worker_pod(Role.decode, ip="127.0.0.42")
    await failover.on_pod_event("ADDED", decode)
    await failover.on_pod_event("DELETED", deleting(decode))
    assert [w.calls for w in workers] == [[("127.0.0.42", "decode_pod_lost")]] * 2
    assert "decode instance 0 lost" in events(api)["DecodeInstanceLost"][1]
    await failover.aclose()


async def test_the_operators_own_deletions_fail_rooms_without_a_warning(workers) -> None:
    api, failover, _ = make_failover()
    prefill = await add_decodes_and_a_prefill(failover, workers)
    failover.expect_deletion(prefill["metadata"]["uid"])
    await failover.on_pod_event("MODIFIED", deleting(prefill))
    # It drains first: nothing is failed while it still serves its requests.
    assert all(w.calls == [] for w in workers)
    await failover.on_pod_event("DELETED", deleting(prefill))
    assert all(w.calls == [("127.0.0.99:8998", "prefill_pod_removed")] for w in workers)
    assert "PrefillInstanceLost" not in events(api)
    await failover.aclose()


async def test_a_hung_prefill_is_lost_once_the_grace_has_passed(workers) -> None:
    api, failover, clock = make_failover(grace_s=0.3)
    prefill = await add_decodes_and_a_prefill(failover, workers)
    assert await failover.on_pod_event("MODIFIED", not_ready(prefill)) is None
    assert all(w.calls == [] for w in workers)
    # No further event arrives: the operator's own timer rechecks the pod.
    clock.now += 0.3
    deadline = time.monotonic() + 5
    while "PrefillInstanceLost" not in events(api):
        assert time.monotonic() < deadline, "the grace timer never fired"
        await asyncio.sleep(0.05)
    assert all(w.calls == [("127.0.0.99:8998", "prefill_pod_lost")] for w in workers)
    assert "has not been Ready for 0.3s" in events(api)["PrefillInstanceLost"][1]
    await failover.aclose()


async def test_pods_of_a_deleted_cluster_are_no_loss(workers) -> None:
    api, failover, _ = make_failover()
    prefill = await add_decodes_and_a_prefill(failover, workers)
    # The garbage collector removes the pods after the PDCluster went away.
    del api.store.objects[("PDCluster", "demo")]
    await failover.on_pod_event("MODIFIED", deleting(prefill))
    assert api.events() == []
    # Once known deleted, its pods' events are ignored outright.
    decode = decode_pods(workers)[0]
    await failover.on_pod_event("MODIFIED", deleting(decode))
    assert all(len(w.calls) <= 1 for w in workers)
    failover.forget_cluster(NS, "demo", prefill["metadata"]["ownerReferences"][0]["uid"])
    assert failover.index.clusters() == []
    await failover.aclose()


async def test_failure_counts_of_workers_older_than_the_operator_are_not_replayed(
    workers,
) -> None:
    api, failover, _ = make_failover()
    workers[0].failures = {"room_failed:waiting_timeout": 40}
    pods = decode_pods(workers)
    pods[0]["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z"
    for pod in pods:
        await failover.on_pod_event("ADDED", pod)
    await failover.poll_all()
    assert "RoomsFailed" not in events(api)
    workers[0].failures = {"room_failed:waiting_timeout": 43}
    await failover.poll_all()
    count, message = events(api)["RoomsFailed"]
    assert count == 3 and message.endswith("waiting_timeout")
    await failover.aclose()


async def test_a_wrong_cached_token_is_read_again(workers) -> None:
    api, failover, _ = make_failover()
    for pod in decode_pods(workers):
        await failover.on_pod_event("ADDED", pod)
    failover._tokens[(NS, "demo-token")] = "stale"
    prefill = worker_pod(Role.prefill, ip="127.0.0.99")
    await failover.on_pod_event("ADDED", terminated(prefill))
    assert all(w.calls == [("127.0.0.99:8998", "prefill_pod_lost")] for w in workers)
    await failover.aclose()


async def test_a_prefill_unregistered_past_the_bound_gets_one_warning_per_episode(
    workers,
) -> None:
    api, failover, clock = make_failover(registration_warn_s=30)
    stuck, fine = workers
    stuck.health_reason = "unregistered: 1/2 ranks registered"
    for i, w in enumerate(workers):
        await failover.on_pod_event(
            "ADDED", worker_pod(Role.prefill, i, ip="127.0.0.1", http_port=w.port)
        )
    await failover.poll_all()
    assert "InstanceUnregistered" not in events(api)  # start-up takes a while: no alarm yet
    clock.now += 31
    await failover.poll_all()
    count, message = events(api)["InstanceUnregistered"]
    assert count == 1
    assert "prefill-0" in message and "unregistered: 1/2 ranks registered" in message
    clock.now += 60
    await failover.poll_all()
    assert events(api)["InstanceUnregistered"][0] == 1  # one Warning per episode
    # It registers; a later episode is a new problem and warns again.
    stuck.health_reason = None
    await failover.poll_all()
    stuck.health_reason = "unregistered: 1/2 ranks registered"
    await failover.poll_all()
    clock.now += 31
    await failover.poll_all()
    assert events(api)["InstanceUnregistered"][0] == 2
    await failover.aclose()
