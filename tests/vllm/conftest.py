"""Fixtures of the tests that run real vLLM processes (marked `slow`).

The vLLM environment is built by `make test` (`make vllm-env`) and cached
like the Kubernetes binaries; without it these tests are skipped locally
and fail under CI (`tests/operator/helpers.unavailable`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.operator.helpers import unavailable
from tests.vllm.harness import write_vllm_model


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter of the cached vLLM environment (built here when missing)."""
    from e2e.vllmenv.build import VllmEnvError, ensure_vllm_env

    try:
        return str(ensure_vllm_env().python)
    except VllmEnvError as err:
        unavailable(f"no vLLM environment: {err}")


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vllm_model(tmp_path_factory.mktemp("vllm-model"))
