"""Response shapes of the worker API: SGLang `/generate` and OpenAI objects.

Pure functions from request facts to JSON-able dicts, so the HTTP layer only
serializes. OpenAI shapes follow the public API reference (ids, `object`
names, `usage`, `finish_reason`, SSE chunks ending in `data: [DONE]`).
"""

from __future__ import annotations

import json
import time
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
    rid: str, text: str, output_ids: list[int], prompt_tokens: int, finish_reason: str | None
) -> dict[str, Any]:
    finish = None if finish_reason is None else {"type": finish_reason}
    return {
        "text": text,
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(output_ids),
            "finish_reason": finish,
        },
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _choice_object(
    object_: str, id_: str, model: str, choice: dict[str, Any], finish_reason: str | None
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
                "logprobs": None,
                "finish_reason": openai_finish_reason(finish_reason),
            }
        ],
    }


def completion_body(
    rid: str, model: str, text: str, finish_reason: str | None, usage: dict[str, int]
) -> dict[str, Any]:
    """A whole (non-streamed) completion: the final chunk's shape plus `usage` (`usage()`)."""
    return {**completion_chunk(rid, model, text, finish_reason), "usage": usage}


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    return _choice_object("text_completion", f"cmpl-{rid}", model, {"text": text}, finish_reason)


def chat_body(
    rid: str, model: str, text: str, finish_reason: str | None, usage: dict[str, int]
) -> dict[str, Any]:
    """A whole (non-streamed) chat completion, with `usage` (`usage()`)."""
    message = {"message": {"role": "assistant", "content": text}}
    body = _choice_object("chat.completion", f"chatcmpl-{rid}", model, message, finish_reason)
    return {**body, "usage": usage}


def chat_chunk(
    rid: str, model: str, delta: dict[str, str], finish_reason: str | None
) -> dict[str, Any]:
    return _choice_object(
        "chat.completion.chunk", f"chatcmpl-{rid}", model, {"delta": delta}, finish_reason
    )
