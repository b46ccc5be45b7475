"""Server-sent events between workers, router and clients.

`SSEReader` turns a worker's stream, line by line, into events; the router
re-emits each data event unchanged as ``data: ...`` followed by a blank line.

Invariants:
- an event's data lines are joined with newlines (the SSE rule);
- comment lines (``:``) and blank keep-alives produce no event;
- ``[DONE]`` is recognized only as a whole event, never inside JSON.

Pure module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.router.bodies import payload_error

DONE_DATA = "[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"


def format_event(data: str) -> bytes:
    return b"".join(b"data: " + line.encode() + b"\n" for line in data.split("\n")) + b"\n"


def format_json_event(payload: Any) -> bytes:
    return format_event(json.dumps(payload, ensure_ascii=False, separators=(",", ":")))


def _may_report_failure(data: str) -> bool:
    """False only where `payload_error` must find nothing, without parsing.

    Every failure payload has an ``error`` key or an ``abort`` value; in JSON
    text those letters appear as themselves or, escaped, after a ``\\u``. Most
    events are tokens: this spares the relay a JSON parse of each of them.
    """
    return "error" in data or "abort" in data or "\\u" in data


@dataclass(frozen=True)
class Event:
    data: str

    @property
    def is_done(self) -> bool:
        return self.data.strip() == DONE_DATA

    def error(self) -> str | None:
        """The failure this event reports, if it is an error or abort event."""
        if self.is_done or not _may_report_failure(self.data):
            return None
        try:
            payload = json.loads(self.data)
        except json.JSONDecodeError:
            return None
        failure: str | None = payload_error(payload)
        return failure


class SSEReader:
    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> Event | None:
        """Feed one line (without its newline); return an event when one ends."""
        line = line.rstrip("\r")
        if line == "":
            if not self._data:
                return None
            event = Event("\n".join(self._data))
            self._data = []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> Event | None:
        """The last event of a stream that ended without a blank line."""
        return self.feed("")
