from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.router.discovery import (
    KubernetesDiscoverySettings,
    PodCache,
    decide_pod,
    static_targets,
    targets_from_pods,
)
from pdcluster.runtime.router.workers import KVEventPorts, WorkerTarget
from pdcluster.runtime.spec import Role

SETTINGS = KubernetesDiscoverySettings(namespace="ns", label_selector="pdcluster.io/cluster=demo")


def pod(
    name: str = "demo-prefill-0",
    role: str | None = "prefill",
    ip: str | None = "10.0.0.7",
    ready: str = "True",
    phase: str = "Running",
    port: Any = None,
    index: str | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    labels: dict[str, str] = {"pdcluster.io/cluster": "demo"}
    if role is not None:
        labels["pdcluster.io/role"] = role
    if index is not None:
        labels["pdcluster.io/pod-index"] = index
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": labels, "annotations": {}}
    if port is not None:
        meta["annotations"]["pdcluster.io/http-port"] = port
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": ready},
        ],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_static_targets_keep_roles_and_normalize_urls() -> None:
    targets = static_targets(["http://127.0.0.1:1/"], ["http://127.0.0.1:2", "http://127.0.0.1:3"])
    assert targets == [
        WorkerTarget("http://127.0.0.1:1", Role.prefill),
        WorkerTarget("http://127.0.0.1:2", Role.decode),
        WorkerTarget("http://127.0.0.1:3", Role.decode),
    ]
    assert static_targets(colocated=["http://127.0.0.1:4"]) == [
        WorkerTarget("http://127.0.0.1:4", Role.colocated)
    ]


@pytest.mark.parametrize(
    ("prefill", "decode", "colocated", "problem"),
    [
        ([], [], [], "no workers"),
        (["http://127.0.0.1:1"], [], [], "at least one decode"),
        ([], ["http://127.0.0.1:1"], [], "at least one prefill"),
        (["http://127.0.0.1:1"], ["http://127.0.0.1:2"], ["http://127.0.0.1:3"], "not both"),
        (["http://127.0.0.1:1"], ["http://127.0.0.1:1/"], [], "listed twice"),
        (["127.0.0.1:1"], ["http://127.0.0.1:2"], [], "http://"),
    ],
)
def test_static_targets_reject_bad_lists(
    prefill: list[str], decode: list[str], colocated: list[str], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        static_targets(prefill, decode, colocated)


def test_ready_pod_becomes_a_worker_at_its_pod_ip() -> None:
    decision = decide_pod(pod(port="30000"), SETTINGS)
    assert decision.target == WorkerTarget("http://10.0.0.7:30000", Role.prefill)
    assert decision.reason == ""


def test_default_port_is_used_when_the_pod_names_none() -> None:
    target = decide_pod(pod(role="decode"), SETTINGS).target
    assert target == WorkerTarget("http://10.0.0.7:8000", Role.decode)


def test_port_may_also_come_from_a_label() -> None:
    p = pod()
    p["metadata"]["labels"]["pdcluster.io/http-port"] = "31000"
    assert decide_pod(p, SETTINGS).target == WorkerTarget("http://10.0.0.7:31000", Role.prefill)


def test_ipv6_pod_ip_is_bracketed() -> None:
    target = decide_pod(pod(ip="fd00::7", port=8000), SETTINGS).target
    assert target is not None and target.url == "http://[fd00::7]:8000"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"ready": "False"}, "not Ready"),
        ({"ready": "Unknown"}, "not Ready"),
        ({"phase": "Pending"}, "phase"),
        ({"ip": None}, "no pod IP"),
        ({"role": None}, "not a worker role"),
        ({"role": "router"}, "not a worker role"),
        ({"deleting": True}, "terminating"),
        ({"index": "1"}, "does not serve HTTP"),
        ({"port": "http"}, "not a port"),
        ({"port": "70000"}, "not a port"),
    ],
)
def test_pods_that_are_not_workers_say_why(kwargs: dict[str, Any], reason: str) -> None:
    decision = decide_pod(pod(**kwargs), SETTINGS)
    assert decision.target is None
    assert reason in decision.reason
    assert decision.name == "demo-prefill-0"


def test_pod_without_conditions_is_not_ready() -> None:
    p = pod()
    del p["status"]["conditions"]
    assert decide_pod(p, SETTINGS).reason == "not Ready"


def test_no_default_port_and_no_annotation_skips_the_pod() -> None:
    settings = KubernetesDiscoverySettings(namespace="ns", default_port=None)
    assert "no default port" in decide_pod(pod(), settings).reason


def test_leader_pod_of_a_multi_pod_instance_is_the_worker() -> None:
    assert decide_pod(pod(index="0"), SETTINGS).target is not None


def test_garbage_objects_are_skipped_not_crashed_on() -> None:
    for garbage in ({}, {"metadata": "x", "status": 3}, {"metadata": {"labels": []}}):
        assert decide_pod(garbage, SETTINGS).target is None


def test_targets_from_pods_keeps_ready_workers_and_dedupes_urls() -> None:
    pods = [
        pod("p0", ip="10.0.0.1"),
        pod("p1", ip="10.0.0.2", ready="False"),
        pod("d0", role="decode", ip="10.0.0.3"),
        pod("d0-dup", role="decode", ip="10.0.0.3"),
    ]
    assert targets_from_pods(pods, SETTINGS) == [
        WorkerTarget("http://10.0.0.1:8000", Role.prefill),
        WorkerTarget("http://10.0.0.3:8000", Role.decode),
    ]


def test_pod_cache_follows_watch_events() -> None:
    cache = PodCache()
    cache.replace([pod("p0", ip="10.0.0.1")])
    assert cache.apply("ADDED", pod("d0", role="decode", ip="10.0.0.2")) is True
    # The same object again changes nothing (no needless pool syncs).
    assert cache.apply("MODIFIED", pod("d0", role="decode", ip="10.0.0.2")) is False
    assert cache.apply("MODIFIED", pod("d0", role="decode", ip="10.0.0.2", ready="False"))
    assert [t.url for t in targets_from_pods(cache.pods(), SETTINGS)] == ["http://10.0.0.1:8000"]
    assert cache.apply("DELETED", pod("p0")) is True
    assert cache.apply("DELETED", pod("p0")) is False
    assert cache.apply("BOOKMARK", pod("x")) is False
    assert len(cache) == 1


def test_relist_forgets_pods_deleted_while_the_watch_was_down() -> None:
    cache = PodCache()
    cache.replace([pod("p0"), pod("p1", ip="10.0.0.9")])
    cache.replace([pod("p1", ip="10.0.0.9")])
    assert [t.url for t in targets_from_pods(cache.pods(), SETTINGS)] == ["http://10.0.0.9:8000"]


@settings(deadline=None)  # CPU-bound; a loaded CI machine must not flake
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["ADDED", "MODIFIED", "DELETED"]),
            st.integers(0, 4),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_pod_cache_matches_a_replay_of_the_events(events: list[tuple[str, int, bool]]) -> None:
    cache = PodCache()
    expected: dict[str, dict[str, Any]] = {}
    for kind, i, ready in events:
        obj = pod(f"p{i}", ip=f"10.0.0.{i + 1}", ready="True" if ready else "False")
        cache.apply(kind, copy.deepcopy(obj))
        if kind == "DELETED":
            expected.pop(obj["metadata"]["name"], None)
        else:
            expected[obj["metadata"]["name"]] = obj
    want = sorted(t.url for t in targets_from_pods(expected.values(), SETTINGS))
    assert sorted(t.url for t in targets_from_pods(cache.pods(), SETTINGS)) == want


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"namespace": ""}, "namespace"),
        ({"default_port": 0}, "default_port"),
        ({"scheme": "grpc"}, "scheme"),
        ({"relist_interval_s": 0}, "relist_interval_s"),
    ],
)
def test_discovery_settings_are_validated(kwargs: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        KubernetesDiscoverySettings(**kwargs)


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        (
            {"pdcluster.io/kv-events-port": "5557", "pdcluster.io/kv-replay-port": "5558"},
            (5557, 5558),
        ),
        ({}, None),
        ({"pdcluster.io/kv-events-port": "5557"}, None),
        ({"pdcluster.io/kv-events-port": "5557", "pdcluster.io/kv-replay-port": "5557"}, None),
        ({"pdcluster.io/kv-events-port": "x", "pdcluster.io/kv-replay-port": "5558"}, None),
        ({"pdcluster.io/kv-events-port": "0", "pdcluster.io/kv-replay-port": "5558"}, None),
        ({"pdcluster.io/kv-events-port": "5557", "pdcluster.io/kv-replay-port": "70000"}, None),
    ],
)
def test_a_pods_event_ports_come_from_its_annotations_or_it_goes_by_load(
    annotations: dict[str, str], expected: tuple[int, int] | None
) -> None:
    p = pod()
    p["metadata"]["annotations"].update(annotations)
    target = decide_pod(p, SETTINGS).target
    assert target is not None, "bad event ports never keep a serving pod out of the pool"
    assert target.kv_events == (None if expected is None else KVEventPorts(*expected))


def test_static_kv_events_attach_to_their_listed_worker_only() -> None:
    ports = KVEventPorts(5557, 5558)
    targets = static_targets(
        colocated=["http://127.0.0.1:1", "http://127.0.0.1:2"],
        kv_events={"http://127.0.0.1:2/": ports},
    )
    assert [t.kv_events for t in targets] == [None, ports]
    with pytest.raises(ValueError, match="not a listed worker"):
        static_targets(colocated=["http://127.0.0.1:1"], kv_events={"http://127.0.0.1:3": ports})
