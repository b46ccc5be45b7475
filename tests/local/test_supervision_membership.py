"""Autoscaling changes who the supervisor watches: an adopted instance is
restarted like the others; a released one's exit is no loss."""

from __future__ import annotations

import signal

import pytest

from pdcluster.runtime.local.supervision import (
    InstanceKey,
    Phase,
    ReportLost,
    SupervisionError,
    Supervisor,
    TearDown,
)
from pdcluster.runtime.spec import RestartPolicySpec, Role

P0, P1 = InstanceKey(Role.prefill, 0), InstanceKey(Role.prefill, 1)
KILLED = -signal.SIGKILL


def supervisor() -> Supervisor:
    policy = RestartPolicySpec(backoff_seconds=1.0, max_backoff_seconds=60.0, budget=10)
    return Supervisor([P0], {Role.prefill: policy})


def test_an_adopted_instance_is_supervised_like_the_first_ones() -> None:
    sup = supervisor()
    sup.add_instance(P1)
    assert sup.is_supervised(P1) and sup.view(P1).phase is Phase.RUNNING
    acts = sup.on_exit("prefill-1", P1, 0, KILLED, now=5.0)
    assert acts == [TearDown(P1, 0), ReportLost(P1, "prefill-1 killed by SIGKILL")]


def test_adopting_twice_or_a_role_without_policy_is_refused_and_changes_nothing() -> None:
    sup = supervisor()
    with pytest.raises(SupervisionError, match="already supervised"):
        sup.add_instance(P0)
    with pytest.raises(SupervisionError, match="no restart policy for role decode"):
        sup.add_instance(InstanceKey(Role.decode, 0))
    assert sup.view(P0).phase is Phase.RUNNING and not sup.is_supervised(P1)


def test_a_released_instance_is_forgotten_and_one_being_restarted_is_not_released() -> None:
    sup = supervisor()
    sup.add_instance(P1)
    sup.remove_instance(P1)
    assert not sup.is_supervised(P1)
    with pytest.raises(SupervisionError, match="unknown instance"):
        sup.remove_instance(P1)
    sup.on_exit("prefill-0", P0, 0, KILLED, now=5.0)
    with pytest.raises(SupervisionError, match="backoff, not running"):
        sup.remove_instance(P0)
    assert sup.is_supervised(P0) and sup.view(P0).phase is Phase.BACKOFF
