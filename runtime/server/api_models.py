"""Request bodies of the worker HTTP API (SGLang-compatible) and the OpenAI subset.

Validation happens here, at the edge: a body that does not fit these models
is answered 422 with the field named, before anything reaches the engine.

Fields we do not implement are never ignored when they ask for something:
each body lists them (`UNSUPPORTED`, typed `Any` so any value is read) with
the test that says a value asks for the feature; `refuse_unsupported` turns
the first such field into a 400 naming it. Their neutral values (`n: 1`,
`echo: false`, `tools: []`, `response_format: {"type": "text"}`…), which
clients and other routers send by default, pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from pdcluster.runtime.engine.sampling import MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY
from pdcluster.runtime.serving.request import BadRequest, BootstrapFields, Lenient

MAX_RID_LEN = 128
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


@dataclass(frozen=True)
class Unsupported:
    """A field we do not implement: `asks(value)` is True when ignoring it would
    change what the client gets."""

    field: str
    asks: Callable[[Any], bool]
    what: str  # the feature, for the message


def _set(value: Any) -> bool:
    return value is not None


def _truthy(value: Any) -> bool:
    return bool(value)


def _not_one(value: Any) -> bool:
    return value is not None and value != 1


def _not_text_format(value: Any) -> bool:
    return value is not None and not (isinstance(value, dict) and value.get("type") == "text")


def _not_none_choice(value: Any) -> bool:
    return value not in (None, "none", "auto")


def _false(value: Any) -> bool:
    return value is False


def refuse_unsupported(body: BaseModel, prefix: str = "") -> None:
    """400 naming the first field of `body` (see `UNSUPPORTED`) that asks for a
    feature this server does not have."""
    for item in getattr(body, "UNSUPPORTED", ()):
        if item.asks(getattr(body, item.field, None)):
            raise BadRequest(f"`{prefix}{item.field}` is not supported: {item.what}")


class GenerateSamplingParams(Lenient):
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    max_new_tokens: int | None = Field(default=None, ge=1)  # None: min(128, server limit)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    # Read only to be refused when they ask for something (`UNSUPPORTED`).
    n: Any = None
    min_new_tokens: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    logit_bias: Any = None
    custom_params: Any = None
    no_stop_trim: Any = None
    skip_special_tokens: Any = None

    UNSUPPORTED: ClassVar[tuple[Unsupported, ...]] = (
        Unsupported("n", _not_one, "one completion per request; send n requests"),
        Unsupported("min_new_tokens", _truthy, "a minimum output length"),
        Unsupported("regex", _set, "constrained decoding"),
        Unsupported("json_schema", _set, "constrained decoding"),
        Unsupported("ebnf", _set, "constrained decoding"),
        Unsupported("structural_tag", _set, "constrained decoding"),
        Unsupported("logit_bias", _truthy, "logit bias"),
        Unsupported("custom_params", _truthy, "custom logit processors"),
        Unsupported("no_stop_trim", _truthy, "output keeps no stop string"),
        Unsupported("skip_special_tokens", _false, "special tokens are always skipped"),
    )


class GenerateRequest(BootstrapFields):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = GenerateSamplingParams()
    stream: bool = False
    rid: str | None = Field(default=None, min_length=1, max_length=MAX_RID_LEN)
    # Set by a worker relaying to another dp group of its instance: `rid` is
    # one it minted itself, not the caller's, so it binds no room.
    rid_is_local: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: bool = False
    logprob_start_len: Any = None
    return_hidden_states: Any = None
    input_embeds: Any = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    lora_path: Any = None
    session_params: Any = None

    UNSUPPORTED: ClassVar[tuple[Unsupported, ...]] = (
        Unsupported(
            "logprob_start_len",
            lambda v: v is not None and v != -1,
            "prompt logprobs (only output tokens have them)",
        ),
        Unsupported("return_hidden_states", _truthy, "hidden states"),
        Unsupported("input_embeds", _set, "prompts as embeddings"),
        Unsupported("image_data", _truthy, "images"),
        Unsupported("audio_data", _truthy, "audio"),
        Unsupported("video_data", _truthy, "video"),
        Unsupported("lora_path", _truthy, "LoRA adapters"),
        Unsupported("session_params", _truthy, "sessions"),
    )

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


class StreamOptions(Lenient):
    include_usage: bool = False


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
    stream_options: StreamOptions | None = None
    rid: str | None = Field(default=None, min_length=1, max_length=MAX_RID_LEN)
    ignore_eos: bool = False
    presence_penalty: float | None = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    # Read only to be refused when they ask for something (`UNSUPPORTED`).
    n: Any = None
    logit_bias: Any = None
    min_tokens: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    echo: Any = None

    UNSUPPORTED: ClassVar[tuple[Unsupported, ...]] = (
        Unsupported("n", _not_one, "one completion per request; send n requests"),
        Unsupported("logit_bias", _truthy, "logit bias"),
        Unsupported("min_tokens", _truthy, "a minimum output length"),
        Unsupported("response_format", _not_text_format, "structured output (JSON mode)"),
        Unsupported("guided_json", _set, "constrained decoding"),
        Unsupported("guided_regex", _set, "constrained decoding"),
        Unsupported("guided_choice", _set, "constrained decoding"),
        Unsupported("guided_grammar", _set, "constrained decoding"),
        Unsupported("structured_outputs", _set, "constrained decoding"),
        Unsupported("echo", _truthy, "echoing the prompt"),
    )


class _CompletionPrompt(BootstrapFields):
    model: str | None = Field(default=None, max_length=256)  # null: the served model
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: Any = None
    suffix: Any = None


class CompletionRequest(_OpenAISampling, _CompletionPrompt):
    UNSUPPORTED: ClassVar[tuple[Unsupported, ...]] = (
        *_OpenAISampling.UNSUPPORTED,
        Unsupported("best_of", _not_one, "best-of sampling; send several requests"),
        Unsupported("suffix", _truthy, "insertion (a suffix after the completion)"),
    )

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
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None


class ChatCompletionRequest(_OpenAISampling, _ChatMessages):
    UNSUPPORTED: ClassVar[tuple[Unsupported, ...]] = (
        *_OpenAISampling.UNSUPPORTED,
        Unsupported("tools", _truthy, "tool calling"),
        Unsupported("tool_choice", _not_none_choice, "tool calling"),
        Unsupported("functions", _truthy, "function calling"),
        Unsupported("function_call", _not_none_choice, "function calling"),
        Unsupported("modalities", lambda v: v is not None and v != ["text"], "text output only"),
        Unsupported("audio", _set, "audio output"),
        Unsupported("prediction", _set, "predicted outputs"),
        Unsupported("reasoning_effort", _set, "reasoning settings"),
        Unsupported("web_search_options", _set, "web search"),
        Unsupported("add_generation_prompt", _false, "the template always opens a reply"),
        Unsupported("continue_final_message", _truthy, "continuing the last message"),
        Unsupported("chat_template", _set, "the model's own chat template only"),
        Unsupported("chat_template_kwargs", _truthy, "chat template arguments"),
        Unsupported("documents", _truthy, "documents in the chat template"),
    )

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs: true`")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per position for the engine (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


def normalize_stop(stop: str | list[str] | None) -> list[str]:
    """Stop strings as a list, bounded in count and length (clear error otherwise)."""
    items = [stop] if isinstance(stop, str) else list(stop or [])
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    for s in items:
        if not s or len(s) > MAX_STOP_LEN:
            raise ValueError(f"stop strings must be 1..{MAX_STOP_LEN} characters")
    return items
