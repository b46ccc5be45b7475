"""Colocated reference outputs, computed in-process with the same engine settings."""

from __future__ import annotations

from dataclasses import replace

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import engine_config_from_spec
from pdcluster.runtime.engine.pool_sizing import DEFAULT_CPU_PAGES
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.topology import ParallelConfig
from pdcluster.runtime.spec import PDCluster

_CACHE: dict[tuple[object, ...], list[list[int]]] = {}


def colocated_outputs(
    cluster: PDCluster, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy outputs of a single-rank colocated engine for each prompt (cached per settings)."""
    spec = cluster.spec
    key = (
        spec.model,
        spec.kv_dtype,
        spec.kv_cache.page_size,
        max_tokens,
        tuple(tuple(p) for p in prompts),
    )
    if key not in _CACHE:
        _CACHE[key] = _compute(cluster, prompts, max_tokens)
    return _CACHE[key]


def _compute(cluster: PDCluster, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    spec = cluster.spec
    role = spec.decode or spec.colocated
    assert role is not None
    cfg = engine_config_from_spec(spec, role)
    need = sum(-(-(len(p) + max_tokens) // cfg.page_size) for p in prompts)
    pages = max(cfg.num_pages or DEFAULT_CPU_PAGES, need + 8)
    cfg = replace(cfg, parallel=ParallelConfig(), num_pages=pages)
    return greedy_outputs(LLMEngine(cfg), prompts, max_tokens)


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Run every prompt on `engine` at temperature 0 to exactly `max_tokens` tokens and
    return each prompt's generated tokens, in prompt order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"ref-{i}", list(p), params))
    out: dict[str, list[int]] = {f"ref-{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.rid].extend(o.new_token_ids)
    return [out[f"ref-{i}"] for i in range(len(prompts))]
