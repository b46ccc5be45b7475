"""Llama-family decoder over a flattened variable-length batch and a paged KV pool.

Linear layers run on all tokens of the step at once ([total_tokens, hidden]);
attention is one call per layer for the whole step (`attention.py`). For
every layer the new tokens' K/V are first written into their slots, then
attention reads the pool's pages. Reading the new tokens back from the pool
(instead of using the fresh tensors) means prefill already sees K/V at the
pool's dtype, exactly as every later decode step and a remote decode
instance that received those pages will.

One instance holds one rank's shard (its layers, its heads); `all_reduce`
sums the partial outputs of the row-parallel projections across tp ranks
and is None when tp == 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdcluster.runtime.engine.attention import Attention, PagedAttention
from pdcluster.runtime.engine.config import ModelConfig, RopeScaling
from pdcluster.runtime.engine.forward_batch import ForwardBatch, build_forward_batch
from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.engine.weights import LayerWeights, ShardWeights

__all__ = ["AllReduce", "ForwardBatch", "LlamaModel", "build_forward_batch", "rope_inv_freq"]

AllReduce = Callable[[torch.Tensor], None]


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


def _pack_for_cpu(weight: torch.Tensor | None) -> torch.Tensor | None:
    """The output projection in oneDNN's blocked layout, on a CPU in float32.

    The largest matmul of a decode step ([rows, hidden] x [hidden, vocab]) runs
    about 1.8x faster at 16 rows from a prepacked weight than through
    `F.linear` (bench/engine_vs_vllm.py); one row gains nothing (it reads the
    weight once either way). None where it does not apply or cannot pack.
    """
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
    except (RuntimeError, AttributeError):
        return None
    return packed


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D]. Rotates the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, heads, D]
    return x * cos + rotated * sin


class LlamaModel:
    """Forward pass of one rank's shard. Not an nn.Module: inference only.

    `max_positions`: the longest sequence it will see (RoPE tables are built
    once for it; default: the model's max positions). `attention`: how a
    layer attends (default `PagedAttention`; see `attention.select_attention`).
    """

    def __init__(
        self,
        weights: ShardWeights,
        all_reduce: AllReduce | None = None,
        *,
        max_positions: int | None = None,
        attention: Attention | None = None,
    ) -> None:
        self.w = weights
        self.config = weights.config
        self.all_reduce = all_reduce
        ref = weights.layers[0].qkv
        self.dtype = ref.dtype
        self.device = ref.device
        self.attention: Attention = attention if attention is not None else PagedAttention()
        size = max_positions or self.config.max_position_embeddings
        angles = torch.outer(
            torch.arange(size, dtype=torch.float64), rope_inv_freq(self.config)
        )  # [size, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [size, D]
        # Built once: a step indexes them and never asks the device for its
        # largest position (that would wait for the device every step).
        self._cos = angles.cos().to(self.dtype).to(self.device).unsqueeze(1)  # [size, 1, D]
        self._sin = angles.sin().to(self.dtype).to(self.device).unsqueeze(1)  # [size, 1, D]
        self._lm_head_packed = _pack_for_cpu(weights.lm_head)

    @property
    def is_first_stage(self) -> bool:
        return self.w.embed is not None

    @property
    def is_last_stage(self) -> bool:
        return self.w.lm_head is not None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.w.embed is None:
            raise RuntimeError("embed() called on a rank that is not the first pipeline stage")
        out: torch.Tensor = self.w.embed[token_ids]  # [T, hidden]
        return out

    def forward(self, batch: ForwardBatch, pool: KVPool, hidden: torch.Tensor) -> torch.Tensor:
        """Run this rank's layers. hidden: [T, hidden] → [T, hidden] (before the final norm)."""
        cos, sin = self._cos[batch.positions], self._sin[batch.positions]  # each [T, 1, D]
        for local, layer in enumerate(self.w.layers):
            hidden = hidden + self._attention(layer, local, batch, pool, hidden, cos, sin)
            hidden = hidden + self._mlp(layer, hidden)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] rows to sample from → [N, vocab]."""
        if self.w.norm is None or self.w.lm_head is None:
            raise RuntimeError("logits() called on a rank that is not the last pipeline stage")
        x = rms_norm(hidden, self.w.norm, self.config.rms_norm_eps)  # [N, hidden]
        if self._lm_head_packed is not None and x.shape[0] > 1:
            packed: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self._lm_head_packed, None, "none", [], ""
            )
            return packed  # [N, vocab]
        return F.linear(x, self.w.lm_head)  # [N, vocab]

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
        v = v.reshape(-1, nkv, d)  # [T, nkv, D]
        if batch.write_rows is not None:
            k, v = k[batch.write_rows], v[batch.write_rows]
        pool.write(local, batch.slots, k, v)
        out = self.attention(q, pool, local, batch)  # [T, nq, D]
        o = F.linear(out.reshape(-1, nq * d), layer.o)  # [T, hidden] (partial when tp > 1)
        if self.all_reduce is not None:
            self.all_reduce(o)
        return o

    def _mlp(self, layer: LayerWeights, hidden: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hidden, layer.post_norm, self.config.rms_norm_eps)
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)  # each [T, inter_local]
        out = F.linear(F.silu(gate) * up, layer.down)  # [T, hidden] (partial when tp > 1)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out
