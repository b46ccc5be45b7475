"""prefill_only on one engine + prefilled on another equals one normal run.

The KV pages move with KVPool.gather_tokens / scatter_tokens, as the
transfer engine moves them, between engines whose page sizes and layouts
differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.kv_pool import slots_for_positions
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from pdcluster.runtime.spec import KVLayout
from tests.engine.testing import generate

TOK = ByteTokenizer()
PREFILL = EngineConfig(
    num_pages=40, page_size=4, kv_layout=KVLayout.NHD, chunk_size=8, max_running_requests=4,
    max_batch_tokens=64,
)  # fmt: skip
DECODE = dataclasses.replace(PREFILL, page_size=16, kv_layout=KVLayout.HND, num_pages=20)

SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=10, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_k=50, seed=77),
    # Penalties read the output so far; logprobs of the first token come from prefill.
    "penalised-logprobs": SamplingParams(
        max_tokens=10, ignore_eos=True, temperature=0.9, top_p=0.9, seed=5,
        frequency_penalty=0.7, presence_penalty=0.2, repetition_penalty=1.3, logprobs=3,
    ),
}  # fmt: skip


def _with_logprobs(engine: LLMEngine, req: EngineRequest | None = None) -> list[Any]:
    """Step until idle; (token, logprobs) of every output of the request(s)."""
    if req is not None:
        engine.add_request(req)
    out: list[Any] = []
    while engine.has_work():
        for o in engine.step():
            lps = o.new_logprobs or [None] * len(o.new_token_ids)
            out.extend(zip(o.new_token_ids, lps, strict=True))
    return out


def _handoff(prompt: list[int], params: SamplingParams) -> tuple[list[Any], LLMEngine, LLMEngine]:
    prefill, decode = LLMEngine(PREFILL), LLMEngine(DECODE)
    chunks: list[tuple[int, int]] = []
    prefill.on_prefill_chunk = lambda rid, pages, start, end: chunks.append((start, end))
    prefill.add_request(EngineRequest("room-1", prompt, params, mode="prefill_only"))
    outputs = [o for _ in range(10) for o in prefill.step()]
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].finish_reason == "prefill_done"
    first_token = outputs[0].new_token_ids[0]
    first_logprobs = outputs[0].new_logprobs[0] if outputs[0].new_logprobs else None
    assert (first_logprobs is None) == (params.logprobs is None)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(prompt)

    # The pages stay held for the transfer, even across an abort.
    held = prefill.scheduler.get("room-1")
    assert held is not None
    src_table = list(held.page_table)
    assert prefill.abort("room-1") is True
    assert prefill.num_free_pages == PREFILL.num_pages - len(src_table)

    # Decode reserves every page the prompt needs at once, receives the KV.
    n = len(prompt)
    dst_table = decode.allocator.allocate(-(-n // DECODE.page_size))
    positions = torch.arange(n)
    src_pool, dst_pool = prefill.runner.pool, decode.runner.pool
    layers = range(src_pool.shape.num_layers)
    frame = src_pool.gather_tokens(layers, slots_for_positions(src_table, positions, 4))
    dst_pool.scatter_tokens(layers, slots_for_positions(dst_table, positions, 16), frame)
    prefill.release("room-1")
    assert prefill.num_free_pages == PREFILL.num_pages

    request = EngineRequest(
        "room-1",
        prompt,
        params,
        mode="prefilled",
        page_table=dst_table,
        first_token=first_token,
        first_logprobs=first_logprobs,
    )
    decoded = [*_report_first(decode, request), *_with_logprobs(decode)]
    return decoded, prefill, decode


def _report_first(decode: LLMEngine, request: EngineRequest) -> list[Any]:
    decode.add_request(request)
    return [
        pair
        for o in decode.report_first_token(request.rid)
        for pair in zip(o.new_token_ids, o.new_logprobs or [None], strict=False)
    ]


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_prefill_then_decode_equals_a_normal_run(kind: str) -> None:
    params = SAMPLINGS[kind]
    prompt = TOK.encode("Disaggregated serving moves the KV cache between instances.")
    decoded, _, decode = _handoff(prompt, params)
    normal = _with_logprobs(LLMEngine(PREFILL), EngineRequest("n", prompt, params))
    assert [t for t, _ in decoded] == [t for t, _ in normal]
    assert len(decoded) == params.max_tokens
    for (_, got), (_, want) in zip(decoded, normal, strict=True):
        if params.logprobs is None:
            assert got is None and want is None
            continue
        # The first token's come from the prefill engine, the rest from decode's
        # pages (another page size and layout): equal up to float rounding.
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert decode.num_free_pages == decode.num_total_pages


def test_a_prefilled_request_whose_first_token_ends_it_finishes_at_once() -> None:
    decode = LLMEngine(DECODE)
    prompt = TOK.encode("short")
    pages = decode.allocator.allocate(1)
    decode.add_request(
        EngineRequest(
            "r",
            prompt,
            SamplingParams(max_tokens=1),
            mode="prefilled",
            page_table=pages,
            first_token=65,
        )
    )
    assert generate(decode, [])["r"] == ([65], "length")
    assert decode.num_free_pages == decode.num_total_pages


def test_without_the_transferred_kv_decode_output_differs() -> None:
    """Guards the test above: decode really reads the copied pages."""
    prompt = TOK.encode("Disaggregated serving moves the KV cache between instances.")
    params = SAMPLINGS["greedy"]
    normal = generate(LLMEngine(PREFILL), [EngineRequest("n", prompt, params)])["n"][0]
    decode = LLMEngine(DECODE)
    pages = decode.allocator.allocate(-(-len(prompt) // 16))
    decode.add_request(
        EngineRequest(
            "r", prompt, params, mode="prefilled", page_table=pages, first_token=normal[0]
        )
    )
    tokens = generate(decode, [])["r"][0]
    assert tokens[0] == normal[0]
    assert tokens != normal


def _prefilled(decode: LLMEngine, params: SamplingParams, first_token: int) -> None:
    pages = decode.allocator.allocate(1)
    prompt = TOK.encode("short")
    decode.add_request(
        EngineRequest(
            "r", prompt, params, mode="prefilled", page_table=pages, first_token=first_token
        )
    )


def test_the_first_token_of_a_prefilled_request_is_reported_before_any_step() -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    early = LLMEngine(DECODE)
    _prefilled(early, params, 65)
    first = early.report_first_token("r")
    assert [(o.new_token_ids, o.finished) for o in first] == [([65], False)]
    assert early.report_first_token("r") == []  # exactly once
    rest, reason = generate(early, [])["r"]
    # The same tokens as when the first one leaves with the first step.
    late = LLMEngine(DECODE)
    _prefilled(late, params, 65)
    assert [65, *rest] == generate(late, [])["r"][0]
    assert reason == "length" and len(rest) == 3
    assert early.num_free_pages == early.num_total_pages


def test_a_prefilled_request_finished_on_add_reports_its_end_with_the_next_step() -> None:
    decode = LLMEngine(DECODE)
    _prefilled(decode, SamplingParams(max_tokens=1), 65)
    assert decode.report_first_token("r") == []
    assert generate(decode, [])["r"] == ([65], "length")


def test_only_prefilled_requests_report_a_first_token_early() -> None:
    engine = LLMEngine(PREFILL)
    engine.add_request(EngineRequest("n", TOK.encode("hi"), SamplingParams(max_tokens=2)))
    assert engine.report_first_token("n") == []
    assert engine.report_first_token("unknown") == []
