"""The static buffers of captured decode steps, checked without a GPU.

Off CUDA, `DecodeGraphs` replays a step by running it eagerly on the same
buffers a graph would read, so padding, block tables and the K/V writes of
padding rows are checked here; the capture itself runs in `bench/gpu_check.sh`
(tests marked gpu).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from pdcluster.runtime.engine.cuda_graphs import DecodeGraphs, capture_sizes
from pdcluster.runtime.engine.forward_batch import ForwardBatch, build_forward_batch
from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.engine.model import LlamaModel
from pdcluster.runtime.engine.weights import load_tiny

PAGE = 4


class BlockTableAttention:
    """What the fused varlen kernel computes, in plain torch: each sequence's queries
    attend causally (aligned to its last position) to its first `seq_lens[i]`
    positions, read through `block_table[i]`."""

    needs_varlen = True

    def __call__(
        self, q: torch.Tensor, pool: KVPool, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta = batch.varlen
        assert meta is not None
        out = torch.empty_like(q)
        cu = meta.cu_seq_q.tolist()
        for i, length in enumerate(meta.seq_lens.tolist()):
            rows = slice(cu[i], cu[i + 1])
            n = cu[i + 1] - cu[i]
            pages = meta.block_table[i, : -(-length // PAGE)].long()
            kv = pool.read_pages(layer, pages).flatten(1, 2)[:, :length]  # [2, L, nkv, D]
            q_pos = torch.arange(length - n, length).unsqueeze(1)
            mask = torch.arange(length).unsqueeze(0) <= q_pos  # [n, L]
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),
                kv[0].transpose(0, 1),
                kv[1].transpose(0, 1),
                attn_mask=mask,
                enable_gqa=True,
            ).transpose(0, 1)
        return out


def _setup(num_seqs: int, seed: int) -> tuple[KVPool, list[tuple[list[int], int, list[int]]]]:
    """A pool holding `num_seqs` prefilled prompts on shuffled pages, and each
    sequence's next decode chunk."""
    rng = random.Random(seed)
    weights = load_tiny(dtype=torch.float32)
    pool = KVPool(KVPoolShape(4, 64, PAGE, weights.num_kv_heads, 32, "float32"))
    eager = LlamaModel(weights)
    free = list(range(64))
    rng.shuffle(free)
    chunks = []
    for _ in range(num_seqs):
        n = rng.randint(1, 20)
        table = [free.pop() for _ in range(-(-(n + 1) // PAGE))]
        prompt = [rng.randrange(256) for _ in range(n)]
        batch = build_forward_batch([(prompt, 0, table)], PAGE)
        eager.forward(batch, pool, eager.embed(batch.token_ids))
        chunks.append(([rng.randrange(256)], n, table))
    return pool, chunks


def test_capture_sizes_cover_the_running_limit() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]


def test_a_padded_replay_gives_the_eager_logits_and_touches_only_real_slots() -> None:
    pool, chunks = _setup(3, seed=1)  # three sequences replay the size-4 step
    weights = load_tiny(dtype=torch.float32)
    eager_pool = KVPool(pool.shape)
    eager_pool.buffer.copy_(pool.buffer)
    before = pool.buffer.clone()

    graphs = DecodeGraphs(
        LlamaModel(weights, attention=BlockTableAttention()), pool, max_batch=4, max_model_len=64
    )
    assert graphs.capture() and graphs.can_run(chunks)
    got = graphs.run(chunks)  # [3, vocab]

    eager = LlamaModel(weights)
    batch = build_forward_batch(chunks, PAGE)
    want = eager.logits(eager.forward(batch, eager_pool, eager.embed(batch.token_ids)))
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    # The pool changed at the three new tokens' slots only, to what eager wrote.
    flat_now = pool.buffer.view(4, 2, -1, weights.num_kv_heads, 32)
    flat_before = before.view_as(flat_now)
    changed = (flat_now != flat_before).flatten(3).any(-1).any(1).any(0)  # [slots]
    slots = {table[start // PAGE] * PAGE + start % PAGE for _, start, table in chunks}
    assert set(changed.nonzero().flatten().tolist()) == slots
    assert torch.allclose(pool.buffer, eager_pool.buffer, atol=1e-5)


def test_steps_it_cannot_replay_go_eager() -> None:
    pool, chunks = _setup(2, seed=2)
    weights = load_tiny(dtype=torch.float32)
    graphs = DecodeGraphs(
        LlamaModel(weights, attention=BlockTableAttention()), pool, max_batch=2, max_model_len=64
    )
    assert not graphs.can_run(chunks)  # nothing captured yet
    graphs.capture()
    prefill = ([1, 2], 0, [5])
    assert not graphs.can_run([prefill])  # a prefill chunk
    assert not graphs.can_run([*chunks, chunks[0]])  # more rows than the largest size
    assert not graphs.can_run([([1], 64, [0] * 17)])  # past max_model_len


def test_the_varlen_layout_describes_the_batch_the_tiles_describe() -> None:
    """A mixed step (prefill chunks and decode rows) through the block-table contract
    gives what the paged tiles give: `build_forward_batch(varlen=True)` lays the
    same sequences out for the fused kernel."""
    rng = random.Random(3)
    weights = load_tiny(dtype=torch.float32)
    shape = KVPoolShape(4, 64, PAGE, weights.num_kv_heads, 32, "float32")
    pools = [KVPool(shape), KVPool(shape)]
    models = [LlamaModel(weights), LlamaModel(weights, attention=BlockTableAttention())]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    lengths = [0, 0, 0, 0]
    for _ in range(4):
        chunks = []
        for i, table in enumerate(tables):
            n = rng.choice([1, 1, rng.randint(2, 6)])
            chunks.append(([rng.randrange(256) for _ in range(n)], lengths[i], table))
            lengths[i] += n
        outs = []
        for model, pool in zip(models, pools, strict=True):
            batch = build_forward_batch(chunks, PAGE, varlen=model.attention.needs_varlen)
            outs.append(model.logits(model.forward(batch, pool, model.embed(batch.token_ids))))
        assert torch.allclose(outs[0], outs[1], atol=1e-4)
