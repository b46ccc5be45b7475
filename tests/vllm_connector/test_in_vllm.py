"""Inside vLLM's own interpreter: our connector imports there, and vLLM's CPU pages move whole."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from e2e.vllmenv.build import checkout_pythonpath
from tests.vllm_connector.engines import vllm_python

pytestmark = [pytest.mark.slow]

# Our modules vLLM's interpreter must never load for the connector: the
# operator, and what runs only in our own engine or our HTTP worker.
FORBIDDEN = (
    "pdcluster.operator",
    "pdcluster.runtime.server",
    "pdcluster.runtime.serving",
    "pdcluster.runtime.router",
    "pdcluster.runtime.engine.engine",
    "pdcluster.runtime.engine.model",
    "pdcluster.runtime.engine.runner",
    "pdcluster.runtime.pd_worker.coordinator",
    "pdcluster.runtime.pd_worker.backends",
)


@pytest.fixture(scope="module")
def findings() -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(checkout_pythonpath()))
    script = Path(__file__).with_name("in_vllm.py")
    done = subprocess.run(
        [vllm_python(), str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_connector_imports_in_vllms_interpreter_with_vllms_torch(findings):
    imports = findings["imports"]
    assert imports["class"] == "PDClusterConnector"
    assert "pdcluster-vllm" in imports["torch_file"]  # vLLM's torch, not our pin
    loaded = imports["modules"]
    assert not [m for m in loaded if m.startswith(FORBIDDEN)], loaded


def test_whole_cpu_pages_moved_by_our_transfer_give_vllms_kernel_the_same_output(findings):
    pages = findings["pages"]
    assert pages["whole_pages_equal"] and pages["whole_pages_max_diff"] == 0.0
    # Token rows alone are not enough: the kernel keeps a page's K transposed.
    assert not pages["token_rows_equal"]
