"""Structured logs: one JSON object per line, with the request's room, rid and trace id.

A log call about a request names what it knows with
`extra=request_fields(room=..., rid=...)`; the formatter completes the rest
from the process's bindings (`bind` when a request starts on this process,
`unbind` when it ends): a line that names only the room (a KV frame, a
transfer) still gets the rid and the trace id, and the role, the instance
and the cluster come from the process itself. So one request can be
followed through every process by its rid or trace id
(docs/operations.md, "Following one request").

`logFormat: text` keeps the classic line; the fields then ride only in the
message text the call sites already write.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.spec import LogFormat
from pdcluster.runtime.spec.observability import LOG_FORMAT_ENV

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


@dataclass(frozen=True)
class _Binding:
    room: int | None
    rid: str
    trace_id: str | None


# rid → binding and room → binding of the requests this process serves now.
# Plain dicts: every write and read is one atomic operation under the GIL.
_by_rid: dict[str, _Binding] = {}
_by_room: dict[int, _Binding] = {}


def bind(rid: str, room: int | None, trace_id: str | None) -> None:
    binding = _Binding(room, rid, trace_id)
    _by_rid[rid] = binding
    if room is not None:
        _by_room[room] = binding


def unbind(rid: str) -> None:
    binding = _by_rid.pop(rid, None)
    if binding is not None and binding.room is not None:
        if _by_room.get(binding.room) is binding:
            del _by_room[binding.room]


def request_fields(room: int | None = None, rid: str | None = None) -> dict[str, Any]:
    """`extra=` of a log call about one request."""
    return {"pd_room": room, "pd_rid": rid}


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`), if well formed."""
    if traceparent is None:
        return None
    parts = traceparent.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or parts[1] == "0" * 32:
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return parts[1].lower()


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the process's
    role/instance/cluster, and room/rid/trace_id when the line is about a request."""

    def __init__(self, process_fields: dict[str, str]) -> None:
        super().__init__()
        self.process_fields = {k: v for k, v in process_fields.items() if v}

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **self.process_fields,
        }
        room = getattr(record, "pd_room", None)
        rid = getattr(record, "pd_rid", None)
        binding = (_by_rid.get(rid) if rid is not None else None) or (
            _by_room.get(room) if room is not None else None
        )
        if binding is not None:
            room = binding.room if room is None else room
            rid = binding.rid if rid is None else rid
            if binding.trace_id is not None:
                doc["trace_id"] = binding.trace_id
        if room is not None:
            doc["room"] = room
        if rid is not None:
            doc["rid"] = rid
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def log_format_of(stated: LogFormat | None, env: Mapping[str, str]) -> LogFormat:
    """`$PDCLUSTER_LOG_FORMAT`, else the manifest's `logFormat`, else text (local mode)."""
    value = env.get(LOG_FORMAT_ENV)
    if value:
        try:
            return LogFormat(value)
        except ValueError:
            choices = ", ".join(f.value for f in LogFormat)
            raise ValueError(f"{LOG_FORMAT_ENV}={value!r} is not one of: {choices}") from None
    return stated if stated is not None else LogFormat.text


def configure_logging(
    log_format: LogFormat,
    level: int | str = logging.INFO,
    *,
    role: str = "",
    instance: str = "",
    cluster: str = "",
) -> None:
    """Set the root logger's one handler (stderr) to `log_format`."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format is LogFormat.json:
        handler.setFormatter(
            JsonFormatter({"role": role, "instance": instance, "cluster": cluster})
        )
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
