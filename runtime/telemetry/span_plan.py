"""Which spans one worker's part of a request makes, from its stage stamps.

A worker never holds an OpenTelemetry span open while a request runs: the
places that see a stage (the coordinator on the engine thread, the HTTP
layer) only stamp it, `RequestStamps.mark`, one dict write. When the request
ends the HTTP layer turns the stamps into `SpanRecord`s here and the edge
(`tracing.py`) exports them with their real start and end times. So tracing
adds no lock and no SDK call to the engine thread, and a worker without
tracing carries no stamps at all (`PreparedRequest.trace` is None).

The records of one request, in order: the worker's request span (the
parent of the rest, itself the child of the router's leg span named by the
incoming `traceparent`), then one span per stage that started:

    prefill.request ─┬─ prefill.compute   compute start → first token sampled
                     └─ kv.transfer       paired and computing → every rank's KV sent
    decode.request  ─┬─ decode.wait_kv    pages reserved (or leg open) → KV from every source
                     ├─ decode.first_token KV received → first token to the client
                     └─ decode.stream     first token → last token

A stage that started but never ended (the request failed in it) ends with
the request and carries the failure reason; the request span does too.
Every span has the room and the rid as attributes.

Pure module: stamps in, records out; the clock is read only by `mark`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

AttributeValue = str | int | float | bool

ROOM = "pdcluster.room"
RID = "pdcluster.rid"
ROLE = "pdcluster.role"
FAILURE_REASON = "pdcluster.failure_reason"
KV_BYTES = "pdcluster.kv.bytes"
KV_BACKEND = "pdcluster.kv.backend"
PROMPT_TOKENS = "pdcluster.prompt_tokens"
OUTPUT_TOKENS = "pdcluster.output_tokens"


class Stage:
    """Stage names the coordinator and the HTTP layer stamp."""

    compute_start = "compute_start"  # prefill: the engine took the prompt
    first_token = "first_token"  # prefill: sampled; decode: delivered to the client
    paired = "paired"  # prefill: every rank has every destination's metadata
    kv_sent = "kv_sent"  # prefill: every rank sent its KV (Success)
    pages_reserved = "pages_reserved"  # decode: admission reserved the prompt's pages
    kv_received = "kv_received"  # decode: Success from every source on every rank


@dataclass
class RequestStamps:
    """One request's stages on one worker (monotonic ns), and facts for attributes.

    Written by whichever thread sees a stage, read once the request ended
    (its last token event went through the engine's queue, which orders the
    writes before the read). The first stamp of a stage wins.
    """

    received_ns: int = field(default_factory=time.monotonic_ns)
    stages: dict[str, int] = field(default_factory=dict)
    attributes: dict[str, AttributeValue] = field(default_factory=dict)

    def mark(self, stage: str, t_ns: int | None = None) -> None:
        if stage not in self.stages:
            self.stages[stage] = time.monotonic_ns() if t_ns is None else t_ns

    def note(self, key: str, value: AttributeValue) -> None:
        self.attributes[key] = value


class SpanKind(enum.StrEnum):
    server = "server"
    client = "client"
    internal = "internal"


@dataclass(frozen=True)
class SpanRecord:
    """A finished span, monotonic ns times. In a list the first record is the
    parent of the others unless a record names its `parent_id`; a `span_id`
    of 0 is left to the exporter to choose."""

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, AttributeValue]
    error: str | None = None
    kind: SpanKind = SpanKind.internal
    span_id: int = 0
    parent_id: int = 0


@dataclass(frozen=True)
class RequestOutcome:
    """How the request ended on this worker."""

    end_ns: int
    room: int | None
    rid: str
    prompt_tokens: int
    output_tokens: int
    failure: str | None = None  # the reason, None for a success


# (span name, start stage or None for the request's arrival, end stage or None for its end)
_PREFILL_STAGES: tuple[tuple[str, str | None, str | None], ...] = (
    ("prefill.compute", Stage.compute_start, Stage.first_token),
    ("kv.transfer", Stage.paired, Stage.kv_sent),
)
_DECODE_STAGES: tuple[tuple[str, str | None, str | None], ...] = (
    ("decode.wait_kv", Stage.pages_reserved, Stage.kv_received),
    ("decode.first_token", Stage.kv_received, Stage.first_token),
    ("decode.stream", Stage.first_token, None),
)
_STAGES_OF_ROLE = {"prefill": _PREFILL_STAGES, "decode": _DECODE_STAGES, "colocated": ()}
# Facts that belong on one stage span rather than on the request.
_STAGE_ATTRIBUTES = {
    "kv.transfer": (KV_BYTES, KV_BACKEND),
    "decode.wait_kv": (KV_BYTES, KV_BACKEND),
}


def plan_worker_spans(
    role: str, stamps: RequestStamps, outcome: RequestOutcome
) -> list[SpanRecord]:
    """The request span of `role`'s worker, then one span per stage that started."""
    if role not in _STAGES_OF_ROLE:
        raise ValueError(f"role must be one of {sorted(_STAGES_OF_ROLE)}, got {role!r}")
    ids: dict[str, AttributeValue] = {RID: outcome.rid}
    if outcome.room is not None:
        ids[ROOM] = outcome.room
    end = max(outcome.end_ns, stamps.received_ns)
    request_attributes: dict[str, AttributeValue] = {
        **ids,
        ROLE: role,
        PROMPT_TOKENS: outcome.prompt_tokens,
        OUTPUT_TOKENS: outcome.output_tokens,
        **{k: v for k, v in stamps.attributes.items() if not _is_stage_attribute(k)},
    }
    if outcome.failure is not None:
        request_attributes[FAILURE_REASON] = outcome.failure
    records = [
        SpanRecord(f"{role}.request", stamps.received_ns, end, request_attributes, outcome.failure)
    ]
    for name, first, last in _STAGES_OF_ROLE[role]:
        start = stamps.stages.get(first) if first is not None else stamps.received_ns
        if start is None:
            continue
        stop = stamps.stages.get(last) if last is not None else end
        failed_here = stop is None
        attributes: dict[str, AttributeValue] = dict(ids)
        for key in _STAGE_ATTRIBUTES.get(name, ()):
            if key in stamps.attributes:
                attributes[key] = stamps.attributes[key]
        error = outcome.failure if failed_here or (last is None and outcome.failure) else None
        if error is not None:
            attributes[FAILURE_REASON] = error
        records.append(
            SpanRecord(name, start, max(start, end if stop is None else stop), attributes, error)
        )
    return records


def _is_stage_attribute(key: str) -> bool:
    return any(key in keys for keys in _STAGE_ATTRIBUTES.values())
