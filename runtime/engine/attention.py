"""Causal attention of a whole step over the paged KV pool, one call per layer.

Two implementations of the same function, chosen once per model:

- `PagedAttention` (any device, any dtype): sequences feeding one token
  attend tile by tile (`forward_batch.DecodeTiles`): all tiles of the step
  are read from the pool with one page gather, scored with one batched
  matmul, and each sequence's tiles are combined with a running-max softmax
  (max per tile, rescaled sums per sequence). Memory and time follow the
  sum of the contexts, never batch × longest. A prefill chunk attends its
  own pages with one fused SDPA call (causal from its start position).
- `VarlenAttention` (CUDA, float16/bfloat16, NHD pool): PyTorch's varlen
  flash kernel reads the pool through a block table: no gather at all,
  decode rows and prefill chunks in one kernel. `num_splits=1` keeps each
  sequence's result independent of its batch. Chosen only when a probe call
  at start-up succeeds on this device, page size and head layout.

On the CPU every reduction of one sequence runs in a fixed order that its
neighbours do not change, so a row gets the same bits whatever it is
batched with. (`PagedAttention` on CUDA combines tiles with atomic adds:
its last bits may vary between runs.)
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

import torch
import torch.nn.functional as F

from pdcluster.runtime.engine.forward_batch import (
    DecodeTiles,
    ForwardBatch,
    PrefillChunk,
    build_forward_batch,
)
from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.spec import KVLayout

log = logging.getLogger("pdcluster.engine")

__all__ = ["Attention", "PagedAttention", "VarlenAttention", "select_attention"]


class Attention(Protocol):
    needs_varlen: bool  # build_forward_batch(varlen=...) for this implementation

    def __call__(
        self, q: torch.Tensor, pool: KVPool, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, nq, D] (K/V of the step already in the pool) → [T, nq, D]."""
        ...


class PagedAttention:
    needs_varlen = False

    def __call__(
        self, q: torch.Tensor, pool: KVPool, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        out = torch.empty_like(q)  # [T, nq, D]
        if batch.decode is not None:
            out[batch.decode.rows] = _decode(q[batch.decode.rows], pool, layer, batch.decode)
        for chunk in batch.prefill:
            out[chunk.rows] = _prefill(q[chunk.rows], pool, layer, chunk)
        return out


def _decode(q: torch.Tensor, pool: KVPool, layer: int, tiles: DecodeTiles) -> torch.Tensor:
    """q: [B, nq, D], one query per sequence → [B, nq, D]."""
    num_seqs, nq, d = q.shape
    nkv = pool.shape.num_kv_heads
    num_tiles, width = tiles.pages.shape[0], tiles.valid.shape[-1]
    work = torch.promote_types(q.dtype, torch.float32)  # half inputs accumulate in float32
    kv = pool.read_pages(layer, tiles.pages).to(work)  # [2, P, k, ps, nkv, D]
    k = kv[0].reshape(num_tiles, width, nkv, d).permute(0, 2, 3, 1)  # [P, nkv, D, W]
    v = kv[1].reshape(num_tiles, width, nkv, d).transpose(1, 2)  # [P, nkv, W, D]
    qt = q.to(work)[tiles.owner].view(num_tiles, nkv, nq // nkv, d)  # [P, nkv, g, D]
    scores = torch.matmul(qt, k).mul_(1.0 / math.sqrt(d))  # [P, nkv, g, W]
    scores.masked_fill_(~tiles.valid, float("-inf"))
    # Softmax across a sequence's tiles: every tile holds at least one real
    # position, so each tile's max is finite; the sequence's max is the max of
    # its tiles' (exact in any order).
    tile_max = scores.amax(dim=-1)  # [P, nkv, g]
    owner = tiles.owner.view(-1, 1, 1).expand_as(tile_max)
    seq_max = torch.full((num_seqs, nkv, nq // nkv), float("-inf"), dtype=work, device=q.device)
    seq_max.scatter_reduce_(0, owner, tile_max, "amax")  # [B, nkv, g]
    probs = torch.exp(scores - seq_max[tiles.owner].unsqueeze(-1))  # [P, nkv, g, W]
    partial = torch.matmul(probs, v)  # [P, nkv, g, D]
    total = torch.zeros(num_seqs, nkv, nq // nkv, dtype=work, device=q.device)
    total.index_add_(0, tiles.owner, probs.sum(dim=-1))  # [B, nkv, g]
    out = torch.zeros(num_seqs, nkv, nq // nkv, d, dtype=work, device=q.device)
    out.index_add_(0, tiles.owner, partial)  # [B, nkv, g, D]
    return (out / total.unsqueeze(-1)).view(num_seqs, nq, d).to(q.dtype)


def _prefill(q: torch.Tensor, pool: KVPool, layer: int, chunk: PrefillChunk) -> torch.Tensor:
    """q: [n, nq, D] at positions start..end-1 → [n, nq, D]."""
    kv = pool.read_pages(layer, chunk.pages)  # [2, pages, ps, nkv, D]
    kv = kv.flatten(1, 2)[:, : chunk.end_pos].to(q.dtype)  # [2, ctx, nkv, D]
    q_pos = torch.arange(chunk.start_pos, chunk.end_pos, device=q.device).unsqueeze(1)  # [n, 1]
    mask = torch.arange(chunk.end_pos, device=q.device).unsqueeze(0) <= q_pos  # [n, ctx]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [nq, n, D]
        kv[0].transpose(0, 1),  # [nkv, ctx, D]
        kv[1].transpose(0, 1),
        attn_mask=mask if chunk.start_pos else None,
        is_causal=chunk.start_pos == 0,
        enable_gqa=True,
    )  # [nq, n, D]
    return out.transpose(0, 1)


class VarlenAttention:
    needs_varlen = True

    def __call__(
        self, q: torch.Tensor, pool: KVPool, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        meta = batch.varlen
        if meta is None:
            raise ValueError("VarlenAttention needs build_forward_batch(..., varlen=True)")
        kv = pool.buffer[layer]  # [2, P, ps, nkv, D] (NHD)
        out = varlen_attn(
            q,
            kv[0],
            kv[1],
            meta.cu_seq_q,
            meta.cu_seq_k,
            meta.max_q,
            meta.max_k,
            window_size=(-1, 0),  # causal, aligned to each sequence's last position
            enable_gqa=True,
            seqused_k=meta.seq_lens,
            block_table=meta.block_table,
            num_splits=1,
        )
        assert isinstance(out, torch.Tensor)
        return out


def select_attention(pool: KVPool, compute_dtype: torch.dtype, num_q_heads: int) -> Attention:
    """The fused varlen kernel where this device runs it on this pool, else PagedAttention."""
    eligible = (
        pool.device.type == "cuda"
        and compute_dtype in (torch.float16, torch.bfloat16)
        and pool.dtype == compute_dtype
        and pool.shape.layout == KVLayout.NHD
    )
    if not eligible:
        return PagedAttention()
    try:
        _probe_varlen(pool, num_q_heads)
    except Exception as err:  # noqa: BLE001 - any refusal means "not on this device"
        log.warning("fused varlen attention unavailable (%s); using paged attention", err)
        return PagedAttention()
    return VarlenAttention()


def _probe_varlen(pool: KVPool, num_q_heads: int) -> None:
    """One tiny call shaped like ours (page size, heads, dtype): raises if unsupported."""
    shape = pool.shape
    scratch = KVPool(
        type(shape)(1, 2, shape.page_size, shape.num_kv_heads, shape.head_dim, shape.dtype),
        device=pool.device,
    )
    batch = build_forward_batch(
        [([0, 0], 0, [1, 0]), ([0], shape.page_size, [0, 1])], shape.page_size, pool.device,
        varlen=True,
    )  # fmt: skip
    q = torch.zeros(3, num_q_heads, shape.head_dim, dtype=pool.dtype, device=pool.device)
    VarlenAttention()(q, scratch, 0, batch)
    torch.cuda.synchronize(pool.device)
