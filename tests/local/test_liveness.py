"""Local mode's liveness decisions (`local/liveness.py`): pure, no process."""

from __future__ import annotations

import pytest

from pdcluster.operator.builders.workers import build_worker_pod
from pdcluster.runtime.local.liveness import LivenessLedger, LivenessPolicy
from pdcluster.runtime.spec import Role
from tests.operator.helpers import PD, make_cluster


def test_a_process_is_killed_at_the_threshold_of_failures_in_a_row_and_only_then() -> None:
    ledger = LivenessLedger(LivenessPolicy(failure_threshold=3))
    assert [ledger.record("prefill-0", 0, False) for _ in range(2)] == [False, False]
    assert ledger.record("prefill-0", 0, True) is False  # a success resets the count
    assert ledger.failures("prefill-0", 0) == 0
    assert [ledger.record("prefill-0", 0, False) for _ in range(3)] == [False, False, True]
    assert ledger.failures("prefill-0", 0) == 0, "the kill restarts the count"


def test_processes_and_starts_count_apart() -> None:
    ledger = LivenessLedger(LivenessPolicy(failure_threshold=2))
    assert ledger.record("prefill-0", 0, False) is False
    assert ledger.record("decode-0", 0, False) is False
    # A late result of the old start never counts against the new one.
    assert ledger.record("prefill-0", 1, False) is False
    assert ledger.failures("prefill-0", 0) == 1 and ledger.failures("prefill-0", 1) == 1
    assert ledger.record("prefill-0", 0, False) is True
    assert ledger.failures("prefill-0", 1) == 1 and ledger.failures("decode-0", 0) == 1
    ledger.forget("prefill-0")
    assert ledger.failures("prefill-0", 1) == 0 and ledger.failures("decode-0", 0) == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"period_s": 0}, {"timeout_s": -1}, {"failure_threshold": 0}, {"period_s": float("nan")}],
)
def test_a_policy_that_cannot_probe_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="liveness"):
        LivenessPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("role", [Role.prefill, Role.decode])
def test_the_default_is_the_operators_pod_liveness_probe(role: Role) -> None:
    (container,) = build_worker_pod(make_cluster(PD), role, 0, 0)["spec"]["containers"]
    probe = container["livenessProbe"]
    policy = LivenessPolicy()
    assert probe["httpGet"]["path"] == "/health/live"
    assert (probe["periodSeconds"], probe["timeoutSeconds"], probe["failureThreshold"]) == (
        policy.period_s,
        policy.timeout_s,
        policy.failure_threshold,
    )
