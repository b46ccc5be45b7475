"""Request bodies of the worker HTTP API (SGLang-compatible) and the OpenAI subset.

Validation happens here, at the edge: a body that does not fit these models
is answered 422 with the field named, before anything reaches the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pdcluster.runtime.serving.request import BootstrapFields, Lenient

MAX_RID_LEN = 128
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


class GenerateSamplingParams(Lenient):
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    max_new_tokens: int | None = Field(default=None, ge=1)  # None: min(128, server limit)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=0, le=(1 << 63) - 1)


class GenerateRequest(BootstrapFields):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = GenerateSamplingParams()
    stream: bool = False
    rid: str | None = Field(default=None, min_length=1, max_length=MAX_RID_LEN)
    # Set by a worker relaying to another dp group of its instance: `rid` is
    # one it minted itself, not the caller's, so it binds no room.
    rid_is_local: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self


class AbortRequest(Lenient):
    rid: str = Field(default="", max_length=MAX_RID_LEN)
    abort_all: bool = False

    @model_validator(mode="after")
    def _target(self) -> AbortRequest:
        if not self.rid and not self.abort_all:
            raise ValueError("give a `rid` or set `abort_all`")
        return self


class _OpenAISampling(Lenient):
    """The fields the completion and chat bodies share, after their own.

    A body lists this first among its bases and keeps its own fields in a
    second base: pydantic orders fields from the last base to the first, so
    these come last, as the order validation errors are reported in says."""

    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    rid: str | None = Field(default=None, min_length=1, max_length=MAX_RID_LEN)
    ignore_eos: bool = False


class _CompletionPrompt(BootstrapFields):
    model: str | None = Field(default=None, max_length=256)  # null: the served model
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)


class CompletionRequest(_OpenAISampling, _CompletionPrompt):
    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("batched string prompts are not supported; send one prompt")
        return self


class ChatMessage(Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class _ChatMessages(BootstrapFields):
    model: str | None = Field(default=None, max_length=256)  # null: the served model
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class ChatCompletionRequest(_OpenAISampling, _ChatMessages):
    pass


def normalize_stop(stop: str | list[str] | None) -> list[str]:
    """Stop strings as a list, bounded in count and length (clear error otherwise)."""
    items = [stop] if isinstance(stop, str) else list(stop or [])
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    for s in items:
        if not s or len(s) > MAX_STOP_LEN:
            raise ValueError(f"stop strings must be 1..{MAX_STOP_LEN} characters")
    return items
