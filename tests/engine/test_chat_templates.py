"""Chat prompts tokenize as transformers' `apply_chat_template` tokenizes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdcluster.runtime.engine.tokenizer import load_tokenizer
from tests.engine.testing import CHAT_STYLES, write_chat_tokenizer

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello world!"}],
    [
        {"role": "system", "content": "The quick brown fox."},
        {"role": "user", "content": "  Prefill computes the prompt;  "},
    ],
    [
        {"role": "user", "content": "Pages of the KV cache"},
        {"role": "assistant", "content": "move from prefill to decode."},
        {"role": "user", "content": "Bonjour le monde. こんにちは世界"},
    ],
]


def _transformers_ids(directory: Path, messages: list[dict[str, str]]) -> list[int]:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(directory))
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if not isinstance(out, list) else out
    return [int(i) for i in ids]


@pytest.mark.parametrize("style", sorted(CHAT_STYLES))
def test_chat_ids_equal_transformers_and_bos_appears_once(style: str, tmp_path: Path) -> None:
    directory = write_chat_tokenizer(tmp_path / style, style)
    ours = load_tokenizer(directory)
    bos = ours.bos_token_id
    for messages in CONVERSATIONS:
        want = _transformers_ids(directory, messages)
        got = ours.encode_chat(messages)
        assert got == want, (style, messages)
        if style == "llama3":
            # The template writes BOS; the tokenizer's own BOS rule must not add a second.
            assert bos is not None and got[0] == bos and got.count(bos) == 1
            assert ours.encode("x")[0] == bos  # ...while a plain prompt still gets one
        else:
            assert bos is None


def test_without_a_template_the_builtin_chatml_is_a_plain_prompt(tmp_path: Path) -> None:
    directory = write_chat_tokenizer(tmp_path / "plain", "llama3")
    config = directory / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    tok = load_tokenizer(directory)
    messages = CONVERSATIONS[0]
    assert tok.encode_chat(messages) == tok.encode(tok.apply_chat_template(messages))
