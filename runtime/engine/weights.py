"""Model weights: seeded `tiny` weights, safetensors loading, TP/PP sharding.

Both sources use Hugging Face Llama/Qwen2 tensor names, so the built-in
model and a model directory go through the same sharding code.

Sharding (Megatron-style):
- q/k/v and gate/up are column-parallel: rank r keeps its slice of heads
  (resp. intermediate channels); o and down are row-parallel: rank r keeps
  the matching input columns, and the partial outputs are summed by an
  all-reduce in the model;
- embedding, final norm and lm_head are replicated (the vocabularies here
  are small enough that splitting them would cost more than it saves);
- pipeline stages hold a contiguous layer range; the embedding lives on the
  first stage, the final norm and lm_head on the last.

A directory's tensors are read slice by slice (safetensors `get_slice`), so a
rank never materialises the weights of heads or layers it does not own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pdcluster.runtime.engine.config import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    ModelConfig,
    from_hf_config,
    tiny_config,
)

TINY_SEED = 0


class WeightsError(ValueError):
    """Weights are missing, mis-shaped or cannot be split as asked."""


@dataclass(frozen=True)
class ShardSpec:
    """Which part of the model one rank holds."""

    tp_size: int = 1
    tp_rank: int = 0
    layer_start: int = 0
    layer_end: int | None = None  # None: through the last layer

    def layers(self, num_layers: int) -> range:
        end = num_layers if self.layer_end is None else self.layer_end
        return range(self.layer_start, end)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(q_heads + 2 * kv_heads) * head_dim, hidden], local heads
    qkv_bias: torch.Tensor | None  # [(q_heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor  # [hidden, q_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate_local, hidden]
    down: torch.Tensor  # [hidden, intermediate_local]


@dataclass
class ShardWeights:
    """The tensors of one rank: its layers, its heads, and the ends it owns."""

    config: ModelConfig
    shard: ShardSpec
    num_q_heads: int  # local
    num_kv_heads: int  # local
    layers: list[LayerWeights]
    embed: torch.Tensor | None  # [vocab, hidden], first stage only
    norm: torch.Tensor | None  # [hidden], last stage only
    lm_head: torch.Tensor | None  # [vocab, hidden], last stage only

    @property
    def layer_range(self) -> range:
        return self.shard.layers(self.config.num_layers)


class TensorSource(Protocol):
    def has(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def rows(self, name: str, start: int, end: int) -> torch.Tensor: ...

    def cols(self, name: str, start: int, end: int) -> torch.Tensor: ...


class DictSource:
    """Full tensors held in memory (the tiny model)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._t = tensors

    def has(self, name: str) -> bool:
        return name in self._t

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._t[name].shape)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._t[name][start:end]

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._t[name][:, start:end]


class SafetensorsSource:
    """Tensors of a model directory, read lazily slice by slice."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"{directory} holds no *.safetensors file")
        self._handles: dict[str, Any] = {}
        for path in files:
            handle = safe_open(str(path), framework="pt")
            for key in handle.keys():  # type: ignore[no-untyped-call,unused-ignore]
                self._handles[key] = handle

    def has(self, name: str) -> bool:
        return name in self._handles

    def _slice(self, name: str) -> Any:
        if name not in self._handles:
            raise WeightsError(f"tensor {name!r} is missing from the model directory")
        return self._handles[name].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        tensor: torch.Tensor = self._slice(name)[start:end]
        return tensor

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        tensor: torch.Tensor = self._slice(name)[:, start:end]
        return tensor


def tiny_tensors(
    config: ModelConfig | None = None, seed: int = TINY_SEED
) -> dict[str, torch.Tensor]:
    """Weights of the tiny model under Hugging Face names, from a fixed seed.

    Drawn in one fixed order in float32 so every process and every run gets the
    same bits. Scales are chosen so logits are far from flat and attention
    mixes the context (different prompts → different continuations).
    """
    cfg = config or tiny_config()
    gen = torch.Generator().manual_seed(seed)
    h, d = cfg.hidden_size, cfg.head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(h, std=0.1)

    # Tied embeddings double as the output head: smaller rows keep the current
    # token from dominating its own logits (which would make the model repeat it).
    embed_std = h**-0.5 if cfg.tie_word_embeddings else 1.0
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(cfg.vocab_size, h, std=embed_std)
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm_weight()
        out[p + "self_attn.q_proj.weight"] = normal(cfg.num_heads * d, h, std=h**-0.5 * 2.0)
        out[p + "self_attn.k_proj.weight"] = normal(cfg.num_kv_heads * d, h, std=h**-0.5 * 2.0)
        out[p + "self_attn.v_proj.weight"] = normal(cfg.num_kv_heads * d, h, std=h**-0.5)
        out[p + "self_attn.o_proj.weight"] = normal(h, cfg.num_heads * d, std=(cfg.q_size) ** -0.5)
        if cfg.attention_bias:
            for name, rows in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size)):
                out[p + f"self_attn.{name}_proj.bias"] = normal(rows, std=0.1)
        out[p + "post_attention_layernorm.weight"] = norm_weight()
        out[p + "mlp.gate_proj.weight"] = normal(cfg.intermediate_size, h, std=h**-0.5)
        out[p + "mlp.up_proj.weight"] = normal(cfg.intermediate_size, h, std=h**-0.5)
        out[p + "mlp.down_proj.weight"] = normal(
            h, cfg.intermediate_size, std=cfg.intermediate_size**-0.5
        )
    out["model.norm.weight"] = norm_weight()
    if not cfg.tie_word_embeddings:
        head = normal(cfg.vocab_size, h, std=h**-0.5 * 4.0)
        if cfg.architecture == "tiny":
            # The built-in vocabulary: only bytes and EOS are ever generated;
            # BOS and the padding ids get zero logits, which never win.
            head[TINY_EOS_ID + 1 :] = 0.0
            head[TINY_BOS_ID] = 0.0
            # Only printable ASCII (and newline) is generated, so the demo's
            # text is readable and never splits a UTF-8 character.
            printable = [10, *range(32, 127)]
            keep = torch.zeros(256, dtype=torch.bool)
            keep[printable] = True
            head[:256][~keep] = 0.0
            # A damped EOS row: sequences do end, but rarely after one token.
            head[TINY_EOS_ID] *= 0.9
        out["lm_head.weight"] = head
    return out


def _split(total: int, parts: int, index: int, what: str) -> tuple[int, int]:
    if total % parts:
        raise WeightsError(f"{what} ({total}) is not divisible by tp size {parts}")
    size = total // parts
    return index * size, (index + 1) * size


def check_shard(config: ModelConfig, shard: ShardSpec) -> None:
    """Raise WeightsError naming the problem when `shard` cannot be cut from `config`."""
    if shard.tp_size < 1 or not 0 <= shard.tp_rank < shard.tp_size:
        raise WeightsError(f"tp rank {shard.tp_rank} is outside tp size {shard.tp_size}")
    for total, what in (
        (config.num_heads, "num_heads"),
        (config.num_kv_heads, "num_kv_heads"),
        (config.intermediate_size, "intermediate_size"),
    ):
        if total % shard.tp_size:
            raise WeightsError(
                f"{what} ({total}) is not divisible by tp size {shard.tp_size}; "
                "choose a tp that divides the model's heads"
            )
    layers = shard.layers(config.num_layers)
    if not 0 <= layers.start < layers.stop <= config.num_layers:
        raise WeightsError(
            f"layer range [{layers.start}, {layers.stop}) is not a non-empty part of "
            f"[0, {config.num_layers})"
        )


def build_shard(
    config: ModelConfig,
    source: TensorSource,
    shard: ShardSpec = ShardSpec(),
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> ShardWeights:
    """Cut one rank's weights out of `source` (Hugging Face names)."""
    check_shard(config, shard)
    d = config.head_dim
    q0, q1 = _split(config.num_heads, shard.tp_size, shard.tp_rank, "num_heads")
    k0, k1 = _split(config.num_kv_heads, shard.tp_size, shard.tp_rank, "num_kv_heads")
    i0, i1 = _split(config.intermediate_size, shard.tp_size, shard.tp_rank, "intermediate_size")

    def fetch(name: str, full: tuple[int, ...], part: slice, dim: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) `part` of tensor `name`, shape-checked."""
        if not source.has(name):
            raise WeightsError(f"tensor {name!r} is missing")
        if source.shape(name) != full:
            raise WeightsError(f"tensor {name!r} has shape {source.shape(name)}, expected {full}")
        start, stop = part.start or 0, full[dim] if part.stop is None else part.stop
        t = source.rows(name, start, stop) if dim == 0 else source.cols(name, start, stop)
        return t.to(device=device, dtype=dtype).contiguous()

    h = config.hidden_size
    everything = slice(None)

    def whole(name: str, full: tuple[int, ...]) -> torch.Tensor:
        return fetch(name, full, everything, 0)

    layers: list[LayerWeights] = []
    for i in shard.layers(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        q_part, kv_part = slice(q0 * d, q1 * d), slice(k0 * d, k1 * d)
        qkv = torch.cat(
            [
                fetch(a + "q_proj.weight", (config.q_size, h), q_part, 0),
                fetch(a + "k_proj.weight", (config.kv_size, h), kv_part, 0),
                fetch(a + "v_proj.weight", (config.kv_size, h), kv_part, 0),
            ]
        )  # [(q_local + 2 * kv_local) * head_dim, hidden]
        bias = None
        if config.attention_bias:
            bias = torch.cat(
                [
                    fetch(a + "q_proj.bias", (config.q_size,), q_part, 0),
                    fetch(a + "k_proj.bias", (config.kv_size,), kv_part, 0),
                    fetch(a + "v_proj.bias", (config.kv_size,), kv_part, 0),
                ]
            )
        inter = slice(i0, i1)
        m = p + "mlp."
        layers.append(
            LayerWeights(
                input_norm=whole(p + "input_layernorm.weight", (h,)),
                qkv=qkv,
                qkv_bias=bias,
                o=fetch(a + "o_proj.weight", (h, config.q_size), q_part, 1),
                post_norm=whole(p + "post_attention_layernorm.weight", (h,)),
                gate_up=torch.cat(
                    [
                        fetch(m + "gate_proj.weight", (config.intermediate_size, h), inter, 0),
                        fetch(m + "up_proj.weight", (config.intermediate_size, h), inter, 0),
                    ]
                ),
                down=fetch(m + "down_proj.weight", (h, config.intermediate_size), inter, 1),
            )
        )
    span = shard.layers(config.num_layers)
    first, last = span.start == 0, span.stop == config.num_layers
    embed_shape = (config.vocab_size, h)
    embed = whole("model.embed_tokens.weight", embed_shape) if first else None
    norm = lm_head = None
    if last:
        norm = whole("model.norm.weight", (h,))
        if config.tie_word_embeddings:
            lm_head = (
                embed if embed is not None else whole("model.embed_tokens.weight", embed_shape)
            )
        else:
            lm_head = whole("lm_head.weight", embed_shape)
    return ShardWeights(
        config=config,
        shard=shard,
        num_q_heads=(q1 - q0),
        num_kv_heads=(k1 - k0),
        layers=layers,
        embed=embed,
        norm=norm,
        lm_head=lm_head,
    )


def load_hf_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise WeightsError(f"{path} does not exist (a model directory needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise WeightsError(f"{path} is not valid JSON: {err}") from None
    return from_hf_config(raw)


def load_hf_dir(
    directory: str | Path,
    shard: ShardSpec = ShardSpec(),
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> ShardWeights:
    """Load one rank's shard of a Llama/Qwen2 model directory."""
    root = Path(directory)
    if not root.is_dir():
        raise WeightsError(f"model directory {root} does not exist")
    config = load_hf_config(root)
    return build_shard(config, SafetensorsSource(root), shard, dtype, device)


def load_tiny(
    shard: ShardSpec = ShardSpec(),
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = TINY_SEED,
) -> ShardWeights:
    config = tiny_config()
    return build_shard(config, DictSource(tiny_tensors(config, seed)), shard, dtype, device)


def load_model(
    model: str,
    shard: ShardSpec = ShardSpec(),
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = TINY_SEED,
) -> ShardWeights:
    """`"tiny"` → the built-in model; otherwise a local model directory."""
    if model == "tiny":
        return load_tiny(shard, dtype, device, seed)
    return load_hf_dir(model, shard, dtype, device)


def model_config(model: str) -> ModelConfig:
    return tiny_config() if model == "tiny" else load_hf_config(model)
