"""Response shapes of the worker API: SGLang `/generate` and OpenAI objects.

Pure functions from request facts to JSON-able dicts, so the HTTP layer only
serializes. OpenAI shapes follow the public API reference (ids, `object`
names, `usage`, `finish_reason`, SSE chunks ending in `data: [DONE]`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

DONE = "data: [DONE]\n\n"
# An SSE comment (clients ignore it, SSE spec) a stream ends with, before
# [DONE]: what a PD router counts per request without parsing every event.
USAGE_COMMENT = ": usage "


def usage_comment(prompt_tokens: int, completion_tokens: int, finish_reason: str | None) -> str:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "finish_reason": finish_reason,
    }
    return f"{USAGE_COMMENT}{json.dumps(usage, separators=(',', ':'))}\n\n"


# token id -> its text (special tokens spelled out), for logprobs.
TokenText = Callable[[int], str]


@dataclass
class Output:
    """What one request produced, gathered from its events."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # One per token when the request asked for logprobs (engine TokenLogprobs,
    # None where unknown).
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, text: str, token_ids: Sequence[int], logprobs: Sequence[Any]) -> None:
        self.text += text
        self.token_ids.extend(token_ids)
        self.logprobs.extend(aligned(token_ids, logprobs))


def aligned(token_ids: Sequence[int], logprobs: Sequence[Any]) -> list[Any]:
    """One logprobs entry per token: None for tokens an event carried none for (a PD
    prefill leg's answer, an error's)."""
    return [*logprobs, *[None] * (len(token_ids) - len(logprobs))]


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_body(
    message: str, *, type_: str = "invalid_request_error", code: int = 400
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


def openai_finish_reason(reason: str | None) -> str | None:
    """Map engine finish reasons to OpenAI's vocabulary."""
    if reason is None:
        return None
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason, reason)


def generate_body(
    rid: str,
    text: str,
    output_ids: list[int],
    prompt_tokens: int,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """SGLang's `/generate` answer; `logprobs`: `generate_logprobs()` when asked for."""
    finish = None if finish_reason is None else {"type": finish_reason}
    return {
        "text": text,
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(output_ids),
            "finish_reason": finish,
            **(logprobs or {}),
        },
    }


def generate_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[Any],
    num_top: int,
    token_text: TokenText | None,
) -> dict[str, Any]:
    """SGLang's meta_info logprob fields: (logprob, token id, text or None) per
    output token, and the `num_top` most likely alternatives at each."""

    def entry(token: int, value: float | None) -> list[Any]:
        return [value, token, token_text(token) if token_text is not None else None]

    chosen, tops = [], []
    for token, lp in zip(token_ids, aligned(token_ids, logprobs), strict=True):
        chosen.append(entry(token, None if lp is None else lp.logprob))
        tops.append([] if lp is None else [entry(t, v) for t, v in lp.top[:num_top]])
    out: dict[str, Any] = {"output_token_logprobs": chosen}
    if num_top:
        out["output_top_logprobs"] = tops
    return out


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Any], token_text: TokenText, offset: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy completion `logprobs` object; `offset`: text before these tokens."""
    tokens, values, tops, offsets = [], [], [], []
    for token, lp in zip(token_ids, aligned(token_ids, logprobs), strict=True):
        piece = token_text(token)
        tokens.append(piece)
        values.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {token_text(t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Any], token_text: TokenText
) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object: one entry per output token, with its bytes."""

    def entry(token: int, value: float | None) -> dict[str, Any]:
        piece = token_text(token)
        return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}

    content = []
    for token, lp in zip(token_ids, aligned(token_ids, logprobs), strict=True):
        item = entry(token, None if lp is None else lp.logprob)
        item["top_logprobs"] = [] if lp is None else [entry(t, v) for t, v in lp.top]
        content.append(item)
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _choice_object(
    object_: str,
    id_: str,
    model: str,
    choice: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One OpenAI object with a single choice; `choice` is what sets it apart
    (its text, message or delta)."""
    return {
        "id": id_,
        "object": object_,
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                **choice,
                "logprobs": logprobs,
                "finish_reason": openai_finish_reason(finish_reason),
            }
        ],
    }


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: dict[str, int],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) completion: the final chunk's shape plus `usage` (`usage()`)."""
    return {**completion_chunk(rid, model, text, finish_reason, logprobs), "usage": usage}


def completion_chunk(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return _choice_object(
        "text_completion", f"cmpl-{rid}", model, {"text": text}, finish_reason, logprobs
    )


def chat_body(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: dict[str, int],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) chat completion, with `usage` (`usage()`)."""
    message = {"message": {"role": "assistant", "content": text}}
    body = _choice_object(
        "chat.completion", f"chatcmpl-{rid}", model, message, finish_reason, logprobs
    )
    return {**body, "usage": usage}


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return _choice_object(
        "chat.completion.chunk", f"chatcmpl-{rid}", model, {"delta": delta}, finish_reason, logprobs
    )


def usage_chunk(object_: str, id_: str, model: str, usage: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream asked for `stream_options.include_usage`: no choices."""
    return {
        "id": id_,
        "object": object_,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage,
    }
