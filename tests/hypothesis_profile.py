"""The hypothesis settings every property test in tests/ and e2e/ runs under.

Hypothesis's per-example deadline (200 ms by default) and its too-slow health
check are timed assertions: on a loaded 2-core CI box they fail correct code.
Tests check behaviour; `bench/` times it. A test's own `@settings(...)` still
sets example counts; it inherits these two.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

PROFILE = "pdcluster"


def use_project_profile() -> None:
    settings.register_profile(PROFILE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(PROFILE)
