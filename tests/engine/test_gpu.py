"""The engine on a CUDA device (run where one is present; CI has none)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape, slots_for_positions
from pdcluster.runtime.engine.model import LlamaModel, build_forward_batch
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from pdcluster.runtime.engine.weights import load_tiny, tiny_tensors
from tests.engine.testing import generate

from .dense_reference import dense_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOK = ByteTokenizer()
CPU64 = EngineConfig(compute_dtype="float64", kv_dtype="float64", page_size=8, num_pages=64)
CUDA64 = dataclasses.replace(CPU64, device="cuda")
REQUESTS = [
    EngineRequest("g", TOK.encode("Hello from the GPU"), SamplingParams(max_tokens=16)),
    EngineRequest(
        "s", TOK.encode("seeded"), SamplingParams(max_tokens=16, temperature=1.0, seed=9)
    ),
]


def test_cuda_float32_paged_model_matches_the_dense_reference() -> None:
    model = LlamaModel(load_tiny(dtype=torch.float32, device="cuda"))
    pool = KVPool(KVPoolShape(4, 16, 4, 4, 32, "float32"), device="cuda")
    tokens = TOK.encode("paged attention on the device, in chunks")
    table = list(range(15, 15 - (len(tokens) + 3) // 4, -1))
    logits = []
    for start in range(0, len(tokens), 7):
        batch = build_forward_batch([(tokens[start : start + 7], start, table)], 4, "cuda")
        hidden = model.forward(batch, pool, model.embed(batch.token_ids))
        logits.append(model.logits(hidden).cpu())
    got = torch.cat(logits).double()
    want = dense_logits(tiny_tensors(), load_tiny().config, tokens, dtype=torch.float64)
    assert (got - want).abs().max().item() < 1e-3
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_cuda_engine_gives_the_cpu_tokens_in_float64() -> None:
    assert generate(LLMEngine(CUDA64), REQUESTS) == generate(LLMEngine(CPU64), REQUESTS)


def test_prefill_on_cuda_decode_on_cpu_equals_a_cpu_run() -> None:
    prompt = TOK.encode("KV pages cross from a GPU prefill to a CPU decode")
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=4, ignore_eos=True)
    prefill, decode = LLMEngine(CUDA64), LLMEngine(CPU64)
    prefill.add_request(EngineRequest("r", prompt, params, mode="prefill_only"))
    (out,) = [o for _ in range(4) for o in prefill.step()]
    held = prefill.scheduler.get("r")
    assert held is not None and out.finish_reason == "prefill_done"
    positions = torch.arange(len(prompt))
    src = prefill.runner.pool
    frame = src.gather_tokens(
        range(4), slots_for_positions(held.page_table, positions, 8).to("cuda")
    ).cpu()
    pages = decode.allocator.allocate(-(-len(prompt) // 8))
    decode.runner.pool.scatter_tokens(range(4), slots_for_positions(pages, positions, 8), frame)
    prefill.release("r")
    decode.add_request(
        EngineRequest(
            "r", prompt, params, mode="prefilled", page_table=pages,
            first_token=out.new_token_ids[0],
        )
    )  # fmt: skip
    normal = generate(LLMEngine(CPU64), [EngineRequest("r", prompt, params)])
    assert generate(decode, []) == normal


def test_bfloat16_on_cuda_is_deterministic() -> None:
    config = dataclasses.replace(CUDA64, compute_dtype="bfloat16", kv_dtype="bfloat16")
    first = generate(LLMEngine(config), REQUESTS)
    assert first == generate(LLMEngine(config), REQUESTS)
    # The tiny model can sample EOS (these requests do not ignore it): each one ran
    # to its 16 tokens, or stopped early on EOS.
    for tokens, reason in first.values():
        assert (reason, len(tokens)) == ("length", 16) or (reason == "stop" and tokens), first


BF16 = dataclasses.replace(CUDA64, compute_dtype="bfloat16", kv_dtype="bfloat16", page_size=16)


def test_bfloat16_on_cuda_attends_through_the_fused_varlen_kernel() -> None:
    from pdcluster.runtime.engine.attention import VarlenAttention

    engine = LLMEngine(BF16)
    assert isinstance(engine.runner.model.attention, VarlenAttention)
    assert engine.runner.graphs is not None  # decode steps replay captured graphs


def test_a_captured_decode_step_matches_the_eager_step() -> None:
    from pdcluster.runtime.engine.kv_pool import KVPool

    runner = LLMEngine(BF16).runner
    graphs, model = runner.graphs, runner.model
    assert graphs is not None
    prompts = [TOK.encode(t) for t in ("one", "two words", "a third, longer prompt")]
    chunks = []
    for i, prompt in enumerate(prompts):
        table = list(range(i * 4, i * 4 + 4))
        batch = build_forward_batch([(prompt, 0, table)], 16, "cuda", varlen=True)
        model.forward(batch, runner.pool, model.embed(batch.token_ids))
        chunks.append(([65], len(prompt), table))
    eager_pool = KVPool(runner.pool.shape, device="cuda")
    eager_pool.buffer.copy_(runner.pool.buffer)
    got = graphs.run(chunks).float()  # three rows replay the size-4 graph
    batch = build_forward_batch(chunks, 16, "cuda", varlen=True)
    want = model.logits(model.forward(batch, eager_pool, model.embed(batch.token_ids))).float()
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
    # The padding row wrote the third row's K/V into its slot: the pools agree.
    assert torch.allclose(runner.pool.buffer.float(), eager_pool.buffer.float(), atol=1e-2)


def test_graphs_on_or_off_the_engine_is_deterministic() -> None:
    on = generate(LLMEngine(BF16), REQUESTS)
    assert on == generate(LLMEngine(BF16), REQUESTS)
    off = generate(LLMEngine(dataclasses.replace(BF16, cuda_graphs=False)), REQUESTS)
    assert all(len(tokens) == len(off[rid][0]) for rid, (tokens, _) in on.items())


def test_the_sampler_draws_on_cuda_what_it_draws_on_the_cpu() -> None:
    from pdcluster.runtime.engine.sampler import SampleSpec, sample

    logits = torch.randn(8, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    specs = [
        SampleSpec(SamplingParams(temperature=0.7, top_p=0.9 if i % 2 else 1.0), 3, i)
        for i in range(8)
    ]
    assert sample(logits.cuda(), specs).tokens == sample(logits, specs).tokens


def test_a_pool_without_num_pages_fills_its_share_of_the_gpu() -> None:
    engine = LLMEngine(dataclasses.replace(BF16, num_pages=None, gpu_memory_utilization=0.5))
    free, total = torch.cuda.mem_get_info()
    assert engine.num_total_pages > 64
    assert total - free <= 0.5 * total + (256 << 20)  # within the share (allocator slack)
