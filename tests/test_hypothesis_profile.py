"""Every property test runs without hypothesis's timed checks (tests/hypothesis_profile.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def test_the_project_profile_is_loaded() -> None:
    assert settings().deadline is None
    assert HealthCheck.too_slow in settings().suppress_health_check


@settings(max_examples=5)
@given(st.integers())
def test_a_test_with_its_own_settings_inherits_no_deadline(n: int) -> None:
    assert settings().deadline is None
    assert isinstance(n, int)
