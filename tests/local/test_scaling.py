"""Local mode's autoscaling step (pure): the planner over local instances."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from pdcluster.runtime.local.scaling import (
    DrainInstance,
    RoleConfig,
    RoleInstances,
    ScalingConfig,
    ScalingHistory,
    ScalingStep,
    Scrape,
    StartInstance,
    compute_local_step,
    roles_due,
)
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.spec import Role, RoleAutoscalingSpec


def autoscaling(
    metric: str = "queuedPrefillTokensPerInstance", value: float = 100, **kw: Any
) -> RoleAutoscalingSpec:
    body = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "intervalSeconds": 1,
        "target": {"metric": metric, "value": value},
        "scaleUp": {"stabilizationSeconds": 0},
        "scaleDown": {"stabilizationSeconds": 0},
        **kw,
    }
    return RoleAutoscalingSpec.model_validate(body)


def config(
    prefill: RoleAutoscalingSpec | None, decode: RoleAutoscalingSpec | None = None, **kw: Any
) -> ScalingConfig:
    return ScalingConfig(
        {Role.prefill: RoleConfig(prefill, 1), Role.decode: RoleConfig(decode, 1)}, **kw
    )


def metrics_text(queued: float = 0, ttfts: tuple[float, ...] = (), in_flight: int = 0) -> str:
    m = WorkerMetrics("prefill")
    m.queued_prefill_tokens.set(queued)
    m.requests_in_flight.set(in_flight)
    for t in ttfts:
        m.ttft_seconds.observe(t)
    return generate_latest(m.registry).decode()


def ready(*numbers: int) -> RoleInstances:
    return RoleInstances(ready=frozenset(numbers))


def step(
    cfg: ScalingConfig,
    prefill: RoleInstances,
    texts: dict[int, str],
    history: ScalingHistory | None = None,
    now: float = 100.0,
    decode: RoleInstances | None = None,
) -> ScalingStep:
    scrapes = {Role.prefill: {i: Scrape(t, now) for i, t in texts.items()}}
    instances = {Role.prefill: prefill, Role.decode: decode or ready(0)}
    return compute_local_step(cfg, instances, scrapes, history or ScalingHistory(), now)


def test_a_queue_over_target_starts_the_lowest_free_instance_and_says_so() -> None:
    got = step(config(autoscaling()), ready(0), {0: metrics_text(queued=250)})
    assert got.actions == (StartInstance(Role.prefill, 1),)
    assert got.lines == (
        "Normal ScaledUp: prefill 1 -> 2: queuedPrefillTokensPerInstance 250 vs target 100 "
        "(tolerance 10%, 1 ready)",
    )
    assert got.next_due_at == 101.0


def test_maxstep_bounds_a_big_jump_and_a_taken_number_is_skipped() -> None:
    cfg = config(autoscaling(maxStep=2, maxReplicas=5))
    have = RoleInstances(ready=frozenset({0, 2}), draining=frozenset({1}))
    got = step(cfg, have, {0: metrics_text(queued=900), 2: metrics_text(queued=900)})
    assert got.actions == (StartInstance(Role.prefill, 3), StartInstance(Role.prefill, 4))


def test_an_idle_role_drains_its_highest_numbered_ready_instances() -> None:
    cfg = config(autoscaling(maxStep=2))
    texts = {i: metrics_text(queued=0) for i in range(3)}
    got = step(cfg, ready(0, 1, 2), texts)
    assert got.actions == (DrainInstance(Role.prefill, 2), DrainInstance(Role.prefill, 1))
    assert "Normal ScaledDown: prefill 3 -> 1" in got.lines[0]


def test_no_scale_down_while_an_instance_of_either_role_is_starting() -> None:
    cfg = config(autoscaling())
    texts = {0: metrics_text(), 1: metrics_text()}
    starting_decode = RoleInstances(ready=frozenset({0}), starting=frozenset({1}))
    got = step(cfg, ready(0, 1), texts, decode=starting_decode)
    assert got.actions == () and got.lines == ()


def test_a_draining_instance_is_no_replica_and_is_not_scraped() -> None:
    """prefill-1 is being drained: replicas is 1, at the minimum; its busy
    /metrics are not read (the drain waits for exactly those requests)."""
    have = RoleInstances(ready=frozenset({0}), draining=frozenset({1}))
    got = step(config(autoscaling()), have, {0: metrics_text(), 1: metrics_text(queued=10_000)})
    assert got.actions == ()
    assert set(got.history.scrapes[Role.prefill]) == {0}


def test_within_tolerance_nothing_happens() -> None:
    got = step(config(autoscaling()), ready(0), {0: metrics_text(queued=105)})
    assert got.actions == () and got.lines == ()


def test_a_role_is_decided_once_per_interval_and_a_role_without_autoscaling_never() -> None:
    cfg = config(autoscaling(), None)
    first = step(cfg, ready(0), {0: metrics_text(queued=250)})
    assert roles_due(cfg, first.history, 100.5) == ()
    assert roles_due(cfg, first.history, 101.0) == (Role.prefill,)
    # Not due yet: nothing is decided, even with the queue still over target.
    early = step(cfg, ready(0), {0: metrics_text(queued=250)}, first.history, now=100.5)
    assert early.actions == () and early.history == first.history
    assert roles_due(config(None, None), ScalingHistory(), 0.0) == ()
    assert step(config(None), ready(0), {0: metrics_text()}).next_due_at is None


def test_a_latency_target_waits_one_interval_without_a_missing_metric_warning() -> None:
    cfg = config(autoscaling("ttftP90Seconds", 0.05))
    first = step(cfg, ready(0), {0: metrics_text(ttfts=(0.5,))})
    assert first.actions == () and first.lines == ()
    second = step(cfg, ready(0), {0: metrics_text(ttfts=(0.5, 0.6, 0.7))}, first.history, 101.0)
    assert second.actions == (StartInstance(Role.prefill, 1),)
    assert second.lines[0].startswith("Normal ScaledUp: prefill 1 -> 2: ttftP90Seconds")


def test_a_missing_or_unreadable_metric_holds_with_a_warning() -> None:
    cfg = config(autoscaling())
    got = step(cfg, ready(0), {0: "not { prometheus"})
    assert got.actions == ()
    assert got.lines[0].startswith("Warning UnreadableMetrics: prefill-0: not Prometheus text")
    assert got.lines[1].startswith("Warning MetricMissing: prefill: no queuedPrefillTokens")
    silent = step(cfg, ready(0), {})
    assert [line.split(":")[0] for line in silent.lines] == ["Warning MetricMissing"]


def test_a_hold_warning_is_logged_when_the_hold_starts_not_every_interval() -> None:
    cfg = config(autoscaling())
    first = step(cfg, ready(0), {})
    again = step(cfg, ready(0), {}, first.history, now=101.0)
    assert len(first.lines) == 1 and again.lines == ()
    busy = step(cfg, ready(0), {0: metrics_text(queued=100)}, again.history, now=102.0)
    assert busy.lines == ()  # within tolerance
    missing = step(cfg, ready(0), {}, busy.history, now=103.0)
    assert [line.split(":")[0] for line in missing.lines] == ["Warning MetricMissing"]


def test_replicas_outside_the_bounds_are_clamped_at_once() -> None:
    cfg = config(autoscaling(maxReplicas=2))
    texts = {i: metrics_text(queued=10_000) for i in range(3)}
    got = step(cfg, ready(0, 1, 2), texts)
    assert got.actions == (DrainInstance(Role.prefill, 2),)
    assert got.lines[0].startswith("Normal ReplicasClamped: prefill: replicas 3 is outside")


def test_the_gpu_budget_caps_a_scale_up() -> None:
    cfg = config(autoscaling(), max_total_gpus=2)  # decode holds one GPU
    got = step(cfg, ready(0), {0: metrics_text(queued=1000)})
    assert got.actions == ()
    assert any(line.startswith("Warning CappedByBudget") for line in got.lines)


def test_an_instance_in_two_phases_is_refused() -> None:
    with pytest.raises(ValueError, match="two phases"):
        RoleInstances(ready=frozenset({0}), draining=frozenset({0}))


@settings(max_examples=300, deadline=None)
@given(
    queues=st.lists(st.integers(0, 1000), min_size=1, max_size=40),
    max_step=st.integers(1, 3),
    max_replicas=st.integers(1, 4),
)
def test_random_load_keeps_replicas_within_bounds_and_actions_consistent(
    queues: list[int], max_step: int, max_replicas: int
) -> None:
    cfg = config(autoscaling(maxStep=max_step, maxReplicas=max_replicas))
    have: set[int] = {0}
    history = ScalingHistory()
    for t, queued in enumerate(queues):
        texts = {i: metrics_text(queued=queued) for i in have}
        got = step(cfg, RoleInstances(ready=frozenset(have)), texts, history, now=float(t))
        history = got.history
        starts = [a.instance for a in got.actions if isinstance(a, StartInstance)]
        drains = [a.instance for a in got.actions if isinstance(a, DrainInstance)]
        assert not (starts and drains)
        assert len(starts) + len(drains) <= max_step
        assert len(set(starts)) == len(starts) and not set(starts) & have
        assert set(drains) <= have
        have = (have | set(starts)) - set(drains)  # the caller applies them
        assert 1 <= len(have) <= max_replicas
