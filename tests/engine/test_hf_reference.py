"""Our model against Hugging Face transformers on the same random checkpoints,
in float64 and in bfloat16 (what a GPU serves by default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.forward_batch import build_forward_batch
from pdcluster.runtime.engine.sampling import SamplingParams
from tests.engine.testing import generate

PROMPT = [0, 5, 17, 99, 200, 3, 44, 12, 7, 150, 151, 152, 9, 2, 80, 31, 64]


def _transformers(directory: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).eval()


def _engine(directory: Path, dtype: str) -> LLMEngine:
    config = EngineConfig(
        model=str(directory), compute_dtype=dtype, kv_dtype=dtype, num_pages=32, page_size=4
    )
    return LLMEngine(config)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    # float64: transformers builds RoPE tables in float32 (~1e-7 relative);
    # bfloat16: a few units in the last place of the largest logits.
    [("float64", 1e-5), ("bfloat16", 2e-2)],
)
def test_prompt_logits_match_transformers(
    arch: str, dtype: str, tolerance: float, request: pytest.FixtureRequest
) -> None:
    directory: Path = request.getfixturevalue(f"{arch}_dir")
    reference = _transformers(directory, getattr(torch, dtype))
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0].double()  # [n, vocab]
    runner = _engine(directory, dtype).runner
    model = runner.model
    # Two chunks through scattered pages, as the engine prefills a long prompt.
    pages = [9, 3, 17, 0, 25]
    got = []
    for start, end in ((0, 7), (7, len(PROMPT))):
        batch = build_forward_batch([(PROMPT[start:end], start, pages)], 4)
        hidden = model.forward(batch, runner.pool, model.embed(batch.token_ids))
        got.append(model.logits(hidden).double())
    ours = torch.cat(got)
    scale = want.abs().max().item()
    assert (ours - want).abs().max().item() <= tolerance * scale
    agree = (ours.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= (1.0 if dtype == "float64" else 0.9)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_generation_matches_transformers_in_float64(
    arch: str, request: pytest.FixtureRequest
) -> None:
    directory: Path = request.getfixturevalue(f"{arch}_dir")
    reference = _transformers(directory, torch.float64)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    want = out[0, len(PROMPT) :].tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = generate(_engine(directory, "float64"), [EngineRequest("r", PROMPT, params)])
    assert got["r"][0] == want
