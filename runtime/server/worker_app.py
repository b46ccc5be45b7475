"""The worker HTTP API (SGLang-compatible), for every role.

One FastAPI app serves colocated, prefill and decode workers; what differs is
the `Backend` that turns a validated request into token events. The HTTP
layer validates, tokenizes, checks capacity (400 before anything is
reserved) and formats; it never touches the engine directly. The handlers
are module functions; what one app owns (backend, tokenizer, limits, the
rids in flight) is a `WorkerState` on `app.state.worker`.

Endpoints: POST /generate, /v1/completions, /v1/chat/completions,
GET /v1/models, /health, /health/live, /health_generate, /get_model_info, /model_info,
/get_server_info, /server_info, POST /abort_request, GET /metrics.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from pdcluster.runtime.http.guard import GuardSettings, RequestGuard
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.pd.failure_labels import reason_label
from pdcluster.runtime.server import responses as R
from pdcluster.runtime.server.api_models import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    normalize_stop,
    refuse_unsupported,
)
from pdcluster.runtime.serving.backend import Backend
from pdcluster.runtime.serving.engine_service import TokenEvent
from pdcluster.runtime.serving.request import BadRequest, BootstrapFields, PreparedRequest
from pdcluster.runtime.telemetry import request_log
from pdcluster.runtime.telemetry.span_plan import RequestOutcome, RequestStamps, Stage

log = logging.getLogger("pdcluster.worker")

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_NEW_TOKENS = 128
# Checked against every sampled token: bounded so a body cannot slow every step.
MAX_STOP_TOKEN_IDS = 64


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...


@dataclass
class WorkerInfo:
    model_name: str
    model_path: str
    max_prompt_tokens: int
    max_new_tokens: int
    vocab_size: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorkerState:
    """Everything one worker app owns; the handlers below read it from `app.state.worker`."""

    backend: Backend
    tokenizer: TextTokenizer
    info: WorkerInfo
    metrics: WorkerMetrics
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    token: str = ""
    data_plane_open: bool = False
    in_flight: set[str] = field(default_factory=set)  # rids of the requests running now
    # Request tracing (`telemetry/tracing.py`); None: off, no request carries stamps.
    tracing: Any = None
    # Asked to stop, draining soon (`announce_stop`): /health says Not Ready, the
    # rest serves as before.
    stopping: bool = False

    def announce_stop(self) -> bool:
        """The worker is about to drain: Not Ready from now on. Whether it was Ready
        (routers may still send to it) just before."""
        was_ready = not self.stopping and self.backend.is_healthy()
        self.stopping = True
        return was_ready

    def sampling_of(
        self,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        max_tokens: int | None,
        seed: int | None,
        ignore_eos: bool,
        stop_token_ids: list[int] | None = None,
        *,
        penalties: tuple[float | None, float | None, float | None] = (None, None, None),
        logprobs: int | None = None,
    ) -> dict[str, Any]:
        """Engine sampling parameters of a body (`penalties`: presence, frequency,
        repetition; `logprobs`: alternatives per token, None for none)."""
        limit = self.info.max_new_tokens
        mt = min(DEFAULT_MAX_NEW_TOKENS, limit) if max_tokens is None else max_tokens
        if mt > limit:
            raise BadRequest(f"max_tokens {mt} exceeds this server's limit {limit}")
        if stop_token_ids is not None and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise BadRequest(
                f"stop_token_ids has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
            )
        return {
            "temperature": 1.0 if temperature is None else temperature,
            "top_p": 1.0 if top_p is None else top_p,
            "top_k": -1 if top_k is None or top_k == 0 else top_k,
            "max_tokens": mt,
            "seed": seed,
            "ignore_eos": ignore_eos,
            "stop_token_ids": list(stop_token_ids or []),
            "presence_penalty": penalties[0] or 0.0,
            "frequency_penalty": penalties[1] or 0.0,
            "repetition_penalty": 1.0 if penalties[2] is None else penalties[2],
            "logprobs": logprobs,
        }

    def prepare(
        self,
        rid: str | None,
        prompt: str | list[int],
        sampling: dict[str, Any],
        stop: str | list[str] | None,
        bootstrap: BootstrapFields,
        rid_is_local: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> PreparedRequest:
        info = self.info
        if isinstance(prompt, str):
            if len(prompt) > info.max_prompt_tokens * 8:
                raise BadRequest(f"prompt is over {info.max_prompt_tokens} tokens")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < info.vocab_size]
            if bad:
                raise BadRequest(f"token ids out of range [0, {info.vocab_size}): {bad[:5]}")
        if not ids:
            raise BadRequest("prompt is empty")
        if len(ids) > info.max_prompt_tokens:
            raise BadRequest(
                f"prompt has {len(ids)} tokens; "
                f"this server accepts at most {info.max_prompt_tokens}"
            )
        try:
            stops = normalize_stop(stop)
        except ValueError as err:
            raise BadRequest(str(err)) from None
        rid_is_local = rid_is_local or rid is None
        rid = rid or uuid.uuid4().hex
        if rid in self.in_flight:
            raise BadRequest(f"rid {rid!r} is already in flight", status=409)
        req = PreparedRequest(rid, ids, sampling, stops, bootstrap, rid_is_local)
        self.backend.check(req)
        if headers is not None:
            req.traceparent = headers.get("traceparent")
            if self.tracing is not None:
                req.trace = self.tracing.request_trace(headers)
                if req.trace.sampled:
                    req.stamps = RequestStamps()
        return req

    async def run(self, req: PreparedRequest) -> AsyncIterator[TokenEvent]:
        metrics = self.metrics
        self.in_flight.add(req.rid)
        metrics.requests_in_flight.inc()
        room = req.bootstrap.bootstrap_room
        trace_id = req.trace.trace_id_hex if req.trace is not None else None
        request_log.bind(req.rid, room, trace_id or request_log.trace_id_of(req.traceparent))
        started, first, finished = time.monotonic(), True, False
        first_at, num_tokens = started, 0
        outcome, detail = "client_disconnect", None
        try:
            async for event in self.backend.events(req):
                if first and event.token_ids:
                    first_at = time.monotonic()
                    metrics.ttft_seconds.observe(first_at - started)
                    first = False
                    if req.stamps is not None:
                        req.stamps.mark(Stage.first_token)
                num_tokens += len(event.token_ids)
                if event.finished:
                    finished = True
                    outcome, detail = reason_label(event.finish_reason), event.error
                    metrics.requests_total.labels(reason=outcome).inc()
                    if num_tokens > 1:
                        tpot = (time.monotonic() - first_at) / (num_tokens - 1)
                        metrics.tpot_seconds.observe(tpot)
                yield event
        finally:
            if not finished:  # the client went away mid-request (the backend aborts it)
                metrics.requests_total.labels(reason="client_disconnect").inc()
            metrics.count_outcome(outcome)
            if finished:
                metrics.prompt_tokens.inc(len(req.prompt_ids))
            metrics.generation_tokens.inc(num_tokens)
            self.in_flight.discard(req.rid)
            metrics.requests_in_flight.dec()
            request_log.unbind(req.rid)
            if req.stamps is not None:
                self._trace(req, req.stamps, outcome, detail, num_tokens)

    def _trace(
        self, req: PreparedRequest, stamps: RequestStamps, outcome: str, detail: str | None, n: int
    ) -> None:
        """Queue this worker's spans of a finished request (`span_plan.py`)."""
        from pdcluster.runtime.metrics import SUCCESS_REASONS
        from pdcluster.runtime.telemetry.span_plan import plan_worker_spans

        failure = None if outcome in SUCCESS_REASONS else (detail or outcome)
        role = str(self.backend.role)  # SGLang names a colocated worker's mode "null"
        records = plan_worker_spans(
            role if role in ("prefill", "decode") else "colocated",
            stamps,
            RequestOutcome(
                time.monotonic_ns(),
                req.bootstrap.bootstrap_room,
                req.rid,
                len(req.prompt_ids),
                n,
                failure,
            ),
        )
        if req.trace is not None:
            self.tracing.submit(req.trace, records)

    async def collect(self, req: PreparedRequest) -> tuple[R.Output, TokenEvent]:
        """What `req` produced, and its last event."""
        out = R.Output()
        last = TokenEvent([], "", True, "abort")
        async for event in self.run(req):
            out.add(event.text, event.token_ids, event.logprobs)
            last = event
        out.finish_reason = last.finish_reason
        return out, last

    async def answer(
        self, req: PreparedRequest, body_of: Callable[[R.Output], dict[str, Any]]
    ) -> JSONResponse:
        """Run `req` to its end; its JSON answer from what it produced, or the error
        it ended with."""
        out, last = await self.collect(req)
        if last.error is not None:
            return self.error_response(last)
        return JSONResponse(body_of(out))

    def error_response(self, event: TokenEvent) -> JSONResponse:
        self.metrics.failures.labels(reason=reason_label(event.finish_reason)).inc()
        return JSONResponse(
            R.error_body(event.error or "request failed", type_="server_error", code=event.status),
            event.status,
        )

    def stream(
        self, req: PreparedRequest, fmt: Callable[[TokenEvent], list[str]]
    ) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            num_tokens, finish = 0, None
            async for event in self.run(req):
                if event.error is not None:
                    self.metrics.failures.labels(reason=reason_label(event.finish_reason)).inc()
                    yield R.sse(R.error_body(event.error, type_="server_error", code=event.status))
                    break
                num_tokens += len(event.token_ids)
                finish = event.finish_reason if event.finished else finish
                for line in fmt(event):
                    yield line
            else:
                yield R.usage_comment(len(req.prompt_ids), num_tokens, finish)
            yield R.DONE

        return StreamingResponse(body(), media_type="text/event-stream")

    def token_text(self, token: int) -> str:
        """A token's text in logprobs (special tokens spelled out)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def model_info(self) -> dict[str, Any]:
        info = self.info
        return {
            "model_path": info.model_path,
            "tokenizer_path": info.model_path,
            "is_generation": True,
            "model_name": info.model_name,
            # What SGLang's router reads to name the model a worker serves.
            "served_model_name": info.model_name,
            "vocab_size": info.vocab_size,
            "max_req_input_len": info.max_prompt_tokens,
        }

    def server_info(self) -> dict[str, Any]:
        info = self.info
        return {
            "disaggregation_mode": self.backend.role,
            "served_model_name": info.model_name,
            "max_prompt_tokens": info.max_prompt_tokens,
            "max_new_tokens": info.max_new_tokens,
            **info.extra,
            **self.backend.server_info(),
        }


def _state(request: Request) -> WorkerState:
    state: WorkerState = request.app.state.worker
    return state


# ------------------------------------------------------------------------ errors
async def _on_invalid(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    _state(request).metrics.rejected.labels(reason="invalid_body").inc()
    parts = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return JSONResponse(R.error_body("; ".join(parts), code=422), 422)


async def _on_bad(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequest)
    _state(request).metrics.rejected.labels(reason="bad_request").inc()
    return JSONResponse(R.error_body(str(exc), code=exc.status), exc.status, exc.headers)


# ------------------------------------------------------------------------ routes
async def generate(body: GenerateRequest, request: Request) -> Response:
    state = _state(request)
    refuse_unsupported(body)
    sp = body.sampling_params
    refuse_unsupported(sp, "sampling_params.")
    num_top = body.top_logprobs_num if body.return_logprob else 0
    sampling = state.sampling_of(
        sp.temperature,
        sp.top_p,
        sp.top_k,
        sp.max_new_tokens,
        sp.seed,
        sp.ignore_eos,
        sp.stop_token_ids,
        penalties=(sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty),
        logprobs=num_top if body.return_logprob else None,
    )
    prompt: str | list[int] = body.text if body.text is not None else body.input_ids or []
    req = state.prepare(
        body.rid, prompt, sampling, sp.stop, body, body.rid_is_local, headers=request.headers
    )
    text_of = state.token_text if body.return_text_in_logprobs else None

    def answer(out: R.Output, finish: str | None) -> dict[str, Any]:
        lps = None
        if body.return_logprob:
            lps = R.generate_logprobs(out.token_ids, out.logprobs, num_top, text_of)
        return R.generate_body(req.rid, out.text, out.token_ids, len(req.prompt_ids), finish, lps)

    if body.stream:
        so_far = R.Output()

        def fmt(event: TokenEvent) -> list[str]:
            so_far.add(event.text, event.token_ids, event.logprobs)
            fin = event.finish_reason if event.finished else None
            return [R.sse(answer(so_far, fin))]

        return state.stream(req, fmt)
    return await state.answer(req, lambda out: answer(out, out.finish_reason))


async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    refuse_unsupported(body)
    prompt: str | list[int]
    if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
        prompt = str(body.prompt[0])
    else:
        prompt = body.prompt  # type: ignore[assignment]
    sampling = state.sampling_of(
        body.temperature,
        body.top_p,
        body.top_k,
        body.max_tokens,
        body.seed,
        body.ignore_eos,
        penalties=(body.presence_penalty, body.frequency_penalty, body.repetition_penalty),
        logprobs=body.logprobs,
    )
    req = state.prepare(body.rid, prompt, sampling, body.stop, body, headers=request.headers)
    model = body.model or state.info.model_name
    usage_at_end = body.stream_options is not None and body.stream_options.include_usage

    def logprobs_of(ids: list[int], lps: list[Any], offset: int) -> dict[str, Any] | None:
        if body.logprobs is None:
            return None
        return R.completion_logprobs(ids, lps, state.token_text, offset)

    if body.stream:
        emitted, num_tokens = 0, 0

        def fmt(event: TokenEvent) -> list[str]:
            nonlocal emitted, num_tokens
            num_tokens += len(event.token_ids)
            fin = event.finish_reason if event.finished else None
            out = []
            if event.text or fin is not None or (body.logprobs is not None and event.token_ids):
                lps = logprobs_of(event.token_ids, event.logprobs, emitted)
                out.append(R.sse(R.completion_chunk(req.rid, model, event.text, fin, lps)))
            emitted += len(event.text)
            if fin is not None and usage_at_end:
                usage = R.usage(len(req.prompt_ids), num_tokens)
                out.append(R.sse(R.usage_chunk("text_completion", f"cmpl-{req.rid}", model, usage)))
            return out

        return state.stream(req, fmt)
    return await state.answer(
        req,
        lambda out: R.completion_body(
            req.rid,
            model,
            out.text,
            out.finish_reason,
            R.usage(len(req.prompt_ids), len(out.token_ids)),
            logprobs_of(out.token_ids, out.logprobs, 0),
        ),
    )


async def chat(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    refuse_unsupported(body)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        prompt = state.tokenizer.encode_chat(messages)
    except ValueError as err:
        raise BadRequest(f"messages: {err}") from None
    max_tokens = body.max_completion_tokens or body.max_tokens
    sampling = state.sampling_of(
        body.temperature,
        body.top_p,
        body.top_k,
        max_tokens,
        body.seed,
        body.ignore_eos,
        penalties=(body.presence_penalty, body.frequency_penalty, body.repetition_penalty),
        logprobs=body.num_logprobs,
    )
    req = state.prepare(body.rid, prompt, sampling, body.stop, body, headers=request.headers)
    model = body.model or state.info.model_name
    usage_at_end = body.stream_options is not None and body.stream_options.include_usage

    def logprobs_of(ids: list[int], lps: list[Any]) -> dict[str, Any] | None:
        if body.num_logprobs is None:
            return None
        return R.chat_logprobs(ids, lps, state.token_text)

    if body.stream:
        first, num_tokens = True, 0

        def fmt(event: TokenEvent) -> list[str]:
            nonlocal first, num_tokens
            num_tokens += len(event.token_ids)
            out = []
            if first:
                out.append(R.sse(R.chat_chunk(req.rid, model, {"role": "assistant"}, None)))
                first = False
            lps = logprobs_of(event.token_ids, event.logprobs) if event.token_ids else None
            if event.text or lps is not None:
                delta = {"content": event.text}
                out.append(R.sse(R.chat_chunk(req.rid, model, delta, None, lps)))
            if event.finished:
                out.append(R.sse(R.chat_chunk(req.rid, model, {}, event.finish_reason)))
                if usage_at_end:
                    usage = R.usage(len(req.prompt_ids), num_tokens)
                    chunk = R.usage_chunk(
                        "chat.completion.chunk", f"chatcmpl-{req.rid}", model, usage
                    )
                    out.append(R.sse(chunk))
            return out

        return state.stream(req, fmt)
    return await state.answer(
        req,
        lambda out: R.chat_body(
            req.rid,
            model,
            out.text,
            out.finish_reason,
            R.usage(len(req.prompt_ids), len(out.token_ids)),
            logprobs_of(out.token_ids, out.logprobs),
        ),
    )


async def abort_request(request: Request) -> JSONResponse:
    state = _state(request)
    try:
        body = AbortRequest.model_validate_json(await request.body())
    except ValidationError as err:
        msg = "; ".join(str(e["msg"]) for e in err.errors())
        return JSONResponse(R.error_body(msg, code=422), 422)
    if body.abort_all:
        state.backend.abort_all()
        return JSONResponse({"aborted": "all"})
    # Exact match only: "req-1" must never abort "req-10".
    found = body.rid in state.in_flight
    if found:
        state.backend.abort(body.rid)
    return JSONResponse({"rid": body.rid, "found": found})


async def health(request: Request) -> Response:
    state = _state(request)
    if state.stopping:
        return JSONResponse({"status": "not_ready", "reason": "stopping"}, 503)
    backend = state.backend
    if backend.is_healthy():
        return Response(status_code=200)
    # PD backends say why (readiness.py); the router and the probes read the status.
    why = getattr(backend, "not_ready_reason", None)
    reason = (why() if why is not None else None) or "not_ready"
    return JSONResponse({"status": "not_ready", "reason": reason}, 503)


async def health_live(request: Request) -> Response:
    # The liveness probe: 503 only for an engine that is gone or hung
    # (`engine_stalled`), never for one still waiting on its peers.
    backend = _state(request).backend
    is_live = getattr(backend, "is_live", backend.is_healthy)
    if is_live():
        return Response(status_code=200)
    why = getattr(backend, "not_ready_reason", None)
    reason = (why() if why is not None else None) or "engine_stopped"
    return JSONResponse({"status": "not_live", "reason": reason}, 503)


async def health_generate(request: Request) -> Response:
    return await health(request)


async def models(request: Request) -> JSONResponse:
    info = _state(request).info
    return JSONResponse(
        {
            "object": "list",
            "data": [{"id": info.model_name, "object": "model", "owned_by": "pdcluster"}],
        }
    )


def model_info(request: Request) -> dict[str, Any]:
    return _state(request).model_info()


def server_info(request: Request) -> dict[str, Any]:
    return _state(request).server_info()


async def metrics_endpoint(request: Request) -> Response:
    registry = _state(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


# (method, path, handler); the JSON-dict handlers get FastAPI's default response.
_ROUTES: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("POST", "/generate", generate),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat),
    ("POST", "/abort_request", abort_request),
    ("GET", "/health", health),
    ("GET", "/health/live", health_live),
    ("GET", "/health_generate", health_generate),
    ("GET", "/v1/models", models),
    ("GET", "/get_model_info", model_info),
    ("GET", "/model_info", model_info),
    ("GET", "/get_server_info", server_info),
    ("GET", "/server_info", server_info),
    ("GET", "/metrics", metrics_endpoint),
)


def create_worker_app(
    backend: Backend,
    tokenizer: TextTokenizer,
    info: WorkerInfo,
    metrics: WorkerMetrics,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    token: str = "",
    data_plane_open: bool = False,
    extra_routes: Callable[[FastAPI], None] | None = None,
    tracing: Any = None,
) -> FastAPI:
    app = FastAPI(title=f"pdcluster worker ({backend.role})", docs_url=None, redoc_url=None)
    app.state.worker = WorkerState(
        backend, tokenizer, info, metrics, max_body_bytes, token, data_plane_open, tracing=tracing
    )
    # Auth and the body limit, before routing (plain ASGI: no task per request).
    app.add_middleware(
        RequestGuard,
        settings=GuardSettings(token, data_plane_open, max_body_bytes),
        on_reject=lambda reason: metrics.rejected.labels(reason=reason).inc(),
    )
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(BadRequest, _on_bad)
    for method, path, handler in _ROUTES:
        app.add_api_route(path, handler, methods=[method], response_model=None)
    if extra_routes is not None:
        extra_routes(app)
    return app
