"""Client request bodies: validation, and the bodies each worker leg receives.

The router checks what it must understand (model, prompt/messages shape,
stream flag, fields it owns) and forwards every other field untouched, so
the worker stays the authority on sampling parameters it supports.

Invariants:
- `rid`, the `bootstrap_*` fields and `kv_transfer_params` are the router's;
  a client that sends them gets a 400, so no client can pick another
  request's room or another request's KV;
- `data_parallel_rank` is the router's too (its rooms already say the
  prefill dp group: `room % dp`); a client's is dropped, never forwarded;
- in disaggregated mode one request is one room: batched prompts and
  ``n > 1`` are refused with a 400 instead of being half-served;
- both legs of a request get the same body, differing in nothing.

Pure module.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdcluster.runtime.router.errors import RouterError

ROUTER_OWNED_FIELDS = (
    "rid",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    # vLLM's connector hand-off between the legs (vllm_legs.py).
    "kv_transfer_params",
)
# Router-owned too, but dropped rather than refused: clients written for other
# PD routers send it, and the room the router mints already decides it.
ROUTER_STRIPPED_FIELDS = ("data_parallel_rank",)


class Endpoint(enum.StrEnum):
    completions = "/v1/completions"
    chat = "/v1/chat/completions"
    generate = "/generate"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    """The fields the completion and chat bodies share, after their own.

    A body lists this first among its bases and keeps its own fields in a
    second base: pydantic orders fields from the last base to the first, so
    these come last, and the first error reported stays the same."""

    temperature: float | int | None = Field(default=None, ge=0)
    top_p: float | int | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream_options: StreamOptions | None = None


class _CompletionPrompt(_Lenient):
    model: str = Field(min_length=1)
    prompt: str | list[int] | list[str] | list[list[int]]
    stream: bool = False
    n: int = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=None, ge=0)


class CompletionBody(_Sampling, _CompletionPrompt):
    pass


class ChatMessage(_Lenient):
    role: str = Field(min_length=1)
    content: str | list[Any] | None = None


class _ChatMessages(_Lenient):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    n: int = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)


class ChatBody(_Sampling, _ChatMessages):
    pass


class GenerateBody(_Lenient):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False


_MODELS: dict[Endpoint, type[_Lenient]] = {
    Endpoint.completions: CompletionBody,
    Endpoint.chat: ChatBody,
    Endpoint.generate: GenerateBody,
}


@dataclass(frozen=True)
class ClientRequest:
    endpoint: Endpoint
    body: dict[str, Any]
    stream: bool
    model: str | None
    # The bytes `body` was decoded from (spliced into the legs, `leg_bytes.py`).
    raw: bytes = b""


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise RouterError(400, "request body is empty; send a JSON object", reason="bad_json")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RouterError(
            400, f"request body is not valid JSON: {err}", reason="bad_json"
        ) from None
    if not isinstance(data, dict):
        raise RouterError(
            400, f"request body must be a JSON object, got {type(data).__name__}", reason="bad_json"
        )
    return data


# Fields whose type is a union: pydantic reports one error per member, so
# the client gets one plain sentence instead.
_UNION_HINTS = {
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "a string or a list of strings",
    "text": "a string or a list of strings",
    "input_ids": "a list of token ids or a list of token-id lists",
    "temperature": "a number >= 0",
    "top_p": "a number in (0, 1]",
}


def _is_union_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict["))


def _validation_error(err: ValidationError) -> RouterError:
    errors = err.errors()
    first = errors[0]
    loc = [str(p) for p in first["loc"]]
    field = loc[0] if loc else None
    hint = _UNION_HINTS.get(field or "")
    if hint is not None and first["type"] != "missing" and len(loc) <= 3:
        message = f"`{field}` must be {hint}"
    else:
        where = ".".join(p for p in loc if not _is_union_tag(p))
        message = f"`{where}`: {first['msg']}" if where else str(first["msg"])
        others = len({tuple(e["loc"][:1]) for e in errors}) - 1
        if others > 0:
            message += f" (and {others} more field{'s' if others > 1 else ''})"
    return RouterError(400, message, param=field, reason="invalid_body")


def check_request(
    endpoint: Endpoint, data: dict[str, Any], *, disaggregated: bool, raw: bytes = b""
) -> ClientRequest:
    """Validate a decoded body for ``endpoint``; raise RouterError(400) naming the field."""
    for name in ROUTER_OWNED_FIELDS:
        if name in data:
            raise RouterError(
                400,
                f"`{name}` is set by the router; remove it from the request",
                param=name,
                reason="router_owned_field",
            )
    try:
        parsed = _MODELS[endpoint].model_validate(data)
    except ValidationError as err:
        raise _validation_error(err) from None
    if isinstance(parsed, GenerateBody):
        if (parsed.text is None) == (parsed.input_ids is None):
            raise RouterError(
                400,
                "give exactly one of `text` or `input_ids`",
                param="text",
                reason="invalid_body",
            )
        batched = isinstance(parsed.text, list) or (
            isinstance(parsed.input_ids, list)
            and bool(parsed.input_ids)
            and isinstance(parsed.input_ids[0], list)
        )
        model = None
    elif isinstance(parsed, CompletionBody):
        prompt = parsed.prompt
        batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        if isinstance(prompt, list) and not prompt:
            raise RouterError(
                400, "`prompt` must not be empty", param="prompt", reason="invalid_body"
            )
        model = parsed.model
    else:
        assert isinstance(parsed, ChatBody)
        batched = False
        model = parsed.model
    if disaggregated:
        if batched:
            raise RouterError(
                400,
                "batched prompts are not supported by a prefill/decode cluster; "
                "send one request per prompt",
                param="prompt" if endpoint is Endpoint.completions else "text",
                reason="batch_unsupported",
            )
        n = getattr(parsed, "n", 1)
        if n != 1:
            raise RouterError(
                400,
                f"n={n} is not supported by a prefill/decode cluster; send n requests",
                param="n",
                reason="n_unsupported",
            )
    return ClientRequest(endpoint=endpoint, body=data, stream=parsed.stream, model=model, raw=raw)


@dataclass(frozen=True)
class Bootstrap:
    host: str
    port: int
    room: int


def build_leg_body(
    body: Mapping[str, Any], rid: str | None, bootstrap: Bootstrap | None
) -> dict[str, Any]:
    """The body both legs receive: the client's fields plus the router-owned ones
    (no `rid` field when `rid` is None: vLLM names a request by its X-Request-Id)."""
    leg = {k: v for k, v in body.items() if k not in ROUTER_STRIPPED_FIELDS}
    if rid is not None:
        leg["rid"] = rid
    if bootstrap is not None:
        leg["bootstrap_host"] = bootstrap.host
        leg["bootstrap_port"] = bootstrap.port
        leg["bootstrap_room"] = bootstrap.room
    return leg


def payload_error(payload: Any) -> str | None:
    """The failure a worker reported inside a 2xx payload, if any."""
    if not isinstance(payload, Mapping):
        return None
    err = payload.get("error")
    if err is not None:
        if isinstance(err, Mapping):
            return str(err.get("message") or err)
        return str(err)
    meta = payload.get("meta_info")
    if isinstance(meta, Mapping):
        finish = meta.get("finish_reason")
        if isinstance(finish, Mapping) and finish.get("type") == "abort":
            return str(finish.get("message") or "request aborted by worker")
    choices = payload.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, Mapping) and choice.get("finish_reason") == "abort":
                return "request aborted by worker"
    return None


def error_message_of(raw: bytes, status: int) -> str:
    """A worker's error body reduced to its message (whatever shape it used)."""
    try:
        payload = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        text = raw.decode("utf-8", "replace").strip()
        return text[:500] or f"HTTP {status}"
    if isinstance(payload, Mapping):
        found = payload_error(payload)
        if found is not None:
            return found
        detail = payload.get("detail") or payload.get("message")
        if detail:
            return str(detail)[:500]
    return f"HTTP {status}"
