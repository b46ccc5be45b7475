"""A dense Llama forward pass written independently of the engine's model.

It reads the Hugging Face-named tensors directly (no fused projections, no
pages, no sharding) so the paged model is checked against a second,
straightforward implementation rather than against itself.
"""

from __future__ import annotations

import torch

from pdcluster.runtime.engine.config import ModelConfig


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """x: [n, heads, D]; rotate channel i with channel i + D/2."""
    d = config.head_dim
    freqs = config.rope_theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    angle = positions.to(torch.float64)[:, None] * freqs[None, :]  # [n, D/2]
    cos, sin = angle.cos().to(x.dtype)[:, None, :], angle.sin().to(x.dtype)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def dense_logits(
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    token_ids: list[int],
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Logits at every position of `token_ids`: [n, vocab].

    kv_dtype: round K (after RoPE) and V through this dtype, as a KV cache
    of that dtype would.
    """
    t = {k: v.to(dtype) for k, v in tensors.items()}
    n, d = len(token_ids), config.head_dim
    nq, nkv = config.num_heads, config.num_kv_heads
    pos = torch.arange(n)
    x = t["model.embed_tokens.weight"][torch.tensor(token_ids)]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        h = _norm(x, t[p + "input_layernorm.weight"], config.rms_norm_eps)
        proj = {}
        for name in ("q", "k", "v"):
            y = h @ t[p + f"self_attn.{name}_proj.weight"].T
            if config.attention_bias:
                y = y + t[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y
        q = _rope(proj["q"].view(n, nq, d), pos, config)
        k = _rope(proj["k"].view(n, nkv, d), pos, config)
        v = proj["v"].view(n, nkv, d)
        if kv_dtype is not None:
            k, v = k.to(kv_dtype).to(dtype), v.to(kv_dtype).to(dtype)
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, nq * d)
        x = x + attn @ t[p + "self_attn.o_proj.weight"].T
        h = _norm(x, t[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        up = h @ t[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    head = t["model.embed_tokens.weight"] if config.tie_word_embeddings else t["lm_head.weight"]
    return _norm(x, t["model.norm.weight"], config.rms_norm_eps) @ head.T
