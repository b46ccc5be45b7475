"""The paged model computes what a dense, page-free Llama computes."""

from __future__ import annotations

import random

import pytest
import torch

from pdcluster.runtime.engine.config import ModelConfig, RopeScaling, tiny_config
from pdcluster.runtime.engine.kv_pool import DTYPES, KVPool, KVPoolShape
from pdcluster.runtime.engine.model import LlamaModel, build_forward_batch, rope_inv_freq
from pdcluster.runtime.engine.weights import DictSource, build_shard, tiny_tensors
from pdcluster.runtime.spec import KVLayout

from .dense_reference import dense_logits

CONFIG = tiny_config()
TENSORS = tiny_tensors(CONFIG)


def _paged_logits(
    tokens: list[int],
    page_size: int,
    layout: KVLayout,
    kv_dtype: str,
    compute: torch.dtype,
    rng: random.Random,
) -> tuple[torch.Tensor, KVPool, list[int]]:
    """Prefill `tokens` in random chunks through a shuffled page table."""
    model = LlamaModel(build_shard(CONFIG, DictSource(TENSORS), dtype=compute))
    needed = -(-len(tokens) // page_size)
    num_pages = needed + 5
    pool = KVPool(
        KVPoolShape(
            CONFIG.num_layers, num_pages, page_size, CONFIG.num_kv_heads, 32, kv_dtype, layout
        )
    )
    table = rng.sample(range(num_pages), needed)  # scattered, out-of-order pages
    logits = []
    start = 0
    while start < len(tokens):
        end = min(len(tokens), start + rng.randint(1, 9))
        batch = build_forward_batch([(tokens[start:end], start, table)], page_size)
        hidden = model.forward(batch, pool, model.embed(batch.token_ids))
        logits.append(model.logits(hidden))
        start = end
    return torch.cat(logits), pool, table


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
@pytest.mark.parametrize(
    ("kv_dtype", "compute", "atol"),
    [("float32", torch.float32, 1e-4), ("float64", torch.float64, 1e-10)],
)
def test_paged_equals_dense_exactly_for_full_precision(
    page_size: int, layout: KVLayout, kv_dtype: str, compute: torch.dtype, atol: float
) -> None:
    rng = random.Random(page_size * 7 + len(layout.value) + len(kv_dtype))
    for _ in range(2):
        tokens = [rng.randrange(258) for _ in range(rng.randint(1, 40))]
        paged, _, _ = _paged_logits(tokens, page_size, layout, kv_dtype, compute, rng)
        dense = dense_logits(TENSORS, CONFIG, tokens, dtype=compute)
        torch.testing.assert_close(paged, dense, rtol=0, atol=atol)
        assert paged.argmax(-1).tolist() == dense.argmax(-1).tolist()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
@pytest.mark.parametrize(
    ("kv_dtype", "rounding_atol", "drift"), [("bfloat16", 0.05, 0.5), ("float16", 0.01, 0.1)]
)
def test_reduced_precision_kv_matches_dense_within_dtype_tolerance(
    page_size: int, layout: KVLayout, kv_dtype: str, rounding_atol: float, drift: float
) -> None:
    rng = random.Random(page_size + len(kv_dtype))
    tokens = [rng.randrange(258) for _ in range(37)]
    paged, _, _ = _paged_logits(tokens, page_size, layout, kv_dtype, torch.float32, rng)
    exact = dense_logits(TENSORS, CONFIG, tokens)
    # The cache's rounding moves logits a little from full precision...
    error = (paged - exact).abs().max().item()
    assert 0 < error < drift
    # ...and rounding K/V in the dense model the same way explains most of it
    # (what remains: float32 noise that flips a few roundings, amplified by layers).
    rounded = dense_logits(TENSORS, CONFIG, tokens, kv_dtype=DTYPES[kv_dtype])
    assert (paged - rounded).abs().max().item() < min(rounding_atol, error / 3)
    assert paged.argmax(-1).tolist() == exact.argmax(-1).tolist()


def test_bfloat16_compute_tracks_float32() -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(258) for _ in range(30)]
    paged, _, _ = _paged_logits(tokens, 4, KVLayout.NHD, "bfloat16", torch.bfloat16, rng)
    exact = dense_logits(TENSORS, CONFIG, tokens)
    assert paged.dtype == torch.bfloat16
    assert (paged.float() - exact).abs().max().item() < 1.5
    # Nearly every position still agrees on the top token.
    agree = (paged.float().argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree > 0.8


def test_writes_stay_inside_the_sequence_pages() -> None:
    rng = random.Random(11)
    tokens = [rng.randrange(258) for _ in range(13)]
    _, pool, table = _paged_logits(tokens, 4, KVLayout.HND, "float32", torch.float32, rng)
    untouched = sorted(set(range(pool.shape.num_pages)) - set(table))
    assert untouched
    assert pool.buffer[:, :, untouched].abs().sum().item() == 0
    # The last page holds 13 - 12 = 1 token; its other slots stay zero.
    last = pool.buffer[:, :, table[-1]]  # [L, 2, H, page, D] (HND)
    assert last[:, :, :, 1:].abs().sum().item() == 0
    assert last[:, :, :, 0].abs().sum().item() > 0


def test_mixed_batch_equals_sequences_run_alone() -> None:
    """One step holding a decode token and a prefill chunk of two other
    sequences gives each the logits it gets alone."""
    model = LlamaModel(build_shard(CONFIG, DictSource(TENSORS), dtype=torch.float64))
    shape = KVPoolShape(CONFIG.num_layers, 30, 4, CONFIG.num_kv_heads, 32, "float64")
    prompts = [[1, 2, 3, 4, 5, 6, 7], [100, 101, 102], [250, 7, 9, 11, 13]]
    tables = [[0, 1], [5], [9, 3]]

    def run(pool: KVPool, chunks: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        batch = build_forward_batch(chunks, 4)
        hidden = model.forward(batch, pool, model.embed(batch.token_ids))
        return model.logits(hidden[batch.last_rows])

    together = KVPool(shape)
    run(together, [(prompts[0][:6], 0, tables[0]), (prompts[2][:2], 0, tables[2])])
    mixed = run(
        together,
        [
            (prompts[0][6:], 6, tables[0]),
            (prompts[1], 0, tables[1]),
            (prompts[2][2:], 2, tables[2]),
        ],
    )
    for i, prompt in enumerate(prompts):
        alone = run(KVPool(shape), [(prompt, 0, tables[i])])
        torch.testing.assert_close(mixed[i], alone[0], rtol=0, atol=1e-12)


def test_forward_batch_rejects_short_page_tables_and_empty_sequences() -> None:
    with pytest.raises(ValueError, match="holds 8 tokens, the sequence needs 9"):
        build_forward_batch([([1] * 9, 0, [0, 1])], 4)
    with pytest.raises(ValueError, match="no tokens"):
        build_forward_batch([([], 0, [0])], 4)
    with pytest.raises(ValueError, match="at least one"):
        build_forward_batch([], 4)


def test_rope_scaling_linear_and_llama3() -> None:
    base = ModelConfig(
        vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=32, rope_theta=500000.0,
    )  # fmt: skip
    plain = rope_inv_freq(base)
    linear = rope_inv_freq(
        ModelConfig(**{**base.__dict__, "rope_scaling": RopeScaling("linear", 4.0)})
    )
    torch.testing.assert_close(linear, plain / 4.0)
    llama3 = rope_inv_freq(
        ModelConfig(**{**base.__dict__, "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)})
    )
    wavelen = 2 * torch.pi / plain
    # Short wavelengths (< 8192 / 4) keep their frequency, long ones (> 8192) are divided.
    assert torch.equal(llama3[wavelen < 2048], plain[wavelen < 2048])
    torch.testing.assert_close(llama3[wavelen > 8192], plain[wavelen > 8192] / 8.0)
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any()
    assert bool(((llama3[mid] < plain[mid]) & (llama3[mid] > plain[mid] / 8.0)).all())
