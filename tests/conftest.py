"""Fixtures shared by every test package."""

from __future__ import annotations

import pytest

from tests.hypothesis_profile import use_project_profile
from tests.operator.helpers import unavailable
from tests.operator.test_chart import HELM

use_project_profile()


@pytest.fixture
def helm_binary() -> str:
    """The helm binary; a test that needs it is skipped without one, and fails under CI."""
    if HELM is None:
        unavailable("no helm binary (python -m e2e.controlplane.build)")
    return HELM
