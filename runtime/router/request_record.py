"""What the router records of one relayed request: its outcome, its tokens, its spans.

The relay tells the record what it sees (an answer's `usage`, a stream's
closing usage comment, a leg failure, a deadline, a client that left); the
first outcome wins, so a failure that set off an abandon is not renamed by
the abandon. `finish` runs once, when the relay closes: it counts the
request (`pdcluster_router_request_success_total` by finish reason or
`..._request_failure_total` by reason, the token counters) and ends the
spans.

With tracing on (`telemetry/tracing.py`) the record holds the request's
spans: `router.request` (server span, the client's `traceparent` as
parent), `router.plan`, and one client span per leg, whose context goes
out as the leg's `traceparent` so each worker's spans join the same trace.
"""

from __future__ import annotations

import json
from typing import Any

from pdcluster.runtime.router.metrics import RouterMetrics
from pdcluster.runtime.telemetry import request_log

# The SSE comment a worker's stream ends with (`server/responses.py`, usage_comment).
USAGE_COMMENT = ": usage "
JSON_CONTENT = {"content-type": "application/json"}


def usage_of(payload: Any) -> tuple[int, int, str | None]:
    """(prompt tokens, completion tokens, finish reason) of a worker's answer.

    Reads OpenAI's `usage` and `choices[0].finish_reason`, SGLang's
    `meta_info`; what a payload lacks counts as 0 / None.
    """
    if not isinstance(payload, dict):
        return 0, 0, None
    usage = payload.get("usage") or payload.get("meta_info") or {}
    if not isinstance(usage, dict):
        usage = {}
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    finish: Any = usage.get("finish_reason")
    choices = payload.get("choices")
    if finish is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
        finish = choices[0].get("finish_reason")
    if isinstance(finish, dict):  # SGLang: {"type": "stop", ...}
        finish = finish.get("type")
    return (
        prompt if isinstance(prompt, int) else 0,
        completion if isinstance(completion, int) else 0,
        finish if isinstance(finish, str) else None,
    )


class RequestRecord:
    def __init__(self, tracing: Any = None, span: Any = None) -> None:
        self.tracing = tracing
        self.span = span  # router.request (tracing on)
        self.outcome: str | None = None
        self.prompt_tokens = 0
        self.output_tokens = 0
        self._legs: dict[str, Any] = {}
        self._rid: str | None = None
        self._finished = False

    # ------------------------------------------------------------- facts
    def set_outcome(self, reason: str) -> None:
        if self.outcome is None:
            self.outcome = reason

    def read_answer(self, payload: Any, failed: str | None) -> None:
        """A whole (non-streamed) answer; `failed`: the reason when it reports an error."""
        self.prompt_tokens, self.output_tokens, finish = usage_of(payload)
        self.set_outcome(failed or finish or "stop")

    def read_usage_comment(self, line: str) -> None:
        """A stream's closing `: usage {...}` line."""
        try:
            usage = json.loads(line[len(USAGE_COMMENT) :])
        except json.JSONDecodeError:
            return
        self.prompt_tokens, self.output_tokens, finish = usage_of({"usage": usage})
        if finish is not None:
            self.set_outcome(finish)

    # ------------------------------------------------------------- spans
    def started(self, rid: str, room: int | None) -> None:
        """The legs are planned: the request's log lines name it from now on."""
        self._rid = rid
        trace_id = None
        if self.span is not None:
            attributes: dict[str, Any] = {"pdcluster.rid": rid}
            if room is not None:
                attributes["pdcluster.room"] = room
            self.span.set_attributes(attributes)
            trace_id = self.tracing.trace_id(self.span)
        request_log.bind(rid, room, trace_id)

    def leg_headers(self, role: str, url: str, rid: str, room: int | None) -> dict[str, str]:
        """Headers of a leg's request: JSON, and with tracing its span's `traceparent`."""
        if self.span is None:
            return JSON_CONTENT
        from opentelemetry.trace import SpanKind

        attributes: dict[str, Any] = {"pdcluster.rid": rid, "server.address": url}
        if room is not None:
            attributes["pdcluster.room"] = room
        leg = self.tracing.start_span(
            f"router.{role}_leg", self.tracing.context_of(self.span), SpanKind.CLIENT, attributes
        )
        self._legs[role] = leg
        return {**JSON_CONTENT, **self.tracing.headers_for(leg)}

    def end_leg(self, role: str, error: str | None = None) -> None:
        leg = self._legs.pop(role, None)
        if leg is not None:
            self.tracing.end_span(leg, error)

    # ------------------------------------------------------------ the end
    def finish(self, metrics: RouterMetrics) -> None:
        if self._finished:
            return
        self._finished = True
        outcome = self.outcome or "incomplete"
        metrics.count_outcome(outcome, self.prompt_tokens, self.output_tokens)
        if self._rid is not None:
            request_log.unbind(self._rid)
        if self.span is None:
            return
        from pdcluster.runtime.router.metrics import SUCCESS_REASONS

        error = None if outcome in SUCCESS_REASONS else outcome
        for role in list(self._legs):
            self.end_leg(role, error)
        self.tracing.end_span(
            self.span,
            error,
            {
                "pdcluster.prompt_tokens": self.prompt_tokens,
                "pdcluster.output_tokens": self.output_tokens,
            },
        )


def start_request_span(tracing: Any, headers: Any, path: str) -> tuple[Any, Any]:
    """`router.request` (the client's `traceparent` its parent) and `router.plan` under it."""
    from opentelemetry.trace import SpanKind

    span = tracing.start_span(
        "router.request", tracing.incoming(headers), SpanKind.SERVER, {"http.route": path}
    )
    plan = tracing.start_span("router.plan", tracing.context_of(span), SpanKind.INTERNAL)
    return span, plan
