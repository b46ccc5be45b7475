"""Test helpers: random Hugging Face-style model directories, running requests
to completion, and the per-rank entry point of multi-process tests.

The directory holds config.json, safetensors weights (split over two files
so multi-file loading is exercised) and a tokenizer.json trained with the
`tokenizers` library, so tests load it through the same code path as a
downloaded model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pytest

from pdcluster.runtime.engine.config import from_hf_config
from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.scheduler import ScheduledBatch

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the prompt; decode generates one token at a time.",
    "Pages of the KV cache move from prefill to decode instances.",
    "Hello world! Bonjour le monde. Hallo Welt. こんにちは世界",
]


def _train_tokenizer(
    path: Path,
    vocab_size: int,
    specials: Sequence[str] = ("<s>", "</s>"),
    bos: str | None = "<s>",
) -> int:
    """Byte-level BPE with `specials` (the first ids); a prompt opens with `bos` when
    one is given. Returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    tok.save(str(path))
    size: int = tok.get_vocab_size(with_added_tokens=True)
    return size


# Chat formats written the way the two families' templates lay a conversation
# out: Llama 3 opens with BOS (its tokenizer also adds one to a plain prompt),
# Qwen2 has no BOS and adds a default system turn.
CHAT_STYLES: dict[str, dict[str, Any]] = {
    "llama3": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                     "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "template": (
            "{{ bos_token }}"
            "{% for turn in messages %}"
            "<|start_header_id|>{{ turn['role'] }}<|end_header_id|>\n\n"
            "{{ turn['content'] | trim }}<|eot_id|>"
            "{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}"
        ),
    },
    "qwen2": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "template": (
            "{% for turn in messages %}"
            "{% if loop.first and turn['role'] != 'system' %}"
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "{% endif %}"
            "<|im_start|>{{ turn['role'] }}\n{{ turn['content'] }}<|im_end|>\n"
            "{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    },
}  # fmt: skip


def write_chat_tokenizer(directory: str | Path, style: str) -> Path:
    """tokenizer.json and tokenizer_config.json (with its chat template) of one of
    `CHAT_STYLES`, loadable by transformers' AutoTokenizer too."""
    chat = CHAT_STYLES[style]
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(root / "tokenizer.json", 300, chat["specials"], chat["bos"])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": chat["bos"],
        "eos_token": chat["eos"],
        "chat_template": chat["template"],
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return root


def write_tokenizer_dir(directory: str | Path, vocab_size: int = 300) -> Path:
    """A directory holding only a trained tokenizer.json (a worker's `--tokenizer`)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(root / "tokenizer.json", vocab_size)
    return root


def write_random_hf_dir(
    directory: str | Path,
    arch: Literal["llama", "qwen2"] = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Create a random Llama- or Qwen2-architecture model directory and return its path.

    `extra` entries override config.json fields (e.g. rope_scaling).
    """
    import torch
    from safetensors.torch import save_file

    from pdcluster.runtime.engine.weights import tiny_tensors

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    vocab = _train_tokenizer(root / "tokenizer.json", vocab_size=300)
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0 if arch == "llama" else 1000000.0,
        "tie_word_embeddings": arch == "qwen2",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    raw.update(extra or {})
    (root / "config.json").write_text(json.dumps(raw, indent=2))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}, indent=2)
    )
    tensors = tiny_tensors(from_hf_config(raw), seed)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = {n: tensors[n].to(torch.float32).contiguous() for n in part}
        filename = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, str(root / filename))
        weight_map.update(dict.fromkeys(part, filename))
    # The index a sharded checkpoint ships with (transformers reads it; we glob).
    index = {"metadata": {}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return root


def generate(
    engine: LLMEngine, requests: Sequence[EngineRequest], max_steps: int = 100_000
) -> dict[str, tuple[list[int], str | None]]:
    """Add `requests`, step until the engine is idle; rid → (tokens, finish reason).

    Requests added to the engine earlier are collected too.
    """
    for req in requests:
        engine.add_request(req)
    out: dict[str, tuple[list[int], str | None]] = {r.rid: ([], None) for r in requests}
    for _ in range(max_steps):
        if not engine.has_work():
            return out
        for o in engine.step():
            tokens, _ = out.setdefault(o.rid, ([], None))
            tokens.extend(o.new_token_ids)
            out[o.rid] = (tokens, o.finish_reason if o.finished else None)
    raise RuntimeError(f"requests did not finish within {max_steps} steps")


def run_rank(
    rank: int,
    world_size: int,
    port: int,
    config: EngineConfig,
    requests_per_dp: Sequence[Sequence[EngineRequest]],
) -> dict[str, tuple[list[int], str | None]] | None:
    """One rank of a multi-process instance (a `spawn_ranks` target).

    Leaders generate their dp group's requests and return the results;
    followers serve plans until the leader shuts the group down.
    """
    from pdcluster.runtime.engine.parallel import init_distributed
    from pdcluster.runtime.engine.runner import ModelRunner, run_follower

    if world_size != config.parallel.world_size:
        raise ValueError(f"world size {world_size} != topology {config.parallel}")
    dist = init_distributed(config.parallel, rank, "127.0.0.1", port, config.device)
    try:
        runner = ModelRunner.build(config, dist)
        if not dist.info.is_leader:
            run_follower(runner)
            return None
        engine = LLMEngine(config, runner=runner, dist=dist)
        try:
            return generate(engine, requests_per_dp[dist.info.dp_rank])
        finally:
            engine.shutdown()
    finally:
        dist.close()


def sleep_rank(rank: int, world_size: int, port: int, seconds: float) -> int:
    """A `spawn_ranks` target that only sleeps (for timeout tests)."""
    import time

    time.sleep(seconds)
    return rank


def record_preemptions(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The rids the engine's scheduler preempts from now on, in order."""
    preempted: list[str] = []
    schedule = engine.scheduler.schedule

    def spy() -> ScheduledBatch:
        batch = schedule()
        preempted.extend(batch.preempted)
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    return preempted
