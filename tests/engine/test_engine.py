"""LLMEngine behaviour a caller sees: determinism, batching, capacity, aborts, bad input."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine, RequestRejected, StepFailed
from pdcluster.runtime.engine.engine_config import EngineConfig, EngineConfigError
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from tests.engine.testing import generate, record_preemptions

TOK = ByteTokenizer()
SMALL = EngineConfig(num_pages=64, page_size=4, max_running_requests=8, max_batch_tokens=64)


def _req(rid: str, text: str, **sampling: Any) -> EngineRequest:
    params = SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **sampling})
    return EngineRequest(rid, TOK.encode(text), params)


def test_same_seed_and_prompt_give_the_same_tokens_on_two_engines() -> None:
    reqs = [
        _req("greedy", "Hello world"),
        _req("seeded", "Hello world", temperature=0.9, top_p=0.95, seed=1234),
    ]
    first = generate(LLMEngine(SMALL), reqs)
    second = generate(LLMEngine(SMALL), reqs)
    assert first == second
    assert all(len(tokens) == 12 for tokens, _ in first.values())


def test_different_prompts_and_seeds_give_different_outputs() -> None:
    out = generate(
        LLMEngine(SMALL),
        [
            _req("a", "Hello world"),
            _req("b", "Goodbye moon"),
            _req("s1", "Hello world", temperature=1.0, seed=1),
            _req("s2", "Hello world", temperature=1.0, seed=2),
        ],
    )
    assert out["a"][0] != out["b"][0]
    assert out["s1"][0] != out["s2"][0]
    assert out["a"][0] != out["s1"][0]


def test_a_batch_with_chunked_prefill_equals_requests_run_one_by_one() -> None:
    # float64: batching changes matmul shapes; rounding must not flip a token.
    base = dataclasses.replace(SMALL, compute_dtype="float64", kv_dtype="float64")
    prompts = ["x", "Hello world", "The quick brown fox jumps over the lazy dog" * 2, "0123456789"]
    reqs = [
        _req(f"r{i}", p, max_tokens=6 + i, temperature=0.7 * (i % 2), seed=i)
        for i, p in enumerate(prompts)
    ]
    alone = {}
    for r in reqs:
        alone.update(generate(LLMEngine(dataclasses.replace(base, chunk_size=4096)), [r]))
    chunked = dataclasses.replace(base, chunk_size=5, max_batch_tokens=16, max_running_requests=3)
    batched = generate(LLMEngine(chunked), reqs)
    assert batched == alone


def test_a_tight_pool_preempts_and_recomputes_without_changing_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = dataclasses.replace(SMALL, compute_dtype="float64", kv_dtype="float64")
    reqs = [_req(f"r{i}", "abcdefghij"[: 3 + i] * 2, max_tokens=20) for i in range(5)]
    roomy = generate(LLMEngine(base), reqs)
    engine = LLMEngine(dataclasses.replace(base, num_pages=16))
    preempted = record_preemptions(engine, monkeypatch)
    tight = generate(engine, reqs)
    assert preempted, "the pool was meant to be too small to run everything at once"
    assert tight == roomy
    assert engine.num_free_pages == engine.num_total_pages == 16


def test_abort_matches_the_exact_rid_and_frees_pages() -> None:
    engine = LLMEngine(SMALL)
    engine.add_request(_req("req-1", "first prompt", max_tokens=50))
    engine.add_request(_req("req-10", "second prompt", max_tokens=50))
    engine.step()
    assert engine.num_free_pages < engine.num_total_pages
    assert engine.abort("req-1") is True
    assert engine.abort("req-1") is False
    assert engine.abort("req-") is False
    outputs = [o for _ in range(3) for o in engine.step()]
    assert {o.rid for o in outputs} == {"req-10"}
    assert engine.abort("req-10") is True
    assert engine.num_free_pages == engine.num_total_pages
    assert not engine.has_work()


TRUE: Any = True  # a bool is not a token id
BOGUS_MODE: Any = "bogus"
BAD_REQUESTS = [
    (EngineRequest("x", [1, 2, 320], SamplingParams()), "outside the vocabulary"),
    (EngineRequest("x", [1, -2], SamplingParams()), "outside the vocabulary"),
    (EngineRequest("x", [1, TRUE], SamplingParams()), "outside the vocabulary"),
    (EngineRequest("x", [], SamplingParams()), "empty prompt"),
    (EngineRequest("x", [1] * 300, SamplingParams()), "max_prompt_tokens"),
    (EngineRequest("x", [1] * 200, SamplingParams(max_tokens=100)), "KV pages"),
    (EngineRequest("x", [1], SamplingParams(max_tokens=2000)), "max_new_tokens"),
    (EngineRequest("", [1], SamplingParams()), "rid"),
    (EngineRequest("x", [1], SamplingParams(), mode="prefilled"), "page_table and first_token"),
    (EngineRequest("x", [1], SamplingParams(), page_table=[0]), "only for mode 'prefilled'"),
    (EngineRequest("x", [1], SamplingParams(), mode=BOGUS_MODE), "mode"),
    (
        EngineRequest(
            "x", [1, 2], SamplingParams(), mode="prefilled", page_table=[50], first_token=5
        ),
        "not allocated",
    ),
    (  # page 0 holds the live request's KV
        EngineRequest(
            "x", [1, 2], SamplingParams(), mode="prefilled", page_table=[0], first_token=5
        ),
        "belongs to another sequence",
    ),
    (
        EngineRequest(
            "x", [1], SamplingParams(), mode="prefilled", page_table=[0], first_token=999
        ),
        "first_token",
    ),
]


@pytest.mark.parametrize(("req", "message"), BAD_REQUESTS)
def test_bad_requests_are_rejected_with_nothing_reserved(req: EngineRequest, message: str) -> None:
    config = dataclasses.replace(SMALL, max_prompt_tokens=256, num_pages=60)
    engine = LLMEngine(config)
    engine.add_request(_req("live", "keeps running", max_tokens=3))
    engine.step()
    free = engine.num_free_pages
    with pytest.raises(RequestRejected, match=message):
        engine.add_request(req)
    assert engine.num_free_pages == free
    out = generate(engine, [])
    assert list(out) == ["live"] and out["live"][1] == "length"
    assert engine.num_free_pages == engine.num_total_pages  # "live" finished, nothing leaked


def test_a_duplicate_live_rid_is_rejected() -> None:
    engine = LLMEngine(SMALL)
    engine.add_request(_req("dup", "one"))
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request(_req("dup", "two"))
    out = generate(engine, [_req("other", "three", max_tokens=2)])
    assert out["dup"] == generate(LLMEngine(SMALL), [_req("dup", "one")])["dup"]
    assert len(out["other"][0]) == 2


def test_a_failing_step_aborts_its_requests_and_frees_their_pages() -> None:
    engine = LLMEngine(SMALL)

    def broken_transfer(rid: str, pages: tuple[int, ...], start: int, end: int) -> None:
        raise OSError("transfer engine went away")

    engine.on_prefill_chunk = broken_transfer
    engine.add_request(_req("a", "some prompt"))
    with pytest.raises(StepFailed, match="went away") as failed:
        engine.step()
    # The caller learns which requests the step dropped, and why.
    assert failed.value.rids == ("a",) and isinstance(failed.value.cause, OSError)
    assert engine.num_free_pages == engine.num_total_pages
    assert engine.abort("a") is False
    engine.on_prefill_chunk = None
    assert len(generate(engine, [_req("b", "again", max_tokens=3)])["b"][0]) == 3


def test_prefill_chunk_hook_covers_the_prompt_in_order() -> None:
    engine = LLMEngine(dataclasses.replace(SMALL, chunk_size=4))
    seen: list[tuple[str, int, int, int]] = []
    engine.on_prefill_chunk = lambda rid, pages, start, end: seen.append(
        (rid, len(pages), start, end)
    )
    generate(engine, [_req("p", "0123456789", max_tokens=2)])  # BOS + 10 bytes
    assert [(s, e) for _, _, s, e in seen] == [(0, 4), (4, 8), (8, 11)]
    assert all(n * 4 >= e for _, n, _, e in seen)  # pages cover the chunk


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("compute_dtype", "int8", "compute_dtype"),
        ("kv_dtype", "float8", "kv_dtype"),
        ("device", "tpu", "device"),
        ("max_batch_tokens", 4, "max_batch_tokens"),
        ("max_new_tokens", 0, "max_new_tokens"),
    ],
)
def test_bad_engine_settings_are_named(field: str, value: object, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        dataclasses.replace(SMALL, **{field: value})


def test_max_model_len_beyond_the_model_is_refused() -> None:
    with pytest.raises(EngineConfigError, match="max positions"):
        LLMEngine(dataclasses.replace(SMALL, max_model_len=10**6))
