"""Tokenizers (byte-level for `tiny`, `tokenizers` wrapper for HF dirs) and
incremental detokenization for streaming.

Each tokenizer has a `fingerprint` (its vocabulary, merges and special ids)
and a `chat_template_fingerprint`: the prefill and decode legs tokenize on
their own, so both go into the model fingerprint the PD handshake compares.

`IncrementalDetokenizer` never emits a broken UTF-8 sequence: text whose
last character is still incomplete (decodes to U+FFFD) is held back until
the next token completes it. With stop strings it also holds back any tail
that could still grow into a stop string, so a stream never shows text the
final answer will not contain.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pdcluster.runtime.engine.config import TINY_BOS_ID, TINY_EOS_ID, TINY_VOCAB_SIZE

_REPLACEMENT = "\ufffd"
# The chat format used when a model ships no template of its own.
_BUILTIN_CHATML = "builtin:chatml-v1"


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


class Tokenizer(Protocol):
    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def chat_template_fingerprint(self) -> str: ...


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if not messages:
        raise ValueError("messages must not be empty")
    for i, msg in enumerate(messages):
        role, content = msg.get("role"), msg.get("content")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{i}].role must be system, user or assistant, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        out.append((role, content))
    return out


def _chatml(messages: Sequence[Mapping[str, Any]]) -> str:
    parts = [
        f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in _check_messages(messages)
    ]
    return "".join(parts) + "<|im_start|>assistant\n"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS and EOS; the rest of the vocab is padding."""

    bos_token_id: int = TINY_BOS_ID
    eos_token_id: int = TINY_EOS_ID
    vocab_size: int = TINY_VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytearray()
        for i in ids:
            if 0 <= i < 256:
                data.append(i)
            elif not skip_special_tokens:
                data.extend(f"<|{i}|>".encode())
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return _chatml(messages)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The built-in ChatML prompt, encoded as a plain prompt (BOS first)."""
        return self.encode(self.apply_chat_template(messages))

    @property
    def fingerprint(self) -> str:
        return _digest("byte-utf8", str(self.bos_token_id), str(self.eos_token_id))

    @property
    def chat_template_fingerprint(self) -> str:
        return _digest(_BUILTIN_CHATML)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (plus tokenizer_config.json when present)."""

    def __init__(self, directory: str | Path, eos_token_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _HFTok

        root = Path(directory)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist (a model directory needs tokenizer.json)"
            )
        self._tok = _HFTok.from_file(str(path))
        self._file_digest = hashlib.sha256(path.read_bytes()).hexdigest()
        cfg: dict[str, Any] = {}
        cfg_path = root / "tokenizer_config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
        self._chat_template = cfg.get("chat_template")
        self._compiled: Any = None
        self._bos = self._special_id(cfg.get("bos_token"))
        self._eos = self._special_id(cfg.get("eos_token"))
        if self._eos is None:
            self._eos = eos_token_id

    def _special_id(self, token: Any) -> int | None:
        if isinstance(token, Mapping):
            token = token.get("content")
        if not isinstance(token, str):
            return None
        found: int | None = self._tok.token_to_id(token)
        return found

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def fingerprint(self) -> str:
        return _digest("hf", self._file_digest, str(self._bos), str(self._eos))

    @property
    def chat_template_fingerprint(self) -> str:
        template = self._chat_template
        return _digest(template if isinstance(template, str) else _BUILTIN_CHATML)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def vocab_size(self) -> int:
        size: int = self._tok.get_vocab_size(with_added_tokens=True)
        return size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str:
        checked = _check_messages(messages)
        if not isinstance(self._chat_template, str):
            return _chatml(messages)
        if self._compiled is None:  # compiled once: a request only renders it
            self._compiled = _jinja_env().from_string(self._chat_template)
        template = self._compiled
        bos = self.decode([self._bos], skip_special_tokens=False) if self._bos is not None else ""
        eos = self.decode([self._eos], skip_special_tokens=False) if self._eos is not None else ""
        import jinja2.exceptions

        try:
            rendered: str = template.render(
                messages=[{"role": r, "content": c} for r, c in checked],
                add_generation_prompt=True,
                bos_token=bos,
                eos_token=eos,
            )
        except jinja2.exceptions.TemplateError as err:
            raise ValueError(f"the chat template refused these messages: {err}") from None
        return rendered

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of a chat prompt, as transformers' `apply_chat_template(...,
        tokenize=True)` gives them: the model's template writes every special token
        it wants (a Llama-3 template opens with BOS), so its text is encoded
        without adding any; a second BOS would change every logit after it. The
        built-in ChatML of a directory without a template is encoded as a plain
        prompt."""
        text = self.apply_chat_template(messages)
        return self.encode(text, add_special_tokens=not isinstance(self._chat_template, str))


def _raise_exception(message: str) -> None:
    import jinja2.exceptions

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.cache
def _jinja_env() -> Any:
    """The (sandboxed) environment chat templates are written for: blocks
    trimmed, loop controls, and the two helpers templates call
    (`raise_exception`, `strftime_now`)."""
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def load_tokenizer(model: str | Path, eos_token_id: int | None = None) -> Tokenizer:
    """`"tiny"` → ByteTokenizer; otherwise a model directory holding tokenizer.json."""
    if str(model) == "tiny":
        return ByteTokenizer()
    return HFTokenizer(model, eos_token_id=eos_token_id)


class IncrementalDetokenizer:
    """Turns a token stream into text deltas that are always valid and final.

    `push(ids)` returns the text that became stable; `flush()` returns what
    was held back once the sequence ended. Once a stop string appears,
    `stopped` turns true and the text is cut just before it (nothing after a
    stop string is ever returned).
    """

    # Tokens re-decoded as left context: enough for any tokenizer that merges
    # a few neighbours when decoding (byte fallback, leading-space rules).
    _CONTEXT = 6

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix_start = 0  # first id of the context window
        self._read_start = 0  # first id whose text is not yet in _text
        self._text = ""  # decoded, complete text so far
        self._emitted = 0  # chars of _text already returned
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All text returned so far."""
        return self._text[: self._emitted]

    def push(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(ids)
        prefix = self._tok.decode(self._ids[self._prefix_start : self._read_start], self._skip)
        full = self._tok.decode(self._ids[self._prefix_start :], self._skip)
        if full.endswith(_REPLACEMENT) or not full.startswith(prefix):
            # An incomplete character: wait for the bytes that finish it.
            return self._release(final=False)
        self._text += full[len(prefix) :]
        self._prefix_start = max(self._read_start, len(self._ids) - self._CONTEXT)
        self._read_start = len(self._ids)
        return self._release(final=False)

    def flush(self) -> str:
        """Everything still held back (call once the sequence ended)."""
        if self.stopped:
            return ""
        if self._read_start < len(self._ids):
            prefix = self._tok.decode(self._ids[self._prefix_start : self._read_start], self._skip)
            full = self._tok.decode(self._ids[self._prefix_start :], self._skip)
            self._text += full[len(prefix) :] if full.startswith(prefix) else full
            self._read_start = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._text
        search_from = max(0, self._emitted - max((len(s) for s in self._stop), default=0))
        # The stop that completes first wins (ties: the one starting first):
        # generation halts there, so a longer stop that would have started
        # earlier never gets the chance to complete.
        cut, cut_end = -1, -1
        for s in self._stop:
            at = text.find(s, search_from)
            if at == -1:
                continue
            end = at + len(s)
            if cut == -1 or (end, at) < (cut_end, cut):
                cut, cut_end, self.stop_reason = at, end, s
        if cut != -1:
            self.stopped = True
            out = text[self._emitted : cut]
            self._emitted = cut
            self._text = text[:cut]
            return out
        end = len(text)
        if not final:
            end -= self._held_tail(text)
        out = text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return out

    def _held_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that starts some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-n:]):
                    best = n
                    break
        return best
