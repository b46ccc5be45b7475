"""Structured logs: JSON lines that name the request's room, rid and trace id."""

from __future__ import annotations

import json
import logging

import pytest

from pdcluster.runtime.spec import LogFormat
from pdcluster.runtime.telemetry import request_log
from pdcluster.runtime.telemetry.request_log import (
    JsonFormatter,
    log_format_of,
    request_fields,
    trace_id_of,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def line(msg: str, **extra: object) -> dict[str, object]:
    record = logging.LogRecord("pdcluster.pd", logging.WARNING, __file__, 1, msg, (), None)
    for key, value in extra.items():
        setattr(record, key, value)
    formatter = JsonFormatter({"role": "decode", "instance": "decode-0", "cluster": "demo"})
    doc: dict[str, object] = json.loads(formatter.format(record))
    return doc


def test_a_line_about_a_request_names_its_room_rid_trace_and_the_process() -> None:
    request_log.bind("req-1", 42, TRACE)
    try:
        doc = line("room 42 failed", **request_fields(room=42, rid="req-1"))
    finally:
        request_log.unbind("req-1")
    assert doc["room"] == 42 and doc["rid"] == "req-1" and doc["trace_id"] == TRACE
    assert doc["role"] == "decode" and doc["instance"] == "decode-0" and doc["cluster"] == "demo"
    assert doc["level"] == "WARNING" and doc["msg"] == "room 42 failed"


def test_a_line_that_knows_only_the_room_gets_the_rid_and_trace_from_the_binding() -> None:
    request_log.bind("req-2", 7, TRACE)
    try:
        doc = line("frame for room 7 rejected", **request_fields(room=7))
    finally:
        request_log.unbind("req-2")
    assert doc["rid"] == "req-2" and doc["trace_id"] == TRACE


def test_after_unbind_and_for_other_lines_no_request_fields_appear() -> None:
    request_log.bind("req-3", 9, TRACE)
    request_log.unbind("req-3")
    assert "trace_id" not in line("x", **request_fields(room=9))
    plain = line("engine started")
    assert not {"room", "rid", "trace_id"} & plain.keys()


def test_a_rebound_room_is_not_unbound_by_its_previous_request() -> None:
    request_log.bind("old", 5, "a" * 32)
    request_log.bind("new", 5, TRACE)
    request_log.unbind("old")
    try:
        assert line("x", **request_fields(room=5))["rid"] == "new"
    finally:
        request_log.unbind("new")


@pytest.mark.parametrize(
    ("header", "trace"),
    [
        (f"00-{TRACE}-00f067aa0ba902b7-01", TRACE),
        (f"00-{TRACE.upper()}-00f067aa0ba902b7-00", TRACE),
        (None, None),
        ("garbage", None),
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),
        ("00-xyz-00f067aa0ba902b7-01", None),
    ],
)
def test_the_trace_id_of_a_traceparent(header: str | None, trace: str | None) -> None:
    assert trace_id_of(header) == trace


def test_the_log_format_comes_from_the_environment_then_the_manifest_then_text() -> None:
    assert log_format_of(None, {}) is LogFormat.text
    assert log_format_of(LogFormat.json, {}) is LogFormat.json
    assert log_format_of(LogFormat.text, {"PDCLUSTER_LOG_FORMAT": "json"}) is LogFormat.json
    with pytest.raises(ValueError, match="PDCLUSTER_LOG_FORMAT='xml' is not one of: text, json"):
        log_format_of(None, {"PDCLUSTER_LOG_FORMAT": "xml"})
