"""Which `gone` flag the failover fast path sends with fail_peer, and when.

`gone: true` only for a pod whose processes cannot run any more (exited, or
its object is gone); `gone: false` for a pod NotReady past the grace or
still terminating — a decode on shared memory then keeps the rooms' pages
until the peer acks. Such a pod is reported again with `gone: true` once it
is seen ended or gone, so no page waits forever on a pod that cannot ack.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.operator.failover.admin_client import AdminClient, AdminResult
from pdcluster.operator.failover.fast_path import Failover, is_peer_gone, is_settled_by
from pdcluster.operator.failover.losses import Loss, LossCause
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.settings import OperatorSettings
from pdcluster.runtime.ports import free_port
from pdcluster.runtime.spec import Role

from .helpers import NS, PD, FakeApi, body
from .podmaker import deleting, facts, not_ready, terminated, worker_pod
from .served import serving

TOKEN = "gone-flag-token"
PEER = "127.0.0.99:8998"

# ------------------------------------------------------------------ the decision, pure


@pytest.mark.parametrize(
    ("cause", "object_gone", "gone"),
    [
        (LossCause.failed, False, True),
        (LossCause.failed, True, True),
        (LossCause.deleted, True, True),
        # Deletion started: the processes may run until the kubelet kills them.
        (LossCause.deleted, False, False),
        (LossCause.not_ready, False, False),
    ],
)
def test_only_a_pod_that_cannot_run_is_gone(
    cause: LossCause, object_gone: bool, gone: bool
) -> None:
    pod = facts(worker_pod(Role.prefill))
    assert is_peer_gone(Loss(pod, cause, None), object_gone=object_gone) is gone


@pytest.mark.parametrize(
    ("make", "object_gone", "settled"),
    [
        (lambda p: p, False, False),
        (not_ready, False, False),
        (deleting, False, False),
        (terminated, False, True),
        (lambda p: deleting(terminated(p)), False, True),
        (deleting, True, True),
    ],
)
def test_a_maybe_alive_pod_is_settled_once_it_ended_or_is_gone(
    make: Any, object_gone: bool, settled: bool
) -> None:
    pod = facts(make(worker_pod(Role.prefill)))
    assert is_settled_by(pod, object_gone=object_gone) is settled


# ------------------------------------------------------------------ the calls, any event order


class RecordingAdmin(AdminClient):
    """Records fail_peer calls instead of sending them."""

    def __init__(self) -> None:  # no HTTP client: nothing is sent
        self.calls: list[tuple[str, str, bool]] = []
        self.incarnations: list[str | None] = []

    async def aclose(self) -> None:
        return None

    async def fail_peer(
        self,
        base_url: str,
        token: str | None,
        peer: str,
        reason: str,
        *,
        gone: bool = True,
        incarnation: str | None = None,
    ) -> AdminResult:
        self.calls.append((peer, reason, gone))
        self.incarnations.append(incarnation)
        return AdminResult(base_url, True, 200)

    async def failures(self, base_url: str, token: str | None) -> dict[str, int] | None:
        return {}

    async def prefill_peers(
        self, base_url: str, token: str | None, peers: list[Any]
    ) -> AdminResult:
        return AdminResult(base_url, True, 200)


def make_failover(admin: AdminClient, grace_s: float = 0.0) -> tuple[FakeApi, Failover]:
    api = FakeApi()
    api.store.objects[("PDCluster", "demo")] = body(PD)
    api.store.objects[("Secret", "demo-token")] = {
        "kind": "Secret",
        "metadata": {"name": "demo-token", "namespace": NS},
        "data": {"token": base64.b64encode(TOKEN.encode()).decode()},
    }
    settings_ = OperatorSettings(metrics_port=0, not_ready_grace_s=grace_s, admin_timeout_s=2.0)
    recorder = EventRecorder(api, clock=time.time, min_interval_s=30, host="test")
    return api, Failover(api, recorder, OperatorMetrics(), settings_, admin=admin)


STEPS = st.lists(st.sampled_from(["ready", "not_ready", "deleting", "terminated", "gone"]))


@settings(max_examples=60, deadline=None)
@given(steps=STEPS, planned=st.booleans())
def test_gone_is_sent_exactly_when_the_pod_cannot_run(steps: list[str], planned: bool) -> None:
    async def scenario() -> None:
        admin = RecordingAdmin()
        _, failover = make_failover(admin)
        await failover.on_pod_event("ADDED", worker_pod(Role.decode, ip="127.0.0.1"))
        pod = worker_pod(Role.prefill, ip="127.0.0.99")
        await failover.on_pod_event("ADDED", pod)
        if planned:
            failover.expect_deletion(pod["metadata"]["uid"])
        is_deleting = has_ended = is_gone = False
        for step in steps:
            if step == "ready" and not (is_deleting or has_ended):
                current = pod
            elif step == "not_ready" and not has_ended:
                current = not_ready(pod)
            elif step == "deleting":
                is_deleting = True
                current = pod if not has_ended else terminated(pod)
            elif step == "terminated":
                has_ended = True
                current = terminated(pod)
            elif step == "gone":
                is_gone = True
                current = terminated(pod) if has_ended else pod
            else:
                continue
            if is_deleting:
                current = deleting(current)
            before = len(admin.calls)
            await failover.on_pod_event("DELETED" if is_gone else "MODIFIED", current)
            for _, _, gone in admin.calls[before:]:
                # `gone: true` is never sent while the pod's processes may still run.
                assert not gone or has_ended or is_gone, (steps, admin.calls)
            if is_gone:
                break
        if has_ended or is_gone:
            # It cannot ack any more: the last word the peers heard is "gone".
            assert admin.calls and admin.calls[-1][2] is True, (steps, admin.calls)
        assert all(peer == PEER for peer, _, _ in admin.calls)
        await failover.aclose()

    asyncio.run(scenario())


# ------------------------------------------------------------------ over HTTP


@dataclass
class BodyWorker:
    """A worker's admin API that keeps every fail_peer body as sent."""

    port: int
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/admin/fail_peer")
        async def fail_peer(request: Request) -> JSONResponse:
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"error": {"message": "wrong token"}}, 403)
            data = await request.json()
            self.bodies.append(data)
            return JSONResponse(data)

        @app.get("/admin/failures")
        async def failures() -> JSONResponse:
            return JSONResponse({"failures": {}})

        return app


@pytest.fixture
async def worker() -> AsyncIterator[BodyWorker]:
    w = BodyWorker(free_port())
    async with serving((w.app(), w.port)):
        yield w


@contextlib.asynccontextmanager
async def started(
    worker: BodyWorker, grace_s: float = 0.0
) -> AsyncIterator[tuple[Failover, dict[str, Any]]]:
    """A failover that knows one decode (the worker) and one prefill pod."""
    _, failover = make_failover(AdminClient(2.0), grace_s)
    try:
        await failover.on_pod_event(
            "ADDED", worker_pod(Role.decode, ip="127.0.0.1", http_port=worker.port)
        )
        prefill = worker_pod(Role.prefill, ip="127.0.0.99")
        await failover.on_pod_event("ADDED", prefill)
        yield failover, prefill
    finally:
        await failover.aclose()


def flags(worker: BodyWorker) -> list[bool]:
    assert all(b["peer"] == PEER and b["reason"] == "prefill_pod_lost" for b in worker.bodies)
    return [b["gone"] for b in worker.bodies]


async def test_an_exited_pod_is_reported_gone(worker: BodyWorker) -> None:
    async with started(worker) as (failover, prefill):
        await failover.on_pod_event("MODIFIED", terminated(prefill))
        await failover.on_pod_event("DELETED", deleting(terminated(prefill)))
        assert flags(worker) == [True]


async def test_a_not_ready_pod_may_resume_and_is_then_forgotten(worker: BodyWorker) -> None:
    async with started(worker) as (failover, prefill):
        await failover.on_pod_event("MODIFIED", not_ready(prefill))
        assert flags(worker) == [False]
        # Ready again: it acks its rooms itself; nothing more to say.
        await failover.on_pod_event("MODIFIED", prefill)
        await failover.on_pod_event("MODIFIED", prefill)
        assert flags(worker) == [False]
        # A later death is a new loss, and a definitive one.
        await failover.on_pod_event("MODIFIED", terminated(prefill))
        assert flags(worker) == [False, True]


async def test_a_hung_pod_that_is_deleted_is_gone_once_its_object_is(
    worker: BodyWorker,
) -> None:
    async with started(worker) as (failover, prefill):
        await failover.on_pod_event("MODIFIED", not_ready(prefill))
        # Deleted while hung: terminating, it may still run until the kubelet kills it.
        await failover.on_pod_event("MODIFIED", deleting(not_ready(prefill)))
        assert flags(worker) == [False, False]
        await failover.on_pod_event("DELETED", deleting(not_ready(prefill)))
        assert flags(worker) == [False, False, True]
        # Replays change nothing.
        await failover.on_pod_event("DELETED", deleting(not_ready(prefill)))
        assert flags(worker) == [False, False, True]


async def test_a_terminating_pod_is_settled_when_its_container_exits(
    worker: BodyWorker,
) -> None:
    async with started(worker) as (failover, prefill):
        await failover.on_pod_event("MODIFIED", deleting(prefill))
        assert flags(worker) == [False]
        await failover.on_pod_event("MODIFIED", deleting(terminated(prefill)))
        assert flags(worker) == [False, True]
        await failover.on_pod_event("DELETED", deleting(terminated(prefill)))
        assert flags(worker) == [False, True]


async def test_a_not_ready_pod_past_the_grace_is_reported_maybe_alive(
    worker: BodyWorker,
) -> None:
    async with started(worker, grace_s=0.2) as (failover, prefill):
        await failover.on_pod_event("MODIFIED", not_ready(prefill))
        assert worker.bodies == []
        deadline = time.monotonic() + 5
        while not worker.bodies:
            assert time.monotonic() < deadline, "the grace timer never fired"
            await asyncio.sleep(0.02)
        assert flags(worker) == [False]
