"""When a prefill's unregistered instance becomes a Warning (pure decision)."""

from __future__ import annotations

import pytest

from pdcluster.operator.failover.registration import RegistrationWatch, is_registration_problem

UNREG = "unregistered: 1/4 ranks registered"


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (UNREG, True),
        ("bootstrap_rejected: bootstrap server answered 403: wrong token", True),
        ("engine_stalled", False),
        ("dp_groups_starting", False),
        (None, False),
    ],
)
def test_which_health_reasons_are_registration_problems(reason: str | None, expected: bool) -> None:
    assert is_registration_problem(reason) is expected


def test_a_warning_comes_once_the_episode_lasted_the_bound_and_only_once() -> None:
    watch = RegistrationWatch(warn_after_s=30)
    assert watch.observe("u1", "p-0", UNREG, True, now=100) is None
    assert watch.observe("u1", "p-0", UNREG, True, now=129) is None
    warning = watch.observe("u1", "p-0", UNREG, True, now=130)
    assert warning is not None and warning.pod == "p-0" and warning.reason == UNREG
    assert "unregistered: 1/4" in warning.message()
    assert watch.observe("u1", "p-0", UNREG, True, now=500) is None


def test_no_answer_changes_nothing_and_another_reason_ends_the_episode() -> None:
    watch = RegistrationWatch(warn_after_s=10)
    watch.observe("u1", "p-0", UNREG, True, now=0)
    assert watch.observe("u1", "p-0", None, False, now=5) is None  # unreachable: keep counting
    assert watch.observe("u1", "p-0", UNREG, True, now=10) is not None
    assert watch.observe("u1", "p-0", None, True, now=11) is None  # registered: episode over
    watch.observe("u1", "p-0", UNREG, True, now=12)
    assert watch.observe("u1", "p-0", UNREG, True, now=21) is None
    assert watch.observe("u1", "p-0", UNREG, True, now=22) is not None  # a new episode warns


def test_pods_are_watched_apart_and_gone_ones_forgotten() -> None:
    watch = RegistrationWatch(warn_after_s=5)
    watch.observe("a", "p-0", UNREG, True, now=0)
    watch.observe("b", "p-1", UNREG, True, now=4)
    assert watch.observe("a", "p-0", UNREG, True, now=5) is not None
    assert watch.observe("b", "p-1", UNREG, True, now=5) is None
    watch.retain({"a"})
    assert watch.observe("b", "p-1", UNREG, True, now=6) is None  # b starts over


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="warn_after_s"):
        RegistrationWatch(-1)
