"""W3C trace context and the sampling decision (pure), against the SDK's own rule."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased

from pdcluster.runtime.telemetry.trace_context import (
    decide,
    format_traceparent,
    is_sampled_root,
    parse_traceparent,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


@pytest.mark.parametrize(
    ("header", "sampled"),
    [
        (f"00-{TRACE}-{SPAN}-01", True),
        (f"00-{TRACE}-{SPAN}-00", False),
        (f"00-{TRACE.upper()}-{SPAN}-03", True),
    ],
)
def test_a_valid_traceparent_names_the_caller(header: str, sampled: bool) -> None:
    ctx = parse_traceparent(header, "vendor=x")
    assert ctx is not None
    assert (ctx.trace_id, ctx.span_id, ctx.sampled) == (int(TRACE, 16), int(SPAN, 16), sampled)
    assert ctx.tracestate == "vendor=x"


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "garbage",
        f"00-{'0' * 32}-{SPAN}-01",  # zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # zero span id
        f"ff-{TRACE}-{SPAN}-01",  # the forbidden version
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE[:-1]}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}-zz",
    ],
)
def test_anything_else_is_no_parent(header: str | None) -> None:
    assert parse_traceparent(header) is None


@given(st.integers(1, (1 << 128) - 1), st.integers(1, (1 << 64) - 1), st.booleans())
def test_format_and_parse_round_trip(trace_id: int, span_id: int, sampled: bool) -> None:
    ctx = parse_traceparent(format_traceparent(trace_id, span_id, sampled))
    assert ctx is not None and (ctx.trace_id, ctx.span_id, ctx.sampled) == (
        trace_id,
        span_id,
        sampled,
    )


@given(st.integers(1, (1 << 128) - 1), st.floats(0, 1))
def test_a_new_trace_is_kept_exactly_when_the_sdk_s_ratio_sampler_keeps_it(
    trace_id: int, ratio: float
) -> None:
    sdk = TraceIdRatioBased(ratio).should_sample(None, trace_id, "x").decision
    assert is_sampled_root(trace_id, ratio) is (sdk is Decision.RECORD_AND_SAMPLE)


def test_a_caller_s_decision_is_followed_and_a_new_trace_gets_fresh_ids() -> None:
    rng = random.Random(1)
    follow = decide(parse_traceparent(f"00-{TRACE}-{SPAN}-00"), 1.0, rng)
    assert (follow.trace_id, follow.parent_id, follow.sampled) == (
        int(TRACE, 16),
        int(SPAN, 16),
        False,
    )
    new = decide(None, 1.0, rng)
    assert new.parent_id is None and new.sampled and new.trace_id != 0
    assert not decide(None, 0.0, rng).sampled
