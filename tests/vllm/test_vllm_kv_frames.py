"""The KV-event frames the router's decoder tests read
(tests/router/data/vllm_kv_frames.msgpack) are what the pinned vLLM's own
publisher writes today: the script that made them, run again, writes the
same bytes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DATA = Path(__file__).parents[1] / "router" / "data"


def test_the_checked_in_frames_are_vllms_own(vllm_python: str, tmp_path: Path) -> None:
    out = tmp_path / "frames.msgpack"
    subprocess.run(
        [vllm_python, str(DATA / "make_vllm_kv_frames.py"), str(out)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    assert out.read_bytes() == (DATA / "vllm_kv_frames.msgpack").read_bytes()
