"""The one back-off formula: base·factor^(attempt-1), capped, for every caller."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.backoff import ExponentialBackoff, exponential_delay, exponential_delays
from pdcluster.runtime.pd.readiness import RegistrationBackoff
from pdcluster.runtime.pd_worker.bootstrap_client import RetryPolicy
from pdcluster.runtime.spec import RestartPolicySpec


def test_doubles_from_base_until_the_cap() -> None:
    assert [exponential_delay(0.5, 3.0, n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert [exponential_delay(1.0, 100.0, n, factor=3.0) for n in (1, 2, 3)] == [1.0, 3.0, 9.0]


def test_a_huge_attempt_number_is_the_cap_not_an_overflow() -> None:
    assert exponential_delay(1.0, 30.0, 10_000) == 30.0
    assert exponential_delay(1.0, 30.0, 10**9, factor=1.5) == 30.0


@pytest.mark.parametrize(
    ("base_s", "max_s", "attempt", "factor"),
    [(1.0, 2.0, 0, 2.0), (-1.0, 2.0, 1, 2.0), (1.0, -2.0, 1, 2.0), (1.0, 2.0, 1, 0.5)],
)
def test_bad_arguments_are_refused(
    base_s: float, max_s: float, attempt: int, factor: float
) -> None:
    with pytest.raises(ValueError, match="attempt|back-off"):
        exponential_delay(base_s, max_s, attempt, factor)


@given(
    base_s=st.floats(0.0, 10.0),
    max_s=st.floats(0.0, 1000.0),
    factor=st.floats(1.0, 4.0),
)
def test_delays_never_shrink_and_never_pass_the_cap(
    base_s: float, max_s: float, factor: float
) -> None:
    delays = list(itertools.islice(exponential_delays(base_s, max_s, factor), 80))
    assert delays == sorted(delays)
    assert all(0.0 <= d <= max_s for d in delays)
    assert delays[0] == min(base_s, max_s)


def test_every_caller_uses_the_same_formula() -> None:
    """Registration, the bootstrap client's retries, operator restarts and node-agent restarts."""
    from e2e.nodeagent.backoff import BackoffPolicy, compute_restart_delay
    from pdcluster.operator.reconcile.restarts import backoff_delay

    expected = [exponential_delay(0.25, 2.0, n) for n in range(1, 9)]
    assert list(itertools.islice(RegistrationBackoff(0.25, 2.0, 2.0).delays(), 8)) == expected
    assert list(RetryPolicy(9, ExponentialBackoff(0.25, 2.0, 2.0)).delays()) == expected
    policy = RestartPolicySpec(backoff_seconds=0.25, max_backoff_seconds=2)
    assert [backoff_delay(policy, n) for n in range(1, 9)] == expected
    node = BackoffPolicy(base_s=0.25, max_s=2.0)
    assert [compute_restart_delay(node, n) for n in range(1, 9)] == expected
    assert list(RetryPolicy(attempts=1).delays()) == []  # one attempt: no sleep


def test_the_policy_is_the_formula_and_refuses_what_cannot_back_off() -> None:
    policy = ExponentialBackoff(base_s=0.5, factor=3.0, max_s=10.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.5, 4.5, 10.0]
    assert list(itertools.islice(policy.delays(), 4)) == [0.5, 1.5, 4.5, 10.0]
    assert ExponentialBackoff(base_s=0.0, max_s=1.0).delay(5) == 0.0
    for bad in ({"base_s": 3.0, "max_s": 2.0}, {"base_s": -1.0}, {"factor": 0.5}):
        with pytest.raises(ValueError, match="ExponentialBackoff needs"):
            ExponentialBackoff(**bad)
    with pytest.raises(ValueError, match="RegistrationBackoff needs base_s > 0"):
        RegistrationBackoff(base_s=0.0)
