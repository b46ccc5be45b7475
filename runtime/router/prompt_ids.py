"""The token ids a worker will compute for a client request, as far as the
router can tell: what `cache_aware` hashes into page keys.

Mirrors the worker's reading of each endpoint (`server/worker_app.py`):
``/generate`` ``input_ids`` or ``text``; ``/v1/completions`` a token list or
one string; ``/v1/chat/completions`` the messages through the chat template.
Text needs the router's tokenizer (the model's own, loaded at the edge);
without one, or for any body the worker would read differently (batched
prompts, unknown roles), the answer is None and the request goes by load. A
wrong guess only costs a cache miss: the worker decides what it computes.

Pure module: the tokenizer is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pdcluster.runtime.router.bodies import ClientRequest, Endpoint
from pdcluster.runtime.router.prefix_index import PromptTokens

__all__ = ["RouterTokenizer", "prompt_tokens"]


class RouterTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...

    @property
    def fingerprint(self) -> str: ...


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def _text(content: object) -> str | None:
    # The worker's ChatMessage.text(): string content, or the text parts joined.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping):
                return None
            if part.get("type") == "text":
                parts.append(str(part.get("text", "")))
        return "".join(parts)
    return None


def prompt_tokens(request: ClientRequest, tokenizer: RouterTokenizer | None) -> PromptTokens | None:
    """The prompt's token ids, or None when the router cannot know them."""
    body = request.body
    text: str | None = None
    if request.endpoint is Endpoint.generate:
        ids, raw = body.get("input_ids"), body.get("text")
        if ids is not None:
            return PromptTokens(tuple(ids)) if _is_ids(ids) and ids else None
        text = raw if isinstance(raw, str) else None
    elif request.endpoint is Endpoint.completions:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            text = prompt
        elif _is_ids(prompt) and prompt:
            return PromptTokens(tuple(prompt))
    elif request.endpoint is Endpoint.chat and tokenizer is not None:
        messages = []
        for message in body.get("messages") or ():
            content = _text(message.get("content")) if isinstance(message, Mapping) else None
            if content is None:
                return None
            messages.append({"role": message.get("role"), "content": content})
        try:
            chat_ids = tokenizer.encode_chat(messages)
        except (ValueError, TypeError, KeyError):
            return None  # the worker will refuse it too
        return PromptTokens(tuple(chat_ids), tokenizer.fingerprint) if chat_ids else None
    if text is None or tokenizer is None:
        return None
    try:
        ids = tokenizer.encode(text)
    except (ValueError, TypeError):
        return None
    return PromptTokens(tuple(ids), tokenizer.fingerprint) if ids else None
