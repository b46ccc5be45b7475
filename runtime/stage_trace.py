"""Stage timestamps of PD requests, for latency breakdowns; off unless asked for.

With ``PDCLUSTER_STAGE_TRACE=<dir>`` in a process's environment, `mark`
appends one ``room<TAB>stage<TAB>t_ns`` line per call to ``<dir>/<pid>.tsv``
(one ``os.write`` on an ``O_APPEND`` descriptor: whole lines even from
several threads). Without it `mark` returns at once and writes nothing.
``t_ns`` is ``time.monotonic_ns()``: CLOCK_MONOTONIC is one clock for the
whole host on Linux, so the router's and both workers' stamps of one room
compare directly when they run on one machine (local mode, the benchmark).

The room is the key because it is the one name every hop of a PD request
knows (router, both workers, every ZMQ message). `bench/pd_stages.py`
reads the files back with `parse_lines` and `summarize`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ENV = "PDCLUSTER_STAGE_TRACE"


def _open(directory: str | None) -> int | None:
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{os.getpid()}.tsv")
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


_fd = _open(os.environ.get(ENV))


def is_enabled() -> bool:
    return _fd is not None


def mark(room: int | None, stage: str, t_ns: int | None = None) -> None:
    """Record that ``room`` reached ``stage`` now (or at ``t_ns``); no-op when off."""
    if _fd is None or room is None:
        return
    stamp = time.monotonic_ns() if t_ns is None else t_ns
    os.write(_fd, f"{room}\t{stage}\t{stamp}\n".encode())


def mark_message(role: str, direction: str, msg: object) -> None:
    """A control message of a room passing a hop: ``<role>.<direction>.<tag>[.<state>]``."""
    if _fd is None:
        return
    room = getattr(msg, "room", None)
    if not isinstance(room, int):
        return
    config = getattr(type(msg), "__struct_config__", None)
    tag = getattr(config, "tag", None) or type(msg).__name__
    name = getattr(getattr(msg, "state", None), "name", None)
    suffix = f".{name}" if isinstance(name, str) else ""
    mark(room, f"{role}.{direction}.{tag}{suffix}")


# ------------------------------------------------------------------ analysis (pure)


def parse_lines(lines: Iterable[str]) -> dict[int, dict[str, int]]:
    """room → stage → first stamp; malformed lines are skipped."""
    rooms: dict[int, dict[str, int]] = {}
    for line in lines:
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 3:
            continue
        try:
            room, stamp = int(parts[0]), int(parts[2])
        except ValueError:
            continue
        stages = rooms.setdefault(room, {})
        if parts[1] not in stages or stamp < stages[parts[1]]:
            stages[parts[1]] = stamp
    return rooms


@dataclass(frozen=True)
class StageRow:
    stage: str
    num_rooms: int  # rooms that reached this stage
    offset_ms: float  # median time since the room's origin stage
    step_ms: float  # median time since the previous row's stage, same room


def summarize(rooms: Mapping[int, Mapping[str, int]], origin: str) -> list[StageRow]:
    """One row per stage, ordered by median offset from ``origin``.

    Only rooms that have ``origin`` count. ``step_ms`` is the median over
    rooms of (this stage − the previous row's stage), so the steps of a chain
    whose order never varies add up to the offset of its last stage.
    """
    offsets: dict[str, list[float]] = {}
    for stages in rooms.values():
        if origin not in stages:
            continue
        t0 = stages[origin]
        for stage, stamp in stages.items():
            offsets.setdefault(stage, []).append((stamp - t0) / 1e6)
    order = sorted(offsets, key=lambda s: (statistics.median(offsets[s]), s))
    rows: list[StageRow] = []
    previous: str | None = None
    for stage in order:
        if previous is None:
            step = 0.0
        else:
            deltas = [
                (st[stage] - st[previous]) / 1e6
                for st in rooms.values()
                if origin in st and stage in st and previous in st
            ]
            step = statistics.median(deltas) if deltas else float("nan")
        rows.append(StageRow(stage, len(offsets[stage]), statistics.median(offsets[stage]), step))
        previous = stage
    return rows
