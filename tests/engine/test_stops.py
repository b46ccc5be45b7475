"""How requests end: max_tokens, EOS, ignore_eos, stop token ids, stop strings."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.runtime.engine.config import TINY_EOS_ID
from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer
from tests.engine.testing import generate

TOK = ByteTokenizer()
CONFIG = EngineConfig(num_pages=256, page_size=8, max_running_requests=32)
PROMPT = TOK.encode("Hello")


def _run(engine: LLMEngine, **params: Any) -> tuple[list[int], str | None]:
    req = EngineRequest("r", PROMPT, SamplingParams(**params))
    return generate(engine, [req])["r"]


@pytest.fixture(scope="module")
def eos_case() -> tuple[int, int]:
    """A seed whose sampled continuation of PROMPT emits EOS, and where."""
    engine = LLMEngine(CONFIG)
    reqs = [
        EngineRequest(
            f"{seed}",
            PROMPT,
            SamplingParams(max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True),
        )
        for seed in range(30)
    ]
    for rid, (tokens, _) in generate(engine, reqs).items():
        if TINY_EOS_ID in tokens:
            return int(rid), tokens.index(TINY_EOS_ID)
    raise AssertionError("no seed produced EOS; the tiny model's EOS row is too damped")


def test_max_tokens_ends_with_length() -> None:
    tokens, reason = _run(LLMEngine(CONFIG), max_tokens=7)
    assert len(tokens) == 7 and reason == "length"


def test_eos_ends_the_request_and_ignore_eos_goes_past_it(eos_case: tuple[int, int]) -> None:
    seed, at = eos_case
    engine = LLMEngine(CONFIG)
    tokens, reason = _run(engine, max_tokens=40, temperature=1.0, seed=seed)
    assert reason == "stop" and len(tokens) == at + 1 and tokens[-1] == TINY_EOS_ID
    ignored, reason = _run(engine, max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)
    assert reason == "length" and len(ignored) == 40 and ignored[: at + 1] == tokens
    assert engine.num_free_pages == engine.num_total_pages


def test_stop_token_ids_end_at_the_first_occurrence() -> None:
    engine = LLMEngine(CONFIG)
    full, _ = _run(engine, max_tokens=20)
    target = full[5]
    tokens, reason = _run(engine, max_tokens=20, stop_token_ids=[target])
    assert reason == "stop" and tokens == full[: full.index(target) + 1]


def test_stop_strings_end_generation_and_the_text_stops_before_them() -> None:
    engine = LLMEngine(CONFIG, tokenizer=TOK)
    full, _ = _run(engine, max_tokens=30)
    full_text = TOK.decode(full)
    # Random bytes are often not UTF-8; pick a later pair of whole characters.
    at = next(i for i in range(6, len(full_text) - 1) if "\ufffd" not in full_text[i : i + 2])
    stop = full_text[at : at + 2]
    tokens, reason = _run(engine, max_tokens=30, stop=[stop])
    assert reason == "stop" and len(tokens) < 30
    assert tokens == full[: len(tokens)]
    detok = IncrementalDetokenizer(TOK, [stop])
    text = detok.push(tokens) + detok.flush()
    assert text == full_text[: full_text.index(stop)]
    assert engine.num_free_pages == engine.num_total_pages


def test_stop_strings_without_a_tokenizer_are_left_to_the_caller() -> None:
    full, _ = _run(LLMEngine(CONFIG), max_tokens=10)
    text = TOK.decode(full)
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    tokens, reason = _run(LLMEngine(CONFIG), max_tokens=10, stop=[stop])
    assert (tokens, reason) == (full, "length")
