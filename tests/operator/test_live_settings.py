"""The router's live settings: left out of the hashes, diffed, and put to its running pods."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pdcluster.operator import names
from pdcluster.operator.failover.admin_client import AdminClient
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.reconcile.controller import Controller
from pdcluster.operator.reconcile.live_settings import (
    compute_cache_aware_roles,
    compute_live_changes,
    compute_router_live_settings,
)
from pdcluster.operator.reconcile.revision import (
    _canonical,
    _digest,
    compute_cluster_revision,
    compute_router_hash,
    compute_template_hash,
)
from pdcluster.operator.reconcile.router_targets import (
    RouterPod,
    plan_router_pushes,
    router_pods,
)
from pdcluster.operator.reconcile.settings_push import RETRY_S, RouterSettingsPusher
from pdcluster.operator.settings import OperatorSettings
from pdcluster.runtime.router.live_settings import RouterLiveSettings
from pdcluster.runtime.spec import PDClusterSpec, Role

from .helpers import NS, PD, FakeApi, body, make_cluster

COLOCATED = {"colocated": {}}
# Each live leaf, as a manifest patch of `router`, and the path the diff names.
LIVE_CHANGES = [
    ({"policy": {"prefill": "least_outstanding"}}, "router.policy.prefill"),
    ({"policy": {"decode": "random"}}, "router.policy.decode"),
    ({"policy": {"maxLoadGap": 9}}, "router.policy.maxLoadGap"),
    ({"healthCheckIntervalSeconds": 0.5}, "router.healthCheckIntervalSeconds"),
]


def spec_of(base: dict[str, Any], router: dict[str, Any] | None = None, **rest: Any) -> Any:
    return make_cluster({**base, "router": router or {}, **rest}).spec


def router_hash_before_live_settings(spec: PDClusterSpec) -> str:
    """The router hash as computed before any router setting was live."""
    return _digest(
        {
            "revision": compute_cluster_revision(spec),
            "router": _canonical(spec.router, exclude={"replicas", "disruption_budget"}),
            "disaggregated": spec.is_disaggregated,
        }
    )


@pytest.mark.parametrize("base", [PD, COLOCATED], ids=["pd", "colocated"])
@pytest.mark.parametrize(
    "router",
    [{}, {"replicas": 2, "requestTimeoutSeconds": 30}, {"healthCheckIntervalSeconds": 2.0}],
)
def test_an_operator_upgrade_keeps_the_router_hash_while_live_fields_are_defaults(
    base: dict[str, Any], router: dict[str, Any]
) -> None:
    spec = spec_of(base, router)
    assert compute_router_hash(spec) == router_hash_before_live_settings(spec)


@pytest.mark.parametrize("base", [PD, COLOCATED], ids=["pd", "colocated"])
@pytest.mark.parametrize(("patch", "path"), LIVE_CHANGES)
def test_a_live_change_rolls_no_pod_and_is_named_alone(
    base: dict[str, Any], patch: dict[str, Any], path: str
) -> None:
    old, new = spec_of(base), spec_of(base, patch)
    assert compute_router_hash(new) == compute_router_hash(old)
    assert compute_cluster_revision(new) == compute_cluster_revision(old)
    for role in (Role.prefill, Role.decode) if "prefill" in base else (Role.colocated,):
        assert compute_template_hash(new, role) == compute_template_hash(old, role)
    before, after = compute_router_live_settings(old), compute_router_live_settings(new)
    changes = compute_live_changes(before, after)
    assert [c.split(":")[0] for c in changes] == [path]
    assert compute_live_changes(after, after) == ()
    assert compute_live_changes(before, after) != compute_live_changes(after, before)


def test_every_live_field_is_named_when_nothing_was_in_force() -> None:
    changes = compute_live_changes(None, compute_router_live_settings(spec_of(PD)))
    assert [c.split(":")[0] for c in changes] == sorted(path for _, path in LIVE_CHANGES)
    assert "router.policy.decode: round_robin" in changes


def test_two_live_fields_changed_at_once_are_both_named_in_order() -> None:
    old = compute_router_live_settings(spec_of(PD))
    new = compute_router_live_settings(
        spec_of(PD, {"policy": {"decode": "random", "maxLoadGap": 0}})
    )
    assert compute_live_changes(old, new) == (
        "router.policy.decode: round_robin -> random",
        "router.policy.maxLoadGap: 4 -> 0",
    )


@pytest.mark.parametrize(
    ("base", "router", "roles"),
    [
        (PD, {"policy": {"prefill": "cache_aware"}}, ["prefill"]),
        (PD, {"policy": {"decode": "cache_aware"}}, ["decode"]),
        (
            PD,
            {"policy": {"prefill": "cache_aware", "decode": "cache_aware"}},
            ["prefill", "decode"],
        ),
        (COLOCATED, {"policy": {"decode": "cache_aware"}}, ["colocated"]),
        # A colocated router has no prefill workers: its prefill policy is never used.
        (COLOCATED, {"policy": {"prefill": "cache_aware"}}, []),
    ],
)
def test_a_change_of_the_roles_cache_aware_follows_still_rolls_the_router(
    base: dict[str, Any], router: dict[str, Any], roles: list[str]
) -> None:
    spec = spec_of(base, router)
    assert compute_cache_aware_roles(spec) == roles
    assert (compute_router_hash(spec) == compute_router_hash(spec_of(base))) is (not roles)


@pytest.mark.parametrize(
    ("patch", "rolls_workers"),
    [
        ({"router": {"requestTimeoutSeconds": 30}}, False),
        ({"router": {"service": {"port": 9000}}}, False),
        ({"image": "pdcluster:0.2.0"}, True),
        # The workers' transfer numbers are not live: they roll the workers (and the router).
        ({"transfer": {"heartbeat": {"intervalSeconds": 1}}}, True),
        ({"transfer": {"waitingTimeoutSeconds": 5}}, True),
    ],
)
def test_a_change_that_is_not_live_still_rolls(patch: dict[str, Any], rolls_workers: bool) -> None:
    old, new = spec_of(PD), make_cluster({**PD, **patch}).spec
    assert compute_router_hash(new) != compute_router_hash(old)
    assert (compute_cluster_revision(new) != compute_cluster_revision(old)) is rolls_workers
    assert (
        compute_live_changes(compute_router_live_settings(old), compute_router_live_settings(new))
        == ()
    )


def router_pod(
    name: str = "demo-router-a",
    *,
    cluster: str = "demo",
    spec: Any = None,
    ready: bool = True,
    ip: str | None = "10.1.0.9",
    deleting: bool = False,
    router_hash: str | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "uid": f"uid-{name}",
        "labels": {**names.cluster_labels(cluster), names.LABEL_ROLE: "router"},
        "annotations": {
            "pdcluster.io/router-hash": router_hash or compute_router_hash(spec or spec_of(PD))
        },
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "metadata": meta, "status": status}


def test_settings_go_to_ready_router_pods_of_the_current_hash_only() -> None:
    current = compute_router_hash(spec_of(PD))
    pods = [
        router_pod("demo-router-b"),
        router_pod("demo-router-a"),
        router_pod("not-ready", ready=False),
        router_pod("no-ip", ip=None),
        router_pod("leaving", deleting=True),
        router_pod("old-hash", router_hash="0ld0ld00"),
        router_pod("other-cluster", cluster="other"),
        {**router_pod("a-worker"), "metadata": {**router_pod()["metadata"], "labels": {}}},
    ]
    found = router_pods(pods, "demo", current)
    assert [p.name for p in found] == ["demo-router-a", "demo-router-b"]
    assert found[0] == RouterPod("demo-router-a", "uid-demo-router-a", "http://10.1.0.9:8000")
    settings = compute_router_live_settings(spec_of(PD))
    other = compute_router_live_settings(spec_of(PD, {"policy": {"decode": "random"}}))
    assert plan_router_pushes(found, {}, settings) == found
    accepted = {"uid-demo-router-a": settings, "uid-demo-router-b": other}
    assert [p.name for p in plan_router_pushes(found, accepted, settings)] == ["demo-router-b"]


class Routers:
    """Router pods' `PUT /admin/settings`, answering with a status per pod IP."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.calls: list[tuple[str, dict[str, Any], str]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.method == "PUT" and request.url.path == "/admin/settings"
        body = json.loads(request.content)
        RouterLiveSettings.model_validate(body)  # what a router would validate
        self.calls.append((request.url.host, body, request.headers.get("authorization", "")))
        status = self.status.get(request.url.host, 200)
        return httpx.Response(status, json={"error": "refused"} if status >= 400 else body)


def make_controller(routers: Routers) -> tuple[FakeApi, Controller]:
    api = FakeApi()
    api.store.objects[("PDCluster", "demo")] = body(PD)
    recorder = EventRecorder(api, clock=lambda: 1_000_000.0, min_interval_s=30, host="test")
    admin = AdminClient(2.0, transport=httpx.MockTransport(routers.handler))

    async def token_for(namespace: str, secret: str | None) -> str | None:
        assert (namespace, secret) == (NS, "demo-token")
        return "cluster-token"

    controller = Controller(
        api,
        OperatorSettings(metrics_port=0, resync_interval_s=60.0),
        OperatorMetrics(),
        recorder,
        router_settings=RouterSettingsPusher(admin, recorder),
        token_for=token_for,
    )
    return api, controller


def events(api: FakeApi, reason: str) -> list[str]:
    return [e["message"] for e in api.events() if e["reason"] == reason]


async def test_a_policy_change_is_pushed_to_each_router_pod_once_with_an_event() -> None:
    routers = Routers()
    api, controller = make_controller(routers)
    key = (NS, "demo")
    for name, ip in (("demo-router-a", "10.1.0.1"), ("demo-router-b", "10.1.0.2")):
        api.store.objects[("Pod", name)] = router_pod(name, ip=ip)
    assert await controller.reconcile(key) == 60.0
    # Pods never told get the settings once (an operator restart): no Event, nothing changed.
    assert sorted(host for host, _, _ in routers.calls) == ["10.1.0.1", "10.1.0.2"]
    assert {auth for _, _, auth in routers.calls} == {"Bearer cluster-token"}
    assert events(api, "SettingsApplied") == []
    await controller.reconcile(key)
    assert len(routers.calls) == 2  # told already: no call

    new = {**PD, "router": {"policy": {"decode": "random"}, "healthCheckIntervalSeconds": 1}}
    api.store.objects[("PDCluster", "demo")] = body(new, generation=2)
    routers.calls.clear()
    assert await controller.reconcile(key) == 60.0
    assert len(routers.calls) == 2
    assert {json.dumps(b, sort_keys=True) for _, b, _ in routers.calls} == {
        json.dumps(
            {
                "healthCheckIntervalSeconds": 1.0,
                "policy": {"decode": "random", "maxLoadGap": 4, "prefill": "round_robin"},
            },
            sort_keys=True,
        )
    }
    assert events(api, "SettingsApplied") == [
        "router.healthCheckIntervalSeconds: 2.0 -> 1.0; "
        "router.policy.decode: round_robin -> random "
        "(in force on demo-router-a, demo-router-b, no restart)"
    ]
    # The router Deployment was not rolled: its template hash is what it was.
    deployment = api.store.objects[("Deployment", "demo-router")]
    template = deployment["spec"]["template"]["metadata"]["annotations"]
    assert template["pdcluster.io/router-hash"] == compute_router_hash(spec_of(PD))


async def test_a_refusing_pod_is_named_and_an_unanswering_one_is_asked_again_soon() -> None:
    routers = Routers()
    api, controller = make_controller(routers)
    key = (NS, "demo")
    for name, ip in (("demo-router-a", "10.1.0.1"), ("demo-router-b", "10.1.0.2")):
        api.store.objects[("Pod", name)] = router_pod(name, ip=ip)
    routers.status = {"10.1.0.1": 400, "10.1.0.2": 503}
    assert await controller.reconcile(key) == RETRY_S
    assert events(api, "SettingsRefused") == [
        'router pod demo-router-a refused the live settings: HTTP 400 {"error":"refused"}'
    ]
    routers.status = {}
    routers.calls.clear()
    assert await controller.reconcile(key) == 60.0
    assert sorted(host for host, _, _ in routers.calls) == ["10.1.0.1", "10.1.0.2"]
    routers.calls.clear()
    await controller.reconcile(key)
    assert routers.calls == []
