"""Model configs, weight loading and sharding; HF directories round trip."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdcluster.runtime.engine.config import ConfigError, from_hf_config, tiny_config
from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.tokenizer import load_tokenizer
from pdcluster.runtime.engine.weights import (
    DictSource,
    ShardSpec,
    WeightsError,
    build_shard,
    load_hf_dir,
    load_tiny,
    tiny_tensors,
)
from tests.engine.testing import generate

LLAMA_RAW = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "eos_token_id": [5, 7],
    "bos_token_id": 1,
}


def test_tiny_config_splits_for_tp_and_pp_up_to_four() -> None:
    cfg = tiny_config()
    assert cfg.vocab_size >= 258 and cfg.max_position_embeddings >= 8192
    for n in (1, 2, 4):
        assert cfg.num_kv_heads % n == 0 and cfg.num_heads % n == 0 and cfg.num_layers % n == 0


def test_hf_config_translation() -> None:
    cfg = from_hf_config(LLAMA_RAW)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.attention_bias) == (16, 2, False)
    assert cfg.eos_token_id == 5 and cfg.eos_token_ids == (5, 7)
    qwen = from_hf_config({**LLAMA_RAW, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen.attention_bias and qwen.architecture == "qwen2"
    scaled = from_hf_config({**LLAMA_RAW, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert scaled.rope_scaling is not None and scaled.rope_scaling.factor == 8.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"architectures": [], "model_type": "bert"}, "no supported architecture"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"eos_token_id": 5000}, "outside the vocabulary"),
        ({"rope_scaling": {"type": "yarn", "factor": 4}}, "yarn"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "sliding-window"),
    ],
)
def test_bad_hf_configs_are_refused_by_name(change: dict[str, object], message: str) -> None:
    raw = {**LLAMA_RAW, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        from_hf_config(raw)


def test_tiny_weights_are_the_same_every_time_and_depend_on_the_seed() -> None:
    a, b, c = tiny_tensors(), tiny_tensors(), tiny_tensors(seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"]
    )


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_reassemble_the_full_projections(tp: int) -> None:
    full = load_tiny(ShardSpec(), torch.float64)
    shards = [load_tiny(ShardSpec(tp_size=tp, tp_rank=r), torch.float64) for r in range(tp)]
    cfg, d = full.config, full.config.head_dim
    q, kv = cfg.q_size // tp, cfg.kv_size // tp
    for i, layer in enumerate(full.layers):
        parts = [s.layers[i] for s in shards]
        assert torch.equal(torch.cat([p.qkv[:q] for p in parts]), layer.qkv[: cfg.q_size])
        assert torch.equal(
            torch.cat([p.qkv[q + kv :] for p in parts]), layer.qkv[cfg.q_size + cfg.kv_size :]
        )
        assert torch.equal(torch.cat([p.o for p in parts], dim=1), layer.o)
        assert torch.equal(torch.cat([p.down for p in parts], dim=1), layer.down)
    assert all(s.num_kv_heads == cfg.num_kv_heads // tp for s in shards) and d == 32


def test_pp_stages_hold_their_layers_and_ends() -> None:
    first = load_tiny(ShardSpec(layer_start=0, layer_end=2))
    last = load_tiny(ShardSpec(layer_start=2, layer_end=4))
    assert len(first.layers) == len(last.layers) == 2
    assert first.embed is not None and first.lm_head is None and first.norm is None
    assert last.embed is None and last.lm_head is not None and last.norm is not None


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        (ShardSpec(tp_size=3), "num_heads \\(8\\) is not divisible by tp size 3"),
        (ShardSpec(tp_size=8), "num_kv_heads \\(4\\) is not divisible by tp size 8"),
        (ShardSpec(tp_size=2, tp_rank=2), "outside tp size"),
        (ShardSpec(layer_start=3, layer_end=3), "layer range"),
        (ShardSpec(layer_start=0, layer_end=9), "layer range"),
    ],
)
def test_impossible_shards_are_refused(shard: ShardSpec, message: str) -> None:
    with pytest.raises(WeightsError, match=message):
        load_tiny(shard)


def _greedy(model: str, prompts: list[list[int]], **config: Any) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=model, num_pages=64, page_size=8, **config))
    reqs = [
        EngineRequest(f"r{i}", p, SamplingParams(max_tokens=8, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    out = generate(engine, reqs)
    return [out[f"r{i}"][0] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_directory_loads_and_generates(arch: str, request: pytest.FixtureRequest) -> None:
    directory: Path = request.getfixturevalue(f"{arch}_dir")
    weights = load_hf_dir(directory)
    assert weights.config.architecture == arch
    assert (weights.layers[0].qkv_bias is not None) == (arch == "qwen2")
    assert (weights.lm_head is weights.embed) == (arch == "qwen2")  # Qwen2 dir ties them
    tok = load_tokenizer(directory)
    prompts = [tok.encode("Hello world"), tok.encode("Prefill computes the prompt")]
    first = _greedy(str(directory), prompts)
    assert first == _greedy(str(directory), prompts)
    assert first[0] != first[1]
    assert all(0 <= t < weights.config.vocab_size for t in first[0])


def test_hf_directory_matches_the_same_tensors_held_in_memory(llama_dir: Path) -> None:
    """The safetensors path and the in-memory path cut identical shards."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(llama_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    cfg = json.loads((llama_dir / "config.json").read_text())
    shard = ShardSpec(tp_size=2, tp_rank=1, layer_start=1, layer_end=2)
    from_disk = load_hf_dir(llama_dir, shard)
    in_memory = build_shard(from_hf_config(cfg), DictSource(tensors), shard)
    for a, b in zip(from_disk.layers, in_memory.layers, strict=True):
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name), getattr(b, field.name)
            assert (x is None and y is None) or torch.equal(x, y)


def test_broken_directories_fail_with_the_reason(llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(WeightsError, match="config.json"):
        load_hf_dir(broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(WeightsError, match="not valid JSON"):
        load_hf_dir(broken)
    (broken / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        load_hf_dir(broken)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(llama_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    missing = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
    save_file(missing, str(broken / "model.safetensors"))
    with pytest.raises(WeightsError, match="layers.1.mlp.up_proj.weight.*missing"):
        load_hf_dir(broken)
    wrong = dict(tensors)
    wrong["model.norm.weight"] = torch.ones(3)
    save_file(wrong, str(broken / "model.safetensors"))
    with pytest.raises(WeightsError, match="model.norm.weight.*shape"):
        load_hf_dir(broken)
    with pytest.raises(WeightsError, match="does not exist"):
        load_hf_dir(tmp_path / "nowhere")
