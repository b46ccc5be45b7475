"""W3C trace context and the sampling decision, decided at the request's edge.

A request's ids are chosen when it arrives, not when its spans are built:
the router mints its request span's and each leg's span id, sends each leg
`traceparent: 00-<trace id>-<leg span id>-<flags>`, and builds every span
later, off the request's path (`tracing.py`). So the router and the
workers need from the SDK nothing but an exporter thread, and a request
that is not sampled costs a header parse.

Rules (W3C Trace Context, version 00):
- `traceparent` is `00-` 32 hex digits (trace id) `-` 16 hex (parent span
  id) `-` 2 hex (flags); lowercase on the wire; an all-zero id, a version
  `ff`, or anything malformed is no parent (a new trace starts);
- flag bit 0 is "sampled": a caller's decision is followed;
- a new trace is sampled when the low 64 bits of its id fall under
  `ratio × 2⁶⁴` — the OpenTelemetry SDK's `TraceIdRatioBased` rule, so its
  `ParentBased(TraceIdRatioBased)` sampler agrees with every decision here.

Pure module (ids come from the caller's random source).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_LOW_64 = (1 << 64) - 1
SAMPLED = 0x01


class RandomBits(Protocol):
    def getrandbits(self, k: int, /) -> int: ...


@dataclass(frozen=True)
class TraceContext:
    trace_id: int
    span_id: int  # the caller's span: the parent of ours
    sampled: bool
    tracestate: str = ""


def parse_traceparent(header: str | None, tracestate: str | None = None) -> TraceContext | None:
    """The caller's context, or None when the header is absent or not a valid traceparent."""
    if header is None:
        return None
    match = _TRACEPARENT.match(header.strip().lower())
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return TraceContext(trace_id, span_id, bool(int(flags_hex, 16) & SAMPLED), tracestate or "")


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{SAMPLED if sampled else 0:02x}"


def trace_id_hex(trace_id: int) -> str:
    return f"{trace_id:032x}"


def new_id(rng: RandomBits, bits: int) -> int:
    """A random non-zero id of `bits` bits (trace ids 128, span ids 64)."""
    while True:
        value = rng.getrandbits(bits)
        if value:
            return value


def is_sampled_root(trace_id: int, ratio: float) -> bool:
    """Whether a new trace with this id is kept at `ratio` (TraceIdRatioBased's bound)."""
    return trace_id & _LOW_64 < round(ratio * (_LOW_64 + 1))


@dataclass(frozen=True)
class RequestTrace:
    """One request's place in its trace on this process: ids decided, spans built later."""

    trace_id: int
    parent_id: int | None  # the caller's span; None: this process started the trace
    sampled: bool
    tracestate: str = ""

    @property
    def trace_id_hex(self) -> str:
        return trace_id_hex(self.trace_id)

    def child_header(self, span_id: int) -> dict[str, str]:
        """The headers that make `span_id` the parent of a call."""
        headers = {"traceparent": format_traceparent(self.trace_id, span_id, self.sampled)}
        if self.tracestate:
            headers["tracestate"] = self.tracestate
        return headers


def decide(incoming: TraceContext | None, ratio: float, rng: RandomBits) -> RequestTrace:
    """Continue the caller's trace (and its decision), or start one sampled at `ratio`."""
    if incoming is not None:
        return RequestTrace(
            incoming.trace_id, incoming.span_id, incoming.sampled, incoming.tracestate
        )
    trace_id = new_id(rng, 128)
    return RequestTrace(trace_id, None, is_sampled_root(trace_id, ratio))
