"""What the router records of one relayed request: its outcome, its tokens, its spans.

The relay tells the record what it sees (an answer's `usage`, a stream's
closing usage comment, a leg failure, a deadline, a client that left); the
first outcome wins, so a failure that set off an abandon is not renamed by
the abandon. `finish` runs once, when the relay closes: it counts the
request (`pdcluster_router_request_success_total` by finish reason or
`..._request_failure_total` by reason, the token counters) and ends the
spans.

With tracing on the record decides the request's trace when it arrives
(`telemetry/trace_context.py`: the client's `traceparent` continued, or a
new trace sampled at the manifest's ratio), mints the span id of each leg,
which goes out as the leg's `traceparent` so each worker's spans join the
same trace, and stamps the plan's and the legs' times. Its spans —
`router.request` (server; the client's span its parent), `router.plan` and
one client span per leg — are built off the request's path once it ended
(`Tracing.submit`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.router.metrics import SUCCESS_REASONS, RouterMetrics
from pdcluster.runtime.telemetry import request_log
from pdcluster.runtime.telemetry.span_plan import AttributeValue, SpanKind, SpanRecord
from pdcluster.runtime.telemetry.trace_context import RequestTrace, new_id

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


@dataclass
class _Leg:
    span_id: int
    url: str
    start_ns: int
    end_ns: int | None = None
    error: str | None = None


class RequestRecord:
    """One request's outcome, tokens and (tracing on) span ids and stage times."""

    def __init__(self, tracing: Any = None, trace: RequestTrace | None = None) -> None:
        self.tracing = tracing
        self.trace = trace  # tracing on: ids and the sampling decision, made on arrival
        self.started_ns = time.monotonic_ns()
        self.outcome: str | None = None
        self.prompt_tokens = 0
        self.output_tokens = 0
        self._span_id = 0 if trace is None else new_id(tracing.rng, 64)
        self._plan: tuple[int, int, str | None] | None = None
        self._legs: list[tuple[str, _Leg]] = []  # in order; a role may have retries
        self._path = ""
        self._rid: str | None = None
        self._room: int | None = None
        self._finished = False

    @classmethod
    def arriving(cls, tracing: Any, headers: Mapping[str, str], path: str) -> RequestRecord:
        """A request that just arrived: its trace decided when tracing is on."""
        if tracing is None:
            return cls()
        record = cls(tracing, tracing.request_trace(headers))
        record._path = path
        return record

    # ------------------------------------------------------------- facts
    def set_outcome(self, reason: str) -> None:
        if self.outcome is None:
            self.outcome = reason

    def planned(self, error: str | None = None) -> None:
        """The legs are planned (or planning failed with `error`)."""
        self._plan = (self.started_ns, time.monotonic_ns(), error)

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

    def started(self, rid: str, room: int | None) -> None:
        """The legs are planned: the request's log lines name it from now on."""
        self._rid, self._room = rid, room
        trace_id = self.trace.trace_id_hex if self.trace is not None else None
        request_log.bind(rid, room, trace_id)

    # ------------------------------------------------------------- legs
    def leg_headers(self, role: str, url: str) -> dict[str, str]:
        """Headers of a leg's request: JSON, and with tracing the leg span's `traceparent`."""
        if self.trace is None:
            return JSON_CONTENT
        span_id = new_id(self.tracing.rng, 64)
        self._legs.append((role, _Leg(span_id, url, time.monotonic_ns())))
        return {**JSON_CONTENT, **self.trace.child_header(span_id)}

    def end_leg(self, role: str, error: str | None = None) -> None:
        """The latest open leg of `role` ended (with `error` when it failed)."""
        for name, leg in reversed(self._legs):
            if name == role and leg.end_ns is None:
                leg.end_ns, leg.error = time.monotonic_ns(), error
                return

    # ------------------------------------------------------------ the end
    def finish(self, metrics: RouterMetrics) -> None:
        if self._finished:
            return
        self._finished = True
        outcome = self.outcome or "incomplete"
        metrics.count_outcome(outcome, self.prompt_tokens, self.output_tokens)
        if self._rid is not None:
            request_log.unbind(self._rid)
        if self.trace is not None and self.trace.sampled:
            failure = None if outcome in SUCCESS_REASONS else outcome
            self.tracing.submit(self.trace, self.spans(time.monotonic_ns(), failure))

    def spans(self, end_ns: int, failure: str | None) -> list[SpanRecord]:
        """The router's spans of this request: the request, its plan, its legs."""
        ids: dict[str, AttributeValue] = {}
        if self._rid is not None:
            ids["pdcluster.rid"] = self._rid
        if self._room is not None:
            ids["pdcluster.room"] = self._room
        head: dict[str, AttributeValue] = {
            **ids,
            "http.route": self._path,
            "pdcluster.prompt_tokens": self.prompt_tokens,
            "pdcluster.output_tokens": self.output_tokens,
        }
        if failure is not None:
            head["pdcluster.failure_reason"] = failure
        records = [
            SpanRecord(
                "router.request",
                self.started_ns,
                end_ns,
                head,
                failure,
                SpanKind.server,
                self._span_id,
            )
        ]
        if self._plan is not None:
            start, end, error = self._plan
            records.append(SpanRecord("router.plan", start, end, {}, error))
        for role, leg in self._legs:
            attributes: dict[str, AttributeValue] = {**ids, "server.address": leg.url}
            error = leg.error if leg.end_ns is not None else failure
            if error is not None:
                attributes["pdcluster.failure_reason"] = error
            records.append(
                SpanRecord(
                    f"router.{role}_leg",
                    leg.start_ns,
                    leg.end_ns or end_ns,
                    attributes,
                    error,
                    SpanKind.client,
                    leg.span_id,
                )
            )
        return records
