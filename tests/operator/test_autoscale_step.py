"""One autoscaling interval end to end in pure code: real worker /metrics text in,
replicas patches, Events and status.<role>.autoscaling out."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import generate_latest

from pdcluster.operator.api import PDClusterStatus, RoleAutoscalingStatus, RoleStatus, parse_status
from pdcluster.operator.autoscale.step import (
    FIRST_INTERVAL,
    AutoscaleHistory,
    AutoscaleStep,
    PodScrape,
    compute_autoscale_step,
    roles_due,
)
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.spec import Role

from .helpers import AUTOSCALING_DECISION, make_cluster

P, D = Role.prefill, Role.decode
INTERVAL = 15.0


def autoscaling(metric: str, target: float, **extra: Any) -> dict[str, Any]:
    return {
        "minReplicas": 1,
        "maxReplicas": 2,
        "intervalSeconds": INTERVAL,
        "target": {"metric": metric, "value": target},
        **extra,
    }


class Trace:
    """A PDCluster whose instances are real WorkerMetrics; each step scrapes their text,
    runs the step, and applies its patches (a new instance is Ready at the next step)."""

    def __init__(
        self,
        spec: dict[str, Any],
        patch_of: Callable[[AutoscaleStep], dict[str, Any]] | None = None,
    ) -> None:
        # How the loop turns a step into its status write.
        self.patch_of = patch_of or AutoscaleStep.status_patch
        self.spec = copy.deepcopy(spec)
        self.history = AutoscaleHistory()
        self.status = PDClusterStatus()
        self.workers: dict[Role, list[WorkerMetrics]] = {
            role: [WorkerMetrics(role.value) for _ in range(self.spec[role.value]["replicas"])]
            for role in (P, D)
        }

    def replicas(self, role: Role) -> int:
        return int(self.spec[role.value]["replicas"])

    def step(self, now: float) -> AutoscaleStep:
        roles = {
            role: RoleStatus(desired=self.replicas(role), ready=len(self.workers[role]))
            for role in (P, D)
        }
        stored = self.status.model_copy(
            update={
                role.value: roles[role].model_copy(
                    update={"autoscaling": _autoscaling_of(self.status, role)}
                )
                for role in (P, D)
            }
        )
        scrapes = {
            role: {
                f"demo-{role.value}-{i}-h-0": PodScrape(generate_latest(w.registry).decode(), now)
                for i, w in enumerate(self.workers[role])
            }
            for role in (P, D)
        }
        out = compute_autoscale_step(make_cluster(self.spec), stored, scrapes, self.history, now)
        for patch in out.patches:
            self.spec[patch.role.value]["replicas"] = patch.replicas
        self.history = out.history
        # The status as the apiserver would store it after the merge patch.
        wire = stored.to_wire()
        for role, body in self.patch_of(out)["status"].items():
            wire[role]["autoscaling"] = body["autoscaling"]
        self.status = parse_status(wire)
        for role in (P, D):
            workers = self.workers[role]
            while len(workers) > self.replicas(role):
                workers.pop()
            while len(workers) < self.replicas(role):
                workers.append(WorkerMetrics(role.value))
        return out


def _autoscaling_of(status: PDClusterStatus, role: Role) -> RoleAutoscalingStatus | None:
    stored = status.role(role.value)
    return stored.autoscaling if stored is not None else None


def test_a_ttft_step_up_scales_prefill_after_the_up_window() -> None:
    spec = {
        "prefill": {
            "replicas": 1,
            "autoscaling": autoscaling("ttftP90Seconds", 0.5, scaleUp={"stabilizationSeconds": 30}),
        },
        "decode": {"replicas": 1},
    }
    trace = Trace(spec)
    steps: dict[float, AutoscaleStep] = {}
    for k in range(5):
        now = k * INTERVAL
        latency = 0.1 if now < 30 else 2.0  # the load step lands at t=30
        for w in trace.workers[P]:
            for _ in range(10):
                w.ttft_seconds.observe(latency)
        steps[now] = trace.step(now)
    # t=0 first scrape (no p90 yet), t=15 fast, t=30 and t=45 slow inside the 30 s window.
    assert [steps[t].patches for t in (0.0, 15.0, 30.0, 45.0)] == [(), (), (), ()]
    up = steps[60.0]
    assert [(p.role, p.replicas) for p in up.patches] == [(P, 2)]
    (event,) = up.events
    assert (event.type, event.reason) == ("Normal", "ScaledUp")
    assert event.message.startswith("prefill 1 -> 2: ttftP90Seconds 2.35 vs target 0.5")
    status = up.statuses[P]
    assert status is not None
    assert (status.metric, status.target, status.current, status.desired) == (
        "ttftP90Seconds",
        0.5,
        1,
        2,
    )
    assert status.reason == "ScaleUp" and status.last_value == pytest.approx(2.35)
    assert status.last_decision_time == status.last_scale_time == "1970-01-01T00:01:00Z"
    assert trace.replicas(P) == 2
    # Stored and read back: the status model keeps what the step wrote.
    assert _autoscaling_of(trace.status, P) == status
    # At the cap: the next intervals hold at maxReplicas, the scale time stays.
    later = trace.step(75.0).statuses[P]
    assert (
        later is not None and later.desired == 2 and later.last_scale_time == "1970-01-01T00:01:00Z"
    )


def test_a_load_drop_scales_decode_down_after_the_down_window() -> None:
    spec = {
        "prefill": {"replicas": 1},
        "decode": {
            "replicas": 2,
            "autoscaling": autoscaling(
                "runningRequestsPerInstance", 4, scaleDown={"stabilizationSeconds": 60}
            ),
        },
    }
    trace = Trace(spec)
    downs: list[tuple[float, AutoscaleStep]] = []
    for k in range(7):
        now = k * INTERVAL
        for w in trace.workers[D]:
            w.requests_in_flight.set(4 if now < 15 else 1)
        out = trace.step(now)
        if out.patches:
            downs.append((now, out))
    # Low from t=15: the highest recommendation of the last 60 s is 1 from t=75.
    ((at, out),) = downs
    assert at == 75.0
    assert [(p.role, p.replicas, p.body()) for p in out.patches] == [
        (D, 1, {"spec": {"decode": {"replicas": 1}}})
    ]
    (event,) = out.events
    assert event.reason == "ScaledDown"
    assert event.message.startswith("decode 2 -> 1: runningRequestsPerInstance 1 vs target 4")
    assert out.statuses[D] is not None and out.statuses[D].reason == "ScaleDown"
    assert P not in out.statuses  # prefill does not autoscale: no decision, no status


def test_the_first_interval_has_no_previous_scrape_and_raises_no_metric_missing_event() -> None:
    spec = {
        "prefill": {"replicas": 1, "autoscaling": autoscaling("ttftP90Seconds", 0.5)},
        "decode": {"replicas": 1},
    }
    trace = Trace(spec)
    trace.workers[P][0].requests_in_flight.set(3)  # busy: an empty interval is no sample
    first = trace.step(0.0)
    assert first.events == () and first.patches == ()
    status = first.statuses[P]
    assert status is not None and status.reason == FIRST_INTERVAL
    assert status.last_value is None
    # The next interval has a previous scrape; requests stuck before their first token
    # with no TTFT observed is a missing metric, and that one is said out loud.
    second = trace.step(INTERVAL)
    (event,) = second.events
    assert (event.type, event.reason) == ("Warning", "MetricMissing")
    assert event.message == (
        "prefill: no ttftP90Seconds sample: holding "
        "(ttftP90Seconds missing, target 0.5; replicas held at 1)"
    )
    assert second.statuses[P] is not None and second.statuses[P].reason == "MetricMissing"


def test_a_gauge_metric_missing_on_the_first_interval_is_an_event() -> None:
    """Only a p90 waits for a previous scrape; a gauge absent from the text is missing now."""
    spec = {
        "prefill": {"replicas": 1, "autoscaling": autoscaling("queuedPrefillTokensPerInstance", 8)},
        "decode": {"replicas": 1},
    }
    cluster = make_cluster(spec)
    status = PDClusterStatus(prefill=RoleStatus(desired=1, ready=1))
    scrapes = {P: {"p0": PodScrape("# nothing here\n", 0.0)}}
    out = compute_autoscale_step(cluster, status, scrapes, AutoscaleHistory(), 0.0)
    assert [e.reason for e in out.events] == ["MetricMissing"]


def test_an_unreadable_body_is_named_and_a_role_not_due_is_left_alone() -> None:
    spec = {
        "prefill": {"replicas": 1, "autoscaling": autoscaling("queuedPrefillTokensPerInstance", 8)},
        "decode": {"replicas": 1, "autoscaling": autoscaling("runningRequestsPerInstance", 4)},
    }
    cluster = make_cluster(spec)
    status = PDClusterStatus(prefill=RoleStatus(ready=1), decode=RoleStatus(ready=1))
    good = WorkerMetrics("decode")
    good.requests_in_flight.set(4)
    scrapes = {
        P: {"p0": PodScrape("pdcluster_queued_prefill_tokens{ 12\n", 0.0)},
        D: {"d0": PodScrape(generate_latest(good.registry).decode(), 0.0)},
    }
    out = compute_autoscale_step(cluster, status, scrapes, AutoscaleHistory(), 0.0)
    assert len(out.unreadable) == 1 and out.unreadable[0].startswith("p0: not Prometheus text")
    (missing,) = out.events
    assert missing.reason == "MetricMissing" and "unreadable /metrics: p0" in missing.message
    assert out.statuses[D] is not None and out.statuses[D].last_value == 4.0
    assert out.next_due_at == INTERVAL
    # Five seconds later neither role is due: no decision, the history is kept as it was.
    early = compute_autoscale_step(cluster, status, scrapes, out.history, 5.0)
    assert early.statuses == {} and early.events == () and early.history == out.history
    assert early.next_due_at == INTERVAL
    # Half a second early is on time.
    assert set(compute_autoscale_step(cluster, status, scrapes, out.history, 14.6).statuses) == {
        P,
        D,
    }


def test_autoscaling_turned_off_clears_its_status() -> None:
    status = PDClusterStatus(decode=RoleStatus(ready=1, autoscaling=AUTOSCALING_DECISION))
    cluster = make_cluster({"prefill": {}, "decode": {}})
    out = compute_autoscale_step(cluster, status, {}, AutoscaleHistory(), 0.0)
    assert out.status_patch() == {"status": {"decode": {"autoscaling": None}}}
    assert out.next_due_at is None and out.patches == () and out.events == ()


def test_a_colocated_cluster_has_nothing_to_scale() -> None:
    out = compute_autoscale_step(
        make_cluster({"colocated": {}}), PDClusterStatus(), {}, AutoscaleHistory(), 0.0
    )
    assert (out.patches, out.events, dict(out.statuses), out.next_due_at) == ((), (), {}, None)


def test_the_crd_status_has_room_for_the_autoscaling_status() -> None:
    from pdcluster.operator.crd.crdgen import build_crd

    status = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    for role in ("prefill", "decode"):
        node = status["status"]["properties"][role]["properties"]["autoscaling"]["properties"]
        assert set(node) == {
            f.alias or name for name, f in RoleAutoscalingStatus.model_fields.items()
        }


def test_a_manual_change_outside_the_bounds_is_clamped_with_the_numbers_in_the_event() -> None:
    spec = {
        "prefill": {"replicas": 1},
        "decode": {"replicas": 5, "autoscaling": autoscaling("runningRequestsPerInstance", 4)},
    }
    busy = WorkerMetrics("decode")
    busy.requests_in_flight.set(6)
    text = generate_latest(busy.registry).decode()
    scrapes = {D: {f"d{i}": PodScrape(text, 0.0) for i in range(5)}}
    status = PDClusterStatus(prefill=RoleStatus(ready=1), decode=RoleStatus(ready=5))
    out = compute_autoscale_step(make_cluster(spec), status, scrapes, AutoscaleHistory(), 0.0)
    assert [p.body() for p in out.patches] == [{"spec": {"decode": {"replicas": 2}}}]
    (event,) = out.events
    assert (event.type, event.reason) == ("Normal", "ReplicasClamped")
    assert event.message == (
        "decode: replicas 5 is outside autoscaling bounds [1, 2]: set to 2 "
        "(runningRequestsPerInstance 6, target 4; replicas 5 -> 2)"
    )


def test_only_the_autoscaled_roles_whose_interval_ended_are_due() -> None:
    auto = {
        "maxReplicas": 2,
        "intervalSeconds": 10,
        "target": {"metric": "tpotP90Seconds", "value": 1},
    }
    cluster = make_cluster({"prefill": {}, "decode": {"autoscaling": auto}})
    assert roles_due(cluster, AutoscaleHistory(), 100.0) == (Role.decode,)
    decided = AutoscaleHistory(decided_at={Role.decode: 100.0})
    assert roles_due(cluster, decided, 105.0) == ()
    assert roles_due(cluster, decided, 109.6) == (Role.decode,)  # a timer fires a little early
    assert roles_due(make_cluster({"prefill": {}, "decode": {}}), decided, 200.0) == ()
