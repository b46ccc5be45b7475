"""Engine-level prefix cache: time to first token with the cache on vs off.

    .venv/bin/python bench/prefix_cache_engine.py --requests 16
    .venv/bin/python bench/prefix_cache_engine.py --requests 64 --device cuda

Workload (the shape of issue 15's, in one in-process engine, no PD, no
router): `--requests` prompts, each one of `--systems` distinct shared
prompts of `--system-tokens` tokens plus `--suffix-tokens` unique tokens,
sent one at a time (round robin over the system prompts), 1 new token
each. One engine with the cache on and one with it off take turns request
by request, so machine noise hits both alike. Prints TTFT p50 for each, the
ratio on/off, and the hit rate (hit tokens / lookup tokens).

Decode-side reuse and cache-aware routing are not part of this: see bench/prefix_cache.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import add_prefix_workload_args, round_robin_prompts  # noqa: E402

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.sampling import SamplingParams


def _ttft(engine: LLMEngine, rid: str, prompt: list[int], device: str) -> float:
    engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_prefix_workload_args(ap, requests=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rng = random.Random(0)
    prompts = round_robin_prompts(rng, args)
    base = EngineConfig(
        device=args.device,
        num_pages=1024,
        page_size=16,
        chunk_size=2048,
        max_prompt_tokens=4096,
    )
    engines = {
        "off": LLMEngine(base),
        "on": LLMEngine(dataclasses.replace(base, prefix_cache=True)),
    }
    # Untimed warm-up on an unrelated prompt.
    for name, engine in engines.items():
        _ttft(engine, f"warm-{name}", [rng.randrange(1, 256) for _ in range(64)], args.device)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for i, prompt in enumerate(prompts):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for name in order:
            times[name].append(_ttft(engines[name], f"r{i}", prompt, args.device))
    p50 = {name: statistics.median(ts) for name, ts in times.items()}
    stats = engines["on"].prefix_cache_stats()
    print(f"device={args.device} requests={args.requests} systems={args.systems} "
          f"system_tokens={args.system_tokens} suffix_tokens={args.suffix_tokens}")  # fmt: skip
    print("| cache | TTFT p50 (ms) |")
    print("|---|---|")
    for name in ("off", "on"):
        print(f"| {name} | {p50[name] * 1e3:.1f} |")
    print(f"ratio on/off: {p50['on'] / p50['off']:.3f}")
    print(f"hit rate: {stats.hit_tokens / max(1, stats.lookup_tokens):.3f} "
          f"({stats.hit_tokens} of {stats.lookup_tokens} tokens), "
          f"cached pages {stats.cached_pages}, evictions {stats.evicted_pages}")  # fmt: skip


if __name__ == "__main__":
    main()
