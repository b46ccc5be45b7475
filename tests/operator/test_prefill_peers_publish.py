"""The operator tells decode workers which prefill bootstrap servers they may contact."""

from __future__ import annotations

import asyncio
import base64
import copy
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdcluster.operator.failover.prefill_peers import compute_prefill_peers, decode_targets
from pdcluster.runtime.ports import free_port
from pdcluster.runtime.spec import Role

from .helpers import NS
from .podmaker import facts, terminated, worker_pod
from .served import serving
from .test_failover_io import TOKEN, make_failover


class FakeDecode:
    def __init__(self) -> None:
        self.port = free_port()
        self.sets: list[list[str]] = []
        self.refuse = 0  # answer 503 this many times first (a decode still loading)
        app = FastAPI()

        @app.put("/admin/prefill_peers")
        async def put(request: Request) -> JSONResponse:
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"error": {"message": "wrong token"}}, 403)
            if self.refuse:
                self.refuse -= 1
                return JSONResponse({"error": {"message": "loading"}}, 503)
            peers = (await request.json())["peers"]
            self.sets.append(peers)
            return JSONResponse({"peers": peers})

        self.app = app


@pytest.fixture
async def decode() -> AsyncIterator[FakeDecode]:
    d = FakeDecode()
    async with serving((d.app, d.port)):
        yield d


def test_the_set_is_every_running_prefill_of_the_cluster() -> None:
    p0 = facts(worker_pod(Role.prefill, 0, ip="10.0.0.1"))
    p1 = facts(worker_pod(Role.prefill, 1, ip="10.0.0.2"))
    gone = facts(terminated(worker_pod(Role.prefill, 2, ip="10.0.0.3")))
    no_ip = facts(worker_pod(Role.prefill, 3, ip=None))
    d0 = facts(worker_pod(Role.decode, 0, ip="10.0.1.1"))
    pending = facts(worker_pod(Role.decode, 1, ip="10.0.1.2", phase="Pending"))
    pods = [p0, p1, gone, no_ip, d0, pending]
    assert compute_prefill_peers(pods, p0.cluster_uid) == {"10.0.0.1:8998", "10.0.0.2:8998"}
    assert compute_prefill_peers(pods, "another-cluster") == frozenset()
    assert decode_targets(pods, p0.cluster_uid) == [d0]


async def test_pod_events_publish_the_set_and_a_loading_decode_is_asked_again(
    decode: FakeDecode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pdcluster.operator.failover.fast_path.PUBLISH_RETRY_S", 0.05)
    _, failover, _ = make_failover()
    decode.refuse = 2
    await failover.on_pod_event(
        "ADDED", worker_pod(Role.decode, 0, ip="127.0.0.1", http_port=decode.port)
    )
    prefill = worker_pod(Role.prefill, 0, ip="127.0.0.9")
    await failover.on_pod_event("ADDED", prefill)

    async def until(want: list[str]) -> None:
        deadline = time.monotonic() + 5
        while not decode.sets or decode.sets[-1] != want:
            assert time.monotonic() < deadline, decode.sets
            await asyncio.sleep(0.02)

    await until(["127.0.0.9:8998"])
    told = len(decode.sets)
    # Nothing changed: a pod event tells nobody again; a poll does.
    await failover.on_pod_event("MODIFIED", prefill)
    await asyncio.sleep(0.2)
    assert len(decode.sets) == told
    await failover.poll_all()
    await asyncio.sleep(0.2)
    assert len(decode.sets) == told + 1
    # The prefill dies: decode must not contact its address any more.
    await failover.on_pod_event("MODIFIED", terminated(prefill))
    await until([])
    await failover.aclose()


def foreign(pod: dict[str, Any], owner_uid: str = "uid-of-another-pdcluster") -> dict[str, Any]:
    """The pod with the cluster's labels, controlled by another PDCluster (another
    cluster's uid, or the same name deleted and created again), naming another Secret."""
    out = copy.deepcopy(pod)
    out["metadata"]["name"] = "a-" + out["metadata"]["name"]  # listed first
    out["metadata"]["uid"] = "uid-foreign-" + out["metadata"]["uid"]
    (ref,) = out["metadata"]["ownerReferences"]
    ref["uid"] = owner_uid
    for volume in out["spec"]["volumes"]:
        if "secret" in volume:
            volume["secret"]["secretName"] = "someone-elses-secret"
    return out


async def test_a_pod_owned_by_another_pdcluster_is_not_taken_for_the_clusters(
    decode: FakeDecode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod watch sees a pod by its labels; only one whose controller owner is the
    PDCluster those labels name (its uid) belongs to it. Another's would take the
    place of the cluster's own decodes when the prefill set is published, be sent a
    Secret its spec names, and have its losses reported."""
    monkeypatch.setattr("pdcluster.operator.failover.fast_path.PUBLISH_RETRY_S", 0.05)
    api, failover, _ = make_failover()
    api.store.objects[("Secret", "someone-elses-secret")] = {
        "kind": "Secret",
        "metadata": {"name": "someone-elses-secret", "namespace": NS},
        "data": {"token": base64.b64encode(b"not-this-clusters").decode()},
    }
    rogue = FakeDecode()
    async with serving((rogue.app, rogue.port)):
        own = worker_pod(Role.decode, 0, ip="127.0.0.1", http_port=decode.port)
        other = foreign(worker_pod(Role.decode, 1, ip="127.0.0.1", http_port=rogue.port))
        await failover.on_pod_event("ADDED", other)
        await failover.on_pod_event("ADDED", own)
        prefill = worker_pod(Role.prefill, 0, ip="127.0.0.9")
        await failover.on_pod_event("ADDED", prefill)
        deadline = time.monotonic() + 5
        while decode.sets[-1:] != [["127.0.0.9:8998"]]:
            assert time.monotonic() < deadline, (decode.sets, rogue.sets)
            await asyncio.sleep(0.02)
        assert rogue.sets == []
        assert [p.name for p in failover.index.pods(facts(own).key)] == [
            facts(own).name,
            facts(prefill).name,
        ]
        # Its loss is nobody's business here.
        assert await failover.on_pod_event("MODIFIED", terminated(other)) is None
        assert (
            failover.metrics.registry.get_sample_value("pdcluster_operator_foreign_pods_total") == 2
        )
    await failover.aclose()
