"""Tokenizers, chat templates and streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.engine.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    load_tokenizer,
)

BYTES = ByteTokenizer()


def test_byte_tokenizer_round_trips_any_text_with_bos() -> None:
    text = "héllo wörld — 你好 🙂"
    ids = BYTES.encode(text)
    assert ids[0] == BYTES.bos_token_id and all(0 <= i < 256 for i in ids[1:])
    assert BYTES.decode(ids) == text
    assert BYTES.encode(text, add_special_tokens=False) == ids[1:]
    assert BYTES.decode([72, BYTES.eos_token_id, 105], skip_special_tokens=False) == "H<|257|>i"


def test_chat_template_renders_roles_and_an_assistant_turn() -> None:
    text = BYTES.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>system\nbe brief<|im_end|>" in text
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        BYTES.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="empty"):
        BYTES.apply_chat_template([])


def test_hf_tokenizer_round_trips_and_uses_the_directory_template(
    llama_dir: Path, tmp_path: Path
) -> None:
    tok = load_tokenizer(llama_dir)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("Hello world! こんにちは")
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.decode(ids) == "Hello world! こんにちは"
    assert tok.encode("Hello world! こんにちは", add_special_tokens=False) == ids[1:]
    # A chat template in tokenizer_config.json wins over the default.
    cfg = json.loads((llama_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_text((llama_dir / "tokenizer.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    rendered = load_tokenizer(other).apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "[user]hi</s>[assistant]"


def test_a_directory_without_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def _stream(ids: list[int], stop: tuple[str, ...] = (), step: int = 1) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(BYTES, stop)
    parts = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    parts.append(detok.flush())
    return parts, detok.text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40), step=st.integers(1, 5))
def test_streamed_text_is_never_broken_and_adds_up(text: str, step: int) -> None:
    parts, total = _stream(BYTES.encode(text, add_special_tokens=False), step=step)
    assert "".join(parts) == total == text
    assert all("\ufffd" not in p for p in parts)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc é", max_size=30),
    stops=st.lists(st.text(alphabet="abcé", min_size=1, max_size=3), min_size=1, max_size=3),
    step=st.integers(1, 4),
)
def test_stop_strings_cut_the_text_before_the_first_completed_match(
    text: str, stops: list[str], step: int
) -> None:
    parts, total = _stream(BYTES.encode(text, add_special_tokens=False), tuple(stops), step)
    # (end, start) of each stop's first occurrence: the first to complete wins,
    # however the tokens were grouped into pushes.
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[: min(hits)[1]] if hits else text
    assert "".join(parts) == total == expected


def test_stop_reason_names_the_matched_string_and_later_tokens_are_ignored() -> None:
    detok = IncrementalDetokenizer(BYTES, ("END", "###"))
    out = detok.push(BYTES.encode("some text E", add_special_tokens=False))
    assert out == "some text " and not detok.stopped  # "E" may start "END": held back
    out += detok.push(BYTES.encode("ND and more", add_special_tokens=False))
    assert detok.stopped and detok.stop_reason == "END"
    assert out == "some text "
    assert detok.push([65]) == "" and detok.flush() == ""
    with pytest.raises(ValueError, match="empty"):
        IncrementalDetokenizer(BYTES, ("",))


def test_hf_streaming_matches_a_full_decode(llama_dir: Path) -> None:
    tok = load_tokenizer(llama_dir)
    text = "Pages of the KV cache move. こんにちは世界 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    parts = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(parts) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in parts)


def test_fingerprints_tell_tokenizers_and_chat_templates_apart(
    llama_dir: Path, tmp_path: Path
) -> None:
    hf = load_tokenizer(llama_dir)
    assert hf.fingerprint == load_tokenizer(llama_dir).fingerprint
    assert hf.fingerprint != BYTES.fingerprint
    assert BYTES.fingerprint == ByteTokenizer().fingerprint
    # One vocabulary entry moved: another tokenizer.
    data = json.loads((llama_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(k for k, v in vocab.items() if v in (10, 11))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "tokenizer.json").write_text(json.dumps(data))
    (moved / "tokenizer_config.json").write_text((llama_dir / "tokenizer_config.json").read_text())
    assert load_tokenizer(moved).fingerprint != hf.fingerprint
    assert load_tokenizer(moved).chat_template_fingerprint == hf.chat_template_fingerprint
    # Same tokenizer, another chat template: only the template fingerprint moves.
    cfg = json.loads((llama_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    templated = tmp_path / "templated"
    templated.mkdir()
    (templated / "tokenizer.json").write_text((llama_dir / "tokenizer.json").read_text())
    (templated / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(templated).fingerprint == hf.fingerprint
    assert load_tokenizer(templated).chat_template_fingerprint != hf.chat_template_fingerprint
