"""Controller passes against an in-memory API: the I/O glue around the pure planner."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from pdcluster.operator.kube.client import ApiError
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.reconcile.controller import Controller
from pdcluster.operator.settings import OperatorSettings

from .helpers import NS, PD, FakeApi, body

KEY = (NS, "demo")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def make(spec=PD, resync: float = 60.0) -> tuple[FakeApi, Controller, Clock]:
    api, clock = FakeApi(), Clock()
    api.store.objects[("PDCluster", "demo")] = body(spec)
    settings = OperatorSettings(metrics_port=0, resync_interval_s=resync)
    recorder = EventRecorder(api, clock=clock, min_interval_s=30, host="test")
    return api, Controller(api, settings, OperatorMetrics(), recorder, clock=clock), clock


def reasons(api: FakeApi) -> dict[str, int]:
    return {e["reason"]: e["count"] for e in api.events()}


async def test_pass_creates_children_writes_status_once_and_then_rests() -> None:
    api, controller, clock = make()
    assert await controller.reconcile(KEY) == 60.0
    store = api.store
    assert store.names("Secret") == ["demo-token"]
    assert len(store.names("Pod")) == 2
    assert len(store.status_writes) == 1
    assert store.objects[("PDCluster", "demo")]["status"]["phase"] == "Pending"
    # The next pass sees the pods it created (Creating -> Starting): one more status write.
    clock.now += 1
    await controller.reconcile(KEY)
    assert len(store.status_writes) == 2
    writes_before = len(store.writes)
    clock.now += 1
    await controller.reconcile(KEY)
    # Nothing changed: no object writes, no status write.
    assert len(store.writes) == writes_before
    assert len(store.status_writes) == 2
    store.make_all_ready()
    await controller.reconcile(KEY)
    status = store.objects[("PDCluster", "demo")]["status"]
    assert status["phase"] == "Ready" and status["decode"]["summary"] == "1/1"
    assert len(store.status_writes) == 3
    assert reasons(api) == {"InstanceCreated": 1}


async def test_deleted_children_come_back_on_the_next_pass() -> None:
    api, controller, _ = make()
    await controller.reconcile(KEY)
    api.store.make_all_ready()
    await controller.reconcile(KEY)
    api.store.remove("ConfigMap", "demo-config")
    (pod,) = api.store.pods(role="prefill")
    api.store.remove("Pod", pod["metadata"]["name"])
    await controller.reconcile(KEY)
    assert api.store.get_obj("ConfigMap", "demo-config") is not None
    assert api.store.get_obj("Pod", pod["metadata"]["name"]) is not None


async def test_foreign_object_without_our_labels_is_found_by_name_and_refused() -> None:
    api, controller, clock = make()
    api.store.foreign("Service", "demo-router")  # no labels: only a GET by name finds it
    await controller.reconcile(KEY)
    assert api.store.get_obj("Service", "demo-router")["metadata"]["uid"] == "foreign-demo-router"
    status = api.store.objects[("PDCluster", "demo")]["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ForeignObject"
    # Every pass finds it again; the Event is counted, not repeated.
    for _ in range(5):
        clock.now += 40
        await controller.reconcile(KEY)
    foreign = [e for e in api.events() if e["reason"] == "ForeignObject"]
    assert len(foreign) == 1 and foreign[0]["count"] == 6


class RacingApi(FakeApi):
    """Someone else's object takes `name` between the pass's reads and its write."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__()
        self.target = (kind, name)

    def _race(self, manifest: Mapping[str, Any]) -> None:
        if (manifest["kind"], manifest["metadata"]["name"]) == self.target:
            self.store.foreign(*self.target)

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        self._race(manifest)
        return await super().apply(manifest)

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        self._race(manifest)
        return await super().create(manifest)


def make_racing(kind: str, name: str) -> tuple[RacingApi, Controller]:
    api, clock = RacingApi(kind, name), Clock()
    api.store.objects[("PDCluster", "demo")] = body(PD)
    recorder = EventRecorder(api, clock=clock, min_interval_s=30, host="test")
    settings = OperatorSettings(metrics_port=0)
    return api, Controller(api, settings, OperatorMetrics(), recorder, clock=clock)


async def test_an_object_appearing_before_its_create_is_never_taken_over() -> None:
    api, controller = make_racing("ConfigMap", "demo-config")
    await controller.reconcile(KEY)
    cm = api.store.objects[("ConfigMap", "demo-config")]
    assert (
        cm["metadata"]["uid"] == "foreign-demo-config" and "ownerReferences" not in cm["metadata"]
    )
    assert reasons(api).get("ForeignObject") == 1


async def test_an_owned_object_replaced_before_its_apply_is_never_taken_over() -> None:
    api, controller = make_racing("ConfigMap", "never")
    await controller.reconcile(KEY)
    owned = api.store.objects[("ConfigMap", "demo-config")]
    owned["metadata"]["annotations"]["pdcluster.io/applied-hash"] = "stale"
    api.target = ("ConfigMap", "demo-config")  # swapped for a foreign one before the apply
    await controller.reconcile(KEY)
    cm = api.store.objects[("ConfigMap", "demo-config")]
    assert (
        cm["metadata"]["uid"] == "foreign-demo-config" and "ownerReferences" not in cm["metadata"]
    )


async def test_a_foreign_secret_reference_is_refused_and_nothing_mounts_it() -> None:
    spec = {**PD, "auth": {"tokenSecretName": "sa-token-like"}}
    api, controller, clock = make(spec)
    api.store.foreign("Secret", "sa-token-like")  # exists, neither ours nor opted in
    assert await controller.reconcile(KEY) == 60.0  # re-checked at the resync
    assert api.store.names("Pod") == [] and api.store.names("Deployment") == []
    assert api.store.names("ConfigMap") == []
    assert reasons(api) == {"SecretNotAllowed": 1}
    degraded = condition(api, "Degraded")
    assert degraded["reason"] == "SecretNotAllowed" and "sa-token-like" in degraded["message"]
    # Opting in lets the next pass go ahead.
    api.store.objects[("Secret", "sa-token-like")]["metadata"]["labels"] = {
        "pdcluster.io/allow-reference": "true"
    }
    clock.now += 60
    await controller.reconcile(KEY)
    assert len(api.store.names("Pod")) == 2
    assert condition(api, "Degraded")["reason"] != "SecretNotAllowed"


async def test_an_image_outside_the_allowlist_creates_and_updates_nothing() -> None:
    api, controller, clock = make()
    await controller.reconcile(KEY)
    pods_before = api.store.names("Pod")
    api.store.objects[("PDCluster", "demo")]["spec"]["image"] = "evil.example/x:1"
    controller.settings = OperatorSettings(metrics_port=0, image_allowlist=("pdcluster",))
    writes_before = len(api.store.writes)
    clock.now += 1
    await controller.reconcile(KEY)
    assert api.store.names("Pod") == pods_before
    assert [w for w in api.store.writes[writes_before:] if w[1] != "Event"] == []
    assert condition(api, "Degraded")["reason"] == "ImageNotAllowed"
    assert "ImageNotAllowed" in reasons(api)


async def test_invalid_spec_changes_nothing_and_reports_why() -> None:
    api, controller, _ = make()
    await controller.reconcile(KEY)
    children = {k: v for k, v in api.store.objects.items() if k[0] not in ("PDCluster", "Event")}
    bad = body({"prefill": {}, "decode": {"topology": {"cp": 2}}}, generation=2)
    api.store.objects[("PDCluster", "demo")]["spec"] = bad["spec"]
    api.store.objects[("PDCluster", "demo")]["metadata"]["generation"] = 2
    assert await controller.reconcile(KEY) is None
    after = {k: v for k, v in api.store.objects.items() if k[0] not in ("PDCluster", "Event")}
    assert after == children
    status = api.store.objects[("PDCluster", "demo")]["status"]
    assert status["phase"] == "Failed" and status["observedGeneration"] == 2
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "cp must be 1" in degraded["message"]
    assert "InvalidSpec" in reasons(api)


async def test_back_off_deadline_is_the_next_requested_pass() -> None:
    api, controller, clock = make({"prefill": {"restart": {"backoffSeconds": 7}}, "decode": {}})
    await controller.reconcile(KEY)
    api.store.make_all_ready()
    await controller.reconcile(KEY)
    (pod,) = api.store.pods(role="prefill")
    api.store.set_pod(pod["metadata"]["name"], "Failed", False)
    delay = await controller.reconcile(KEY)
    assert delay == pytest.approx(7.0, abs=1.0)
    assert api.store.pods(role="prefill") == []
    status = api.store.objects[("PDCluster", "demo")]["status"]
    assert status["prefill"]["restarts"] == 1
    assert {e["reason"] for e in api.events()} >= {"InstanceRestarted"}
    clock.now += 8
    await controller.reconcile(KEY)
    assert len(api.store.pods(role="prefill")) == 1  # the ledger came back from the status


async def test_a_not_ready_grace_end_is_the_next_requested_pass() -> None:
    restart = {"notReadyGraceSeconds": 12}
    spec = {"prefill": {"topology": {"tp": 2}, "gpusPerPod": 1, "restart": restart}, "decode": {}}
    api, controller, clock = make(spec)
    for _ in range(3):  # the leaders, then the pods after them, then all Ready
        await controller.reconcile(KEY)
        api.store.make_all_ready()
    await controller.reconcile(KEY)
    assert api.store.objects[("PDCluster", "demo")]["status"]["phase"] == "Ready"
    (leader,) = api.store.pods(role="prefill", pod_index="0")
    api.store.now = clock.now  # the kubelet's clock: when the Ready condition turns False
    api.store.set_pod(leader["metadata"]["name"], "Running", False)
    delay = await controller.reconcile(KEY)
    assert delay == pytest.approx(12.0, abs=1.0)  # lastTransitionTime has whole seconds
    (inst,) = api.store.objects[("PDCluster", "demo")]["status"]["prefill"]["instances"]
    assert inst["health"] == "starting" and "unless Ready again" in inst["message"]
    assert [p["ranks"] for p in inst["pods"]] == [{"first": 0, "last": 0}, {"first": 1, "last": 1}]
    clock.now += 12
    await controller.reconcile(KEY)
    assert api.store.pods(role="prefill") == []  # the whole gang, as for a crash
    assert "InstanceRestarted" in reasons(api)
    assert api.store.objects[("PDCluster", "demo")]["status"]["prefill"]["restarts"] == 1


async def test_failed_write_asks_for_a_quick_retry_and_other_writes_still_happen() -> None:
    api, controller, _ = make()
    api.fail_next["create:ServiceAccount"] = ApiError(500, "InternalError", "etcd hiccup")
    delay = await controller.reconcile(KEY)
    assert delay is not None and delay < 5
    assert len(api.store.names("Pod")) == 2  # creates went ahead
    await controller.reconcile(KEY)
    assert api.store.names("ServiceAccount") == ["demo-runtime"]


def condition(api: FakeApi, kind: str) -> dict[str, Any]:
    status = api.store.objects[("PDCluster", "demo")]["status"]
    return next(c for c in status["conditions"] if c["type"] == kind)


async def test_refused_writes_back_off_emit_apply_failed_and_degrade_until_they_pass() -> None:
    api, controller, clock = make()
    quota = (
        "pods is forbidden: exceeded quota: tiny, requested: pods=1, used: pods=0, limited: pods=0"
    )
    api.fail_always["create:Pod"] = ApiError(403, "Forbidden", quota)
    delays = []
    for _ in range(8):
        delays.append(await controller.reconcile(KEY))
        clock.now += 1
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]  # capped at max_retry_delay_s
    (event,) = [e for e in api.events() if e["reason"] == "ApplyFailed"][:1]
    assert event["type"] == "Warning" and quota in event["message"]
    assert event["message"].startswith("create Pod/demo-")
    degraded = condition(api, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ApplyFailed"
    assert quota in degraded["message"] and "(and 1 more)" in degraded["message"]
    assert api.store.names("Pod") == []
    del api.fail_always["create:Pod"]
    assert await controller.reconcile(KEY) == 60.0
    assert len(api.store.names("Pod")) == 2
    assert condition(api, "Degraded")["reason"] != "ApplyFailed"
    api.fail_always["create:Pod"] = ApiError(403, "Forbidden", quota)
    api.store.objects.pop(("Pod", api.store.names("Pod")[0]))
    assert await controller.reconcile(KEY) == 2.0  # a success reset the back-off


async def test_read_failure_raises_for_the_queue_to_back_off() -> None:
    api, controller, _ = make()
    api.fail_next["list"] = ApiError(503, "ServiceUnavailable", "apiserver restarting")
    with pytest.raises(ApiError):
        await controller.reconcile(KEY)
    assert api.store.names("Pod") == []


async def test_deleted_or_deleting_cluster_is_left_to_the_garbage_collector() -> None:
    api, controller, _ = make()
    api.store.objects[("PDCluster", "demo")]["metadata"]["deletionTimestamp"] = (
        "2026-01-01T00:00:00Z"
    )
    assert await controller.reconcile(KEY) is None
    assert api.store.names("Pod") == []
    del api.store.objects[("PDCluster", "demo")]
    assert await controller.reconcile(KEY) is None


async def test_cluster_deleted_during_a_pass_ends_it_quietly() -> None:
    api, controller, _ = make()
    api.fail_next["patch_status"] = ApiError(404, "NotFound", "pdclusters demo not found")
    assert await controller.reconcile(KEY) == 60.0
    assert api.store.status_writes == []
