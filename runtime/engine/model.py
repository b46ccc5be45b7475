"""Llama-family decoder over a flattened variable-length batch and a paged KV pool.

Linear layers run on all tokens of the step at once ([total_tokens, hidden]);
attention runs per sequence. For every layer the new tokens' K/V are first
written into their slots, then each sequence's whole context is read back
through its page table. Reading the new tokens back from the pool (instead
of using the fresh tensors) means prefill already sees K/V at the pool's
dtype, exactly as every later decode step and a remote decode instance that
received those pages will.

One instance holds one rank's shard (its layers, its heads); `all_reduce`
sums the partial outputs of the row-parallel projections across tp ranks
and is None when tp == 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdcluster.runtime.engine.config import ModelConfig, RopeScaling
from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.engine.weights import LayerWeights, ShardWeights
from pdcluster.runtime.spec import pages_for

AllReduce = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's tokens inside a flattened batch."""

    offset: int  # first row of this sequence in the flattened batch
    num_tokens: int
    start_pos: int  # position of its first new token
    # [start_pos + num_tokens] int64: slots of positions 0..end-1 (on the batch
    # device for multi-token sequences; single-token ones are padded into a group)
    context_slots: torch.Tensor


@dataclass(frozen=True)
class SingleTokenGroup:
    """Every sequence feeding one token this step, attended in one padded call."""

    rows: torch.Tensor  # [B] int64: their rows in the flattened batch
    context_slots: torch.Tensor  # [B, C] int64, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, C] bool: True for real context


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: where the new tokens' K/V go
    seqs: tuple[SeqSlice, ...]
    single: SingleTokenGroup | None  # sequences with one new token (decode steps)
    multi: tuple[SeqSlice, ...]  # sequences with several new tokens (prefill chunks)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def last_rows(self) -> torch.Tensor:
        """[num_seqs] row of each sequence's last token (where logits come from)."""
        rows = [s.offset + s.num_tokens - 1 for s in self.seqs]
        return torch.tensor(rows, dtype=torch.int64, device=self.token_ids.device)


def build_forward_batch(
    chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]],
    page_size: int,
    device: str | torch.device = "cpu",
) -> ForwardBatch:
    """chunks: (new token ids, start position, page table) per sequence."""
    if not chunks:
        raise ValueError("a forward batch needs at least one sequence")
    ids: list[int] = []
    positions: list[int] = []
    seqs: list[SeqSlice] = []
    slots: list[torch.Tensor] = []
    for token_ids, start, table in chunks:
        n = len(token_ids)
        if n == 0:
            raise ValueError("a sequence in a forward batch has no tokens")
        end = start + n
        if len(table) * page_size < end:
            raise ValueError(
                f"page table of {len(table)} pages holds {len(table) * page_size} tokens, "
                f"the sequence needs {end}"
            )
        pages = torch.as_tensor(table[: pages_for(end, page_size)], dtype=torch.int64)
        pos = torch.arange(end, dtype=torch.int64)
        ctx = pages[pos // page_size] * page_size + pos % page_size  # [end]
        seqs.append(SeqSlice(len(ids), n, start, ctx if n == 1 else ctx.to(device)))
        slots.append(ctx[start:])
        ids.extend(token_ids)
        positions.extend(range(start, end))
    singles = [s for s in seqs if s.num_tokens == 1]
    single = None
    if singles:
        width = max(int(s.context_slots.shape[0]) for s in singles)
        padded = torch.zeros(len(singles), width, dtype=torch.int64)
        lengths = torch.tensor([int(s.context_slots.shape[0]) for s in singles])
        for i, s in enumerate(singles):
            padded[i, : s.context_slots.shape[0]] = s.context_slots.cpu()
        mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)  # [B, C]
        single = SingleTokenGroup(
            rows=torch.tensor([s.offset for s in singles], dtype=torch.int64, device=device),
            context_slots=padded.to(device),
            mask=mask.view(len(singles), 1, 1, width).to(device),
        )
    return ForwardBatch(
        token_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slots=torch.cat(slots).to(device),
        seqs=tuple(seqs),
        single=single,
        multi=tuple(s for s in seqs if s.num_tokens > 1),
    )


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float64 inverse frequencies, scaling applied."""
    d = config.head_dim
    inv: torch.Tensor = 1.0 / (
        config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    )
    scaling: RopeScaling | None = config.rope_scaling
    if scaling is None:
        return inv
    factor = float(scaling.factor)
    if scaling.kind == "linear":
        return inv / factor
    # llama3: keep short wavelengths, divide long ones, interpolate between.
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, mid, out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Half-precision inputs are normalised in float32, as the reference
    # implementations do; the variance of a bf16 row loses too many bits.
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return out.to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D]. Rotates the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, heads, D]
    return x * cos + rotated * sin


class LlamaModel:
    """Forward pass of one rank's shard. Not an nn.Module: inference only."""

    def __init__(self, weights: ShardWeights, all_reduce: AllReduce | None = None) -> None:
        self.w = weights
        self.config = weights.config
        self.all_reduce = all_reduce
        ref = weights.layers[0].qkv
        self.dtype = ref.dtype
        self.device = ref.device
        self._inv_freq = rope_inv_freq(self.config)
        self._cos = torch.empty(0, 1, self.config.head_dim, dtype=self.dtype, device=self.device)
        self._sin = self._cos

    @property
    def is_first_stage(self) -> bool:
        return self.w.embed is not None

    @property
    def is_last_stage(self) -> bool:
        return self.w.lm_head is not None

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max().item()) + 1
        if need > self._cos.shape[0]:
            size = max(need, 2 * self._cos.shape[0], 256)
            angles = torch.outer(torch.arange(size, dtype=torch.float64), self._inv_freq)
            angles = torch.cat((angles, angles), dim=-1)  # [size, D]
            self._cos = angles.cos().to(self.dtype).to(self.device).unsqueeze(1)  # [size, 1, D]
            self._sin = angles.sin().to(self.dtype).to(self.device).unsqueeze(1)  # [size, 1, D]
        return self._cos[positions], self._sin[positions]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.w.embed is None:
            raise RuntimeError("embed() called on a rank that is not the first pipeline stage")
        out: torch.Tensor = self.w.embed[token_ids]  # [T, hidden]
        return out

    def forward(self, batch: ForwardBatch, pool: KVPool, hidden: torch.Tensor) -> torch.Tensor:
        """Run this rank's layers. hidden: [T, hidden] → [T, hidden] (before the final norm)."""
        cos, sin = self._rope_tables(batch.positions)
        for local, layer in enumerate(self.w.layers):
            hidden = hidden + self._attention(layer, local, batch, pool, hidden, cos, sin)
            hidden = hidden + self._mlp(layer, hidden)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] rows to sample from → [N, vocab]."""
        if self.w.norm is None or self.w.lm_head is None:
            raise RuntimeError("logits() called on a rank that is not the last pipeline stage")
        out: torch.Tensor = (
            rms_norm(hidden, self.w.norm, self.config.rms_norm_eps) @ self.w.lm_head.T
        )
        return out  # [N, vocab]

    def _attention(
        self,
        layer: LayerWeights,
        local: int,
        batch: ForwardBatch,
        pool: KVPool,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        cfg, w = self.config, self.w
        d, nq, nkv = cfg.head_dim, w.num_q_heads, w.num_kv_heads
        x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)  # [T, (nq + 2 nkv) D]
        q, k, v = torch.split(qkv, [nq * d, nkv * d, nkv * d], dim=-1)
        q = apply_rope(q.view(-1, nq, d), cos, sin)  # [T, nq, D]
        k = apply_rope(k.view(-1, nkv, d), cos, sin)  # [T, nkv, D]
        pool.write(local, batch.slots, k, v.reshape(-1, nkv, d))
        out = torch.empty_like(q)  # [T, nq, D]
        single = batch.single
        if single is not None:
            kv = pool.read_kv(local, single.context_slots).to(q.dtype)  # [2, B, C, nkv, D]
            attended = F.scaled_dot_product_attention(
                q[single.rows].unsqueeze(2),  # [B, nq, 1, D]
                kv[0].transpose(1, 2),  # [B, nkv, C, D]
                kv[1].transpose(1, 2),
                attn_mask=single.mask,  # [B, 1, 1, C]
                enable_gqa=True,
            )  # [B, nq, 1, D]
            out[single.rows] = attended.squeeze(2)
        for seq in batch.multi:
            rows = slice(seq.offset, seq.offset + seq.num_tokens)
            kv = pool.read_kv(local, seq.context_slots).to(q.dtype)  # [2, ctx, nkv, D]
            out[rows] = self._attend(q[rows], kv[0], kv[1], seq.start_pos)
        o: torch.Tensor = out.view(-1, nq * d) @ layer.o.T  # [T, hidden] (partial sum when tp > 1)
        if self.all_reduce is not None:
            self.all_reduce(o)
        return o

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q: [n, nq, D] at positions start..start+n-1; k, v: [ctx, nkv, D] → [n, nq, D]."""
        n, ctx = q.shape[0], k.shape[0]
        q_pos = torch.arange(start, start + n, device=q.device).unsqueeze(1)  # [n, 1]
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos  # [n, ctx]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [nq, n, D]
            k.transpose(0, 1),  # [nkv, ctx, D]
            v.transpose(0, 1),
            attn_mask=mask,
            enable_gqa=True,
        )  # [nq, n, D]
        return out.transpose(0, 1)

    def _mlp(self, layer: LayerWeights, hidden: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hidden, layer.post_norm, self.config.rms_norm_eps)
        gate, up = (x @ layer.gate_up.T).chunk(2, dim=-1)  # each [T, inter_local]
        out: torch.Tensor = (
            F.silu(gate) * up
        ) @ layer.down.T  # [T, hidden] (partial sum when tp > 1)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out
