"""Stage stamps: written only when asked for, read back into a per-stage breakdown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdcluster.runtime import stage_trace
from pdcluster.runtime.stage_trace import StageRow, parse_lines, summarize

SCRIPT = """
from pdcluster.runtime import stage_trace
from pdcluster.runtime.pd.messages import Status
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
print(stage_trace.is_enabled())
stage_trace.mark(7, "router.recv", 1000)
stage_trace.mark(None, "never")
status = Status(room=7, generation=1, rank=RankCoord(), state=KVPoll.Success)
stage_trace.mark_message("decode", "rx", status)
"""


def _run(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_marks_land_in_one_file_per_process_when_the_variable_is_set(tmp_path: Path) -> None:
    env = {**os.environ, stage_trace.ENV: str(tmp_path / "trace")}
    assert _run(env) == "True"
    files = list((tmp_path / "trace").glob("*.tsv"))
    assert len(files) == 1
    rooms = parse_lines(files[0].read_text().splitlines())
    assert set(rooms) == {7}
    assert rooms[7]["router.recv"] == 1000
    assert set(rooms[7]) == {"router.recv", "decode.rx.status.Success"}


def test_marks_write_nothing_without_the_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != stage_trace.ENV}
    env["TMPDIR"] = str(tmp_path)
    assert _run(env) == "False"
    assert list(tmp_path.iterdir()) == []


def test_parse_keeps_the_first_stamp_and_skips_garbage() -> None:
    rooms = parse_lines(["1\ta\t50", "1\ta\t20", "x\ta\t1", "1\tb", "2\tb\tnan", "1\tb\t70\n"])
    assert rooms == {1: {"a": 20, "b": 70}}


def test_summary_orders_stages_by_median_offset_with_steps_between_rows() -> None:
    ms = 1_000_000
    rooms = {
        1: {"send": 0, "mid": 2 * ms, "end": 10 * ms},
        2: {"send": 100 * ms, "mid": 104 * ms, "end": 106 * ms},
        3: {"send": 200 * ms, "mid": 203 * ms, "end": 208 * ms},
        4: {"mid": 5 * ms},  # no origin: left out
    }
    rows = summarize(rooms, origin="send")
    assert rows == [
        StageRow("send", 3, 0.0, 0.0),
        StageRow("mid", 3, 3.0, 3.0),
        StageRow("end", 3, 8.0, 5.0),
    ]
