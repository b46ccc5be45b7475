"""Worker stand-ins for router tests: the worker HTTP API, no engine behind it.

Each stand-in follows the worker contract the router relies on (SGLang-style
`/generate`, OpenAI `/v1/completions` and `/v1/chat/completions` with the
bootstrap fields, `/health`, `/get_server_info`, `/get_model_info`,
`/abort_request` by exact rid) and records what it received, so tests can
assert on both legs. Prefill and decode stand-ins of one `Rendezvous` meet
by room, like real ones exchanging KV: a prefill leg waits for its decode
leg and the decode leg waits for its prefill leg, so a router that sent the
legs one after the other would hang instead of passing.

Outputs are a pure function of the request (``n`` words " w0 w1 ..."), so a
test can compute what the client must see.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

DEFAULT_TOKENS = 4
RENDEZVOUS_TIMEOUT_S = 5.0
# A hanging stand-in still ends by itself, so no test can leave it running.
MAX_HANG_S = 10.0


def words(n: int) -> list[str]:
    return [f" w{i}" for i in range(n)]


@dataclass
class Behaviour:
    """Knobs a test turns; read on every request."""

    healthy: bool = True
    # Answer the generation endpoints with this status and an error body.
    fail_status: int | None = None
    fail_message: str = "injected failure"
    # Send an SSE error event (stream) or an error payload after N tokens.
    error_after_tokens: int | None = None
    # Generate until aborted (or the client goes away).
    hang: bool = False
    token_delay_s: float = 0.0
    # Delay before the response headers (a slow prefill, a slow decode).
    start_delay_s: float = 0.0
    # End a stream without `data: [DONE]` (a truncated stream).
    omit_done: bool = False
    # Seconds between `data: [DONE]` and the end of the body (its chunked
    # terminator), as a worker's last segment can trail its last event.
    end_delay_s: float = 0.0
    # Report this as disaggregation_mode instead of the real role.
    mode_override: str | None = None
    # Decode serves without its prefill leg (a decode that recomputes the prompt).
    solo: bool = False
    # Delay before /get_server_info answers (a pod that just started).
    info_delay_s: float = 0.0
    # A decode's `peers_down` in /get_server_info (prefills it refuses rooms on).
    peers_down: dict[str, str] | None = None
    # What /metrics says is in flight, and how long it takes to say it.
    in_flight: int = 0
    metrics_delay_s: float = 0.0

    def set(self, **knobs: object) -> None:
        """Turn several knobs at once; a name that is no knob raises and turns none."""
        unknown = sorted(set(knobs) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"no such behaviour knob: {', '.join(unknown)}")
        for name, value in knobs.items():
            setattr(self, name, value)


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    at: float
    raw: bytes = b""  # the bytes as they arrived
    client_port: int = 0  # the sender's port: one per connection


class Rendezvous:
    """Prefill and decode legs of one room wait for each other."""

    def __init__(self) -> None:
        self._arrived: dict[tuple[int, str], asyncio.Event] = {}

    def _event(self, room: int, role: str) -> asyncio.Event:
        return self._arrived.setdefault((room, role), asyncio.Event())

    def arrive(self, room: int, role: str) -> None:
        self._event(room, role).set()

    async def meet(self, room: int, role: str, peer: str, aborted: asyncio.Event) -> bool:
        """Wait for the peer leg; False when it never came or the rid was aborted."""
        self.arrive(room, role)
        arrived = asyncio.ensure_future(self._event(room, peer).wait())
        stop = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait(
                {arrived, stop}, timeout=RENDEZVOUS_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            arrived.cancel()
            stop.cancel()
        return self._event(room, peer).is_set() and not aborted.is_set()


@dataclass
class StandinWorker:
    role: str  # prefill | decode | colocated
    model_path: str = "tiny"
    bootstrap_port: int = 8998
    dp_size: int = 1
    rendezvous: Rendezvous | None = None
    behaviour: Behaviour = field(default_factory=Behaviour)
    received: list[Received] = field(default_factory=list)
    aborts: list[tuple[str, float]] = field(default_factory=list)
    _running: dict[str, asyncio.Event] = field(default_factory=dict)
    url: str = ""

    # ---------------------------------------------------------------- state
    def bodies(self, path: str | None = None) -> list[dict[str, Any]]:
        return [r.body for r in self.received if path is None or r.path == path]

    def aborted_rids(self) -> list[str]:
        return [rid for rid, _ in self.aborts]

    def abort_time(self, rid: str) -> float | None:
        for got, at in self.aborts:
            if got == rid:
                return at
        return None

    # ----------------------------------------------------------- generation
    async def _admit(self, body: dict[str, Any]) -> str | None:
        """The rendezvous; returns an error message when the peer never came."""
        if self.rendezvous is None or self.role == "colocated":
            return None
        room = body.get("bootstrap_room")
        if not isinstance(room, int):
            return "missing bootstrap_room"
        if self.behaviour.solo:
            self.rendezvous.arrive(room, self.role)
            return None
        peer = "decode" if self.role == "prefill" else "prefill"
        aborted = self._running[body["rid"]]
        if not await self.rendezvous.meet(room, self.role, peer, aborted):
            return f"{peer} leg for room {room} never arrived (or was aborted)"
        return None

    async def _tokens(self, rid: str, count: int) -> AsyncIterator[tuple[int, str | None]]:
        """Yield (index, None) per token, or (index, reason) when it stops early."""
        aborted = self._running.setdefault(rid, asyncio.Event())
        give_up = time.monotonic() + MAX_HANG_S
        try:
            index = 0
            while (self.behaviour.hang and time.monotonic() < give_up) or index < count:
                if aborted.is_set():
                    yield index, "abort"
                    return
                if self.behaviour.error_after_tokens == index:
                    yield index, "error"
                    return
                if self.behaviour.token_delay_s or self.behaviour.hang:
                    await asyncio.sleep(self.behaviour.token_delay_s or 0.01)
                yield index, None
                index += 1
        finally:
            self._running.pop(rid, None)

    def _count(self, path: str, body: dict[str, Any]) -> int:
        if self.role == "prefill":
            return 1
        if path == "/generate":
            params = body.get("sampling_params") or {}
            return int(params.get("max_new_tokens", DEFAULT_TOKENS))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        return DEFAULT_TOKENS if limit is None else int(limit)

    def _prompt_tokens(self, path: str, body: dict[str, Any]) -> int:
        if path == "/generate":
            if body.get("input_ids") is not None:
                return len(body["input_ids"])
            return len(str(body.get("text", "")).split())
        if path == "/v1/chat/completions":
            return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        prompt = body.get("prompt", "")
        return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())

    # -------------------------------------------------------------- shapes
    def _final(self, path: str, body: dict[str, Any], n: int, reason: str) -> dict[str, Any]:
        rid = body["rid"]
        text = "".join(words(n))
        prompt_tokens = self._prompt_tokens(path, body)
        if path == "/generate":
            return {
                "text": text,
                "output_ids": list(range(n)),
                "meta_info": {
                    "id": rid,
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "finish_reason": {"type": reason},
                },
            }
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
        }
        if path == "/v1/chat/completions":
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": reason}
            return {**self._openai(f"chatcmpl-{rid}", "chat.completion", choice), "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._openai(f"cmpl-{rid}", "text_completion", choice), "usage": usage}

    def _chunk(self, path: str, body: dict[str, Any], i: int, reason: str | None) -> dict[str, Any]:
        rid = body["rid"]
        piece = "" if reason is not None else words(i + 1)[i]
        if path == "/generate":
            return {
                "text": "".join(words(i + (0 if reason else 1))),
                "output_ids": list(range(i + (0 if reason else 1))),
                "meta_info": {
                    "id": rid,
                    "finish_reason": None if reason is None else {"type": reason},
                },
            }
        if path == "/v1/chat/completions":
            delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
            return self._openai(f"chatcmpl-{rid}", "chat.completion.chunk", choice)
        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
        return self._openai(f"cmpl-{rid}", "text_completion", choice)

    def _openai(self, id_: str, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        """An OpenAI-style response or chunk with one choice."""
        return {
            "id": id_,
            "object": kind,
            "created": int(time.time()),
            "model": self.model_path,
            "choices": [choice],
        }

    @staticmethod
    def _error(message: str, status: int) -> dict[str, Any]:
        return {"error": {"message": message, "type": "server_error", "code": status}}

    async def _serve(self, path: str, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        port = request.client.port if request.client is not None else 0
        self.received.append(Received(path, body, time.monotonic(), raw, port))
        # Registered before any wait, so an early abort is never lost.
        self._running.setdefault(body["rid"], asyncio.Event())
        b = self.behaviour
        if b.start_delay_s:
            await asyncio.sleep(b.start_delay_s)
        if b.fail_status is not None:
            return JSONResponse(self._error(b.fail_message, b.fail_status), b.fail_status)
        problem = await self._admit(body)
        if problem is not None:
            return JSONResponse(self._error(problem, 500), 500)
        count = self._count(path, body)
        rid = body["rid"]
        if body.get("stream"):
            return StreamingResponse(
                self._stream(path, body, rid, count), media_type="text/event-stream"
            )
        n, reason = 0, "length"
        async for i, stop in self._tokens(rid, count):
            if stop == "error":
                return JSONResponse(self._error(b.fail_message, 500))
            if stop is not None:
                reason = stop
                break
            n = i + 1
        return JSONResponse(self._final(path, body, n, reason))

    async def _stream(
        self, path: str, body: dict[str, Any], rid: str, count: int
    ) -> AsyncIterator[str]:
        reason = "length"
        n = 0
        async for i, stop in self._tokens(rid, count):
            if stop == "error":
                yield f"data: {json.dumps(self._error(self.behaviour.fail_message, 500))}\n\n"
                yield "data: [DONE]\n\n"
                return
            if stop is not None:
                reason = stop
                break
            yield f"data: {json.dumps(self._chunk(path, body, i, None))}\n\n"
            n = i + 1
        yield f"data: {json.dumps(self._chunk(path, body, n, reason))}\n\n"
        options = body.get("stream_options") or {}
        if options.get("include_usage") and path != "/generate":
            final = self._final(path, body, n, reason)
            chunk = self._chunk(path, body, n, reason)
            chunk["choices"] = []
            chunk["usage"] = final["usage"]
            yield f"data: {json.dumps(chunk)}\n\n"
        # What our workers end a stream with (server/responses.py): the router counts it.
        usage = {"prompt_tokens": self._prompt_tokens(path, body), "completion_tokens": n}
        yield f": usage {json.dumps({**usage, 'finish_reason': reason})}\n\n"
        if not self.behaviour.omit_done:
            yield "data: [DONE]\n\n"
        if self.behaviour.end_delay_s:
            await asyncio.sleep(self.behaviour.end_delay_s)

    # ------------------------------------------------------------------ app
    def build_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            return await self._serve("/generate", request)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._serve("/v1/completions", request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._serve("/v1/chat/completions", request)

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.behaviour.healthy else 503)

        @app.get("/get_server_info")
        async def server_info() -> dict[str, Any]:
            if self.behaviour.info_delay_s:
                await asyncio.sleep(self.behaviour.info_delay_s)
            mode = {"prefill": "prefill", "decode": "decode", "colocated": "null"}[self.role]
            info: dict[str, Any] = {
                "disaggregation_mode": self.behaviour.mode_override or mode,
                "dp_size": self.dp_size,
            }
            if self.role == "prefill":
                info["bootstrap_port"] = self.bootstrap_port
            if self.role == "decode":
                info["peers_down"] = dict(self.behaviour.peers_down or {})
            return info

        @app.get("/metrics")
        async def metrics() -> Response:
            if self.behaviour.metrics_delay_s:
                await asyncio.sleep(self.behaviour.metrics_delay_s)
            text = (
                "# TYPE pdcluster_requests_in_flight gauge\n"
                f"pdcluster_requests_in_flight {self.behaviour.in_flight}\n"
            )
            return Response(text, media_type="text/plain")

        @app.get("/get_model_info")
        async def model_info() -> dict[str, Any]:
            return {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
            }

        @app.post("/abort_request")
        async def abort_request(request: Request) -> dict[str, Any]:
            body = await request.json()
            rid = body.get("rid", "")
            self.aborts.append((rid, time.monotonic()))
            event = self._running.get(rid)  # exact rid only
            if event is not None:
                event.set()
            return {"aborted": event is not None}

        return app
