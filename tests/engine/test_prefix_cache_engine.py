"""The prefix cache wired into a real engine: greedy output with the cache on
equals output with it off, token for token, whatever the prompts share, with
chunked prefill, a small pool that forces evictions, and preemption; no page
leaks, and the counters say what was reused.

float64 everywhere: a cached prefix changes which tokens a step computes
together, and rounding must not flip a greedy token.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from prometheus_client import generate_latest
from pydantic import ValidationError

from pdcluster.runtime.engine.caching_allocator import CachingPageAllocator
from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig, engine_config_from_spec
from pdcluster.runtime.engine.kv_pool import slots_for_positions
from pdcluster.runtime.engine.page_allocator import PageAllocator
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.spec import PDCluster
from tests.engine.testing import generate, record_preemptions

PAGE = 4
OFF = EngineConfig(
    num_pages=64,
    page_size=PAGE,
    max_running_requests=8,
    max_batch_tokens=64,
    compute_dtype="float64",
    kv_dtype="float64",
)
ON = dataclasses.replace(OFF, prefix_cache=True)

_RNG = random.Random(5)
BASE = [_RNG.randrange(1, 256) for _ in range(22)]  # 5 full pages + 2 tokens
OTHER = [_RNG.randrange(1, 256) for _ in range(22)]


def _req(rid: str, prompt: list[int], max_tokens: int = 6, **kw: object) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(rid, list(prompt), params, **kw)  # type: ignore[arg-type]


def _one_by_one(engine: LLMEngine, reqs: list[EngineRequest]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in reqs:
        out.update({rid: toks for rid, (toks, _) in generate(engine, [r]).items()})
    return out


def _assert_no_leak(engine: LLMEngine) -> None:
    """Every page is free again; cached ones are evictable, referenced by nobody."""
    alloc = engine.allocator
    assert alloc.num_free == alloc.num_total
    assert isinstance(alloc, CachingPageAllocator)
    assert alloc.num_owned == 0
    assert alloc.num_evictable == alloc.num_cached


# (name, prompt, tokens the cache must serve) in order on one engine.
SHARING = [
    ("none", BASE, 0),
    ("all", BASE, 20),  # every full page but the one holding the last token's neighbours
    ("some", BASE[:12] + OTHER[:9], 12),  # 3 shared pages, then a different suffix
    ("unrelated", OTHER, 0),
    ("page-exact", BASE[:20], 16),  # 5 full pages: the last is recomputed to sample
    ("page-exact-again", BASE[:20], 16),
    ("longer", BASE + OTHER[:7], 20),  # extends a cached chain
    ("shorter", BASE[:3], 0),  # no full page
]


def test_prompts_sharing_no_some_or_all_pages_give_the_same_tokens_and_count_hits() -> None:
    reqs = [_req(name, prompt) for name, prompt, _ in SHARING]
    expected = _one_by_one(LLMEngine(OFF), reqs)
    engine = LLMEngine(ON)
    got: dict[str, list[int]] = {}
    for req, (name, _, hit) in zip(reqs, SHARING, strict=True):
        before = engine.prefix_cache_stats().hit_tokens
        got.update(_one_by_one(engine, [req]))
        assert engine.prefix_cache_stats().hit_tokens - before == hit, name
        _assert_no_leak(engine)
    assert got == expected
    stats = engine.prefix_cache_stats()
    assert stats.lookup_tokens == sum(len(p) for _, p, _ in SHARING)
    assert stats.hit_tokens == sum(h for _, _, h in SHARING)
    assert stats.cached_pages > 0 and stats.evicted_pages == 0


def test_a_hit_computes_only_the_uncached_suffix() -> None:
    engine = LLMEngine(dataclasses.replace(ON, chunk_size=8))
    generate(engine, [_req("warm", BASE)])
    seen: list[tuple[int, int]] = []
    engine.on_prefill_chunk = lambda rid, pages, start, end: seen.append((start, end))
    generate(engine, [_req("hit", BASE)])
    assert seen == [(20, 22)]  # the 5 cached pages are never recomputed


def test_chunked_prefill_with_a_batch_of_shared_prefixes_equals_the_cache_off_run() -> None:
    chunked = dataclasses.replace(OFF, chunk_size=5, max_batch_tokens=16, max_running_requests=3)
    rng = random.Random(9)
    prompts = [BASE[: rng.randrange(1, 22)] + OTHER[: rng.randrange(0, 12)] for _ in range(10)]
    reqs = [_req(f"r{i}", p, max_tokens=4 + i % 3) for i, p in enumerate(prompts)]
    warm = _req("warm", BASE, max_tokens=2)
    expected = generate(LLMEngine(chunked), [warm])
    expected.update(generate(LLMEngine(chunked), reqs))
    engine = LLMEngine(dataclasses.replace(chunked, prefix_cache=True))
    got = generate(engine, [warm])
    got.update(generate(engine, reqs))
    assert got == expected
    assert engine.prefix_cache_stats().hit_tokens > 0
    _assert_no_leak(engine)


def test_a_small_pool_evicts_cached_pages_and_outputs_stay_the_same() -> None:
    small = dataclasses.replace(ON, num_pages=12)  # one 22+6 token request needs 7 pages
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 256) for _ in range(22)] for _ in range(4)]
    reqs = [_req(f"p{i}", prompts[i % 4]) for i in range(10)]  # cycle: evicted before reuse
    reqs += [_req("again", prompts[3]), _req("again2", prompts[3])]
    expected = _one_by_one(LLMEngine(OFF), reqs)
    engine = LLMEngine(small)
    assert _one_by_one(engine, reqs) == expected
    stats = engine.prefix_cache_stats()
    assert stats.evicted_pages > 0
    assert stats.hit_tokens >= 20  # the last one reuses what the one before cached
    _assert_no_leak(engine)


def test_preemption_with_shared_cached_pages_recomputes_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reqs = [_req(f"r{i}", BASE[: 8 + 2 * i] + OTHER[:i], max_tokens=20) for i in range(6)]
    warm = _req("warm", BASE, max_tokens=1)
    expected = _one_by_one(LLMEngine(OFF), [warm])
    expected.update({rid: toks for rid, (toks, _) in generate(LLMEngine(OFF), reqs).items()})
    engine = LLMEngine(dataclasses.replace(ON, num_pages=20))
    preempted = record_preemptions(engine, monkeypatch)
    got = _one_by_one(engine, [warm])
    got.update({rid: toks for rid, (toks, _) in generate(engine, reqs).items()})
    assert preempted, "the pool was meant to be too small to run everything at once"
    assert got == expected
    assert engine.prefix_cache_stats().hit_tokens > 0
    _assert_no_leak(engine)


def test_an_abort_releases_cached_pages_without_freeing_them() -> None:
    engine = LLMEngine(ON)
    generate(engine, [_req("warm", BASE)])
    engine.add_request(_req("hit", BASE))
    engine.step()  # admitted: holds the cached pages
    alloc = engine.allocator
    assert isinstance(alloc, CachingPageAllocator)
    seq = engine.scheduler.get("hit")
    assert seq is not None
    shared = seq.page_table[:5]
    assert all(alloc.is_cached(p) and alloc.refcount(p) == 1 for p in shared)
    assert engine.abort("hit")
    assert all(alloc.is_cached(p) and alloc.refcount(p) == 0 for p in shared)
    _assert_no_leak(engine)
    # The next one finds them again.
    assert len(generate(engine, [_req("after", BASE)])["after"][0]) == 6
    assert engine.prefix_cache_stats().hit_tokens == 40


def test_prefill_only_holds_the_whole_prompts_kv_cached_pages_included() -> None:
    """PD prefill: the page table of a HELD sequence that hit the cache holds
    the same KV for every prompt token as a cache-off prefill computes."""
    prompt = BASE + OTHER[:5]

    def held_kv(engine: LLMEngine, rid: str) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        chunks: list[tuple[int, int]] = []
        engine.on_prefill_chunk = lambda r, pages, start, end: chunks.append((start, end))
        out = []
        engine.add_request(_req(rid, prompt, mode="prefill_only"))
        while engine.has_work():
            out.extend(engine.step())
        assert out[-1].finish_reason == "prefill_done"
        seq = engine.scheduler.get(rid)
        assert seq is not None
        pool = engine.runner.pool
        slots = slots_for_positions(seq.page_table, torch.arange(len(prompt)), PAGE)
        frame = pool.gather_tokens(range(pool.shape.num_layers), slots)
        engine.release(rid)
        return frame, chunks

    reference, _ = held_kv(LLMEngine(OFF), "ref")
    engine = LLMEngine(ON)
    generate(engine, [_req("warm", BASE)])
    frame, chunks = held_kv(engine, "room")
    # The transfer sends [0, end) once the first chunk reports end: cached
    # tokens are covered by the first report.
    assert chunks[0] == (20, len(prompt)) and chunks[-1][1] == len(prompt)
    # Batches of other shapes may round differently in the last bits.
    assert torch.allclose(frame, reference, rtol=0, atol=1e-9)
    _assert_no_leak(engine)


def test_with_the_flag_off_the_allocator_is_the_plain_one_and_counts_stay_zero() -> None:
    engine = LLMEngine(OFF)
    assert type(engine.allocator) is PageAllocator
    generate(engine, [_req("a", BASE), _req("b", BASE)])
    stats = engine.prefix_cache_stats()
    assert (stats.lookup_tokens, stats.hit_tokens, stats.cached_pages) == (0, 0, 0)


def test_worker_metrics_export_the_prefix_cache_counts() -> None:
    engine = LLMEngine(ON)
    generate(engine, [_req("a", BASE)])
    generate(engine, [_req("b", BASE)])
    metrics = WorkerMetrics("colocated")
    metrics.watch_prefix_cache(engine.prefix_cache_stats)
    text = generate_latest(metrics.registry).decode()
    assert "pdcluster_prefix_cache_hit_tokens_total 20.0" in text
    assert "pdcluster_prefix_cache_lookup_tokens_total 44.0" in text
    assert "pdcluster_prefix_cache_evictions_total 0.0" in text
    assert "pdcluster_prefix_cache_pages 5.0" in text


def _cluster(prefill_engine: object) -> PDCluster:
    return PDCluster.model_validate(
        {
            "apiVersion": "pdcluster.io/v1alpha1",
            "kind": "PDCluster",
            "metadata": {"name": "c"},
            "spec": {
                "model": {"name": "tiny"},
                "prefill": {"engine": prefill_engine},
                "decode": {},
            },
        }
    )


def test_the_manifest_flag_reaches_the_engine_config_and_defaults_to_on() -> None:
    spec = _cluster({"prefixCache": False}).spec
    assert spec.prefill is not None and spec.decode is not None
    assert engine_config_from_spec(spec, spec.prefill).prefix_cache is False
    assert engine_config_from_spec(spec, spec.decode).prefix_cache is True


def test_a_flag_that_is_not_a_boolean_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="prefixCache"):
        _cluster({"prefixCache": "sometimes"})
