"""Architecture numbers of a Llama-family decoder, and the built-in `tiny` model.

Pure module: no torch, no I/O. `from_hf_config` takes an already-decoded
config.json mapping so loaders stay at the edge.

Invariants (checked in `ModelConfig.__post_init__`):
- num_heads is a multiple of num_kv_heads (grouped-query attention);
- head_dim is even (RoPE rotates pairs of channels);
- bos/eos ids lie inside the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Byte-level vocabulary of the tiny model: ids 0..255 are bytes, then specials.
TINY_BOS_ID = 256
TINY_EOS_ID = 257
TINY_VOCAB_SIZE = 320  # 256 bytes + BOS + EOS, padded to a multiple of 64


class ConfigError(ValueError):
    """A model configuration is unusable; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of RoPE, as Hugging Face configs describe it.

    kind "linear": positions are divided by `factor`.
    kind "llama3": long wavelengths are divided by `factor`, short ones kept,
    the band between interpolated (the Llama 3.1 scheme).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Qwen2 puts a bias on q/k/v projections (never on o).
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    # Extra end-of-sequence ids (e.g. Llama 3 instruct's <|eot_id|>).
    extra_eos_token_ids: tuple[int, ...] = field(default=())
    architecture: str = "llama"

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(
                    f"{name} {value} is outside the vocabulary [0, {self.vocab_size})"
                )
        for value in self.extra_eos_token_ids:
            if not 0 <= value < self.vocab_size:
                raise ConfigError(
                    f"eos_token_id {value} is outside the vocabulary [0, {self.vocab_size})"
                )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence (primary first)."""
        primary = () if self.eos_token_id is None else (self.eos_token_id,)
        return primary + tuple(i for i in self.extra_eos_token_ids if i not in primary)


def tiny_config() -> ModelConfig:
    """The built-in model: byte-level vocabulary, weights from a fixed seed.

    8 query heads over 4 KV heads so tp in {1, 2, 4} divides; 4 layers so
    pp in {1, 2, 4} splits evenly.
    """
    return ModelConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
        bos_token_id=TINY_BOS_ID,
        eos_token_id=TINY_EOS_ID,
        architecture="tiny",
    )


_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


def _require(raw: Mapping[str, Any], key: str) -> Any:
    if key not in raw:
        raise ConfigError(f"config.json lacks {key!r}")
    return raw[key]


def _int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default) if default is not None else _require(raw, key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config.json {key!r} must be an integer, got {value!r}")
    return value


def _rope_scaling(raw: Mapping[str, Any]) -> RopeScaling | None:
    scaling = raw.get("rope_scaling")
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ConfigError(f"config.json 'rope_scaling' must be a mapping, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise ConfigError(
            f"config.json rope_scaling type {kind!r} is not supported (supported: linear, llama3)"
        )
    factor = float(scaling.get("factor", 1.0))
    if factor <= 0:
        raise ConfigError(f"config.json rope_scaling factor must be positive, got {factor}")
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    return RopeScaling(
        kind="llama3",
        factor=factor,
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def from_hf_config(raw: Mapping[str, Any]) -> ModelConfig:
    """Translate a Llama/Qwen2 config.json (already decoded) into a ModelConfig."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        model_type = raw.get("model_type")
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}.get(str(model_type))
        if arch is None:
            raise ConfigError(
                f"config.json names no supported architecture (architectures={archs!r}, "
                f"model_type={model_type!r}); supported: {sorted(_ARCHITECTURES)}"
            )
    else:
        arch_name = archs[0]
        if arch_name not in _ARCHITECTURES:
            raise ConfigError(
                f"architecture {arch_name!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
            )
        arch = _ARCHITECTURES[arch_name]
    hidden = _int(raw, "hidden_size")
    num_heads = _int(raw, "num_attention_heads")
    num_kv_heads = _int(raw, "num_key_value_heads", num_heads)
    head_dim_raw = raw.get("head_dim")
    head_dim = int(head_dim_raw) if head_dim_raw is not None else hidden // num_heads
    eos_raw = raw.get("eos_token_id")
    eos_ids: list[int]
    if eos_raw is None:
        eos_ids = []
    elif isinstance(eos_raw, list):
        eos_ids = [int(i) for i in eos_raw]
    else:
        eos_ids = [int(eos_raw)]
    bos_raw = raw.get("bos_token_id")
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if window is not None:
        raise ConfigError("sliding-window attention (use_sliding_window: true) is not supported")
    return ModelConfig(
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"),
        num_layers=_int(raw, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_int(raw, "max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=None if bos_raw is None else int(bos_raw),
        eos_token_id=eos_ids[0] if eos_ids else None,
        extra_eos_token_ids=tuple(eos_ids[1:]),
        # Qwen2 always carries q/k/v biases; Llama only when it says so.
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        rope_scaling=_rope_scaling(raw),
        architecture=arch,
    )
