"""Prefill and decode throughput of the reference engine (tiny model by default).

    .venv/bin/python bench/engine.py                      # CPU, the table in docs/benchmarks.md
    .venv/bin/python bench/engine.py --device cuda --batch 1 16 64

For each (batch, prompt length): `batch` requests with distinct prompts go in
at once; the steps until every request has its first token are *prefill*
(tokens/s = batch × prompt length / time), the following `--decode-steps`
steps are *decode* (tokens/s = batch × steps / time). Greedy, ignore_eos, so
every request runs the same number of steps. One untimed warm-up round runs
first. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import torch

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.spec import pages_for


@dataclasses.dataclass(frozen=True)
class Result:
    batch: int
    prompt_len: int
    prefill_tok_s: float
    decode_tok_s: float
    decode_ms_per_step: float


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_case(config: EngineConfig, batch: int, prompt_len: int, decode_steps: int) -> Result:
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [(i * 7919 + j * 31) % min(vocab, 256) for j in range(prompt_len)]
        params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    started: set[str] = set()
    _sync(config.device)
    t0 = time.perf_counter()
    while len(started) < batch:
        started.update(o.rid for o in engine.step() if o.new_token_ids)
    _sync(config.device)
    t1 = time.perf_counter()
    for _ in range(decode_steps):
        engine.step()
    _sync(config.device)
    t2 = time.perf_counter()
    assert not engine.has_work() or all(o.finished for o in engine.step())
    return Result(
        batch=batch,
        prompt_len=prompt_len,
        prefill_tok_s=batch * prompt_len / (t1 - t0),
        decode_tok_s=batch * decode_steps / (t2 - t1),
        decode_ms_per_step=1000 * (t2 - t1) / decode_steps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="compute and KV dtype")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    longest = max(args.prompt_len) + args.decode_steps + 1
    biggest = max(args.batch)
    pages = biggest * pages_for(longest, args.page_size) + 8
    config = EngineConfig(
        model=args.model,
        device=args.device,
        compute_dtype=args.dtype,
        kv_dtype=args.dtype,
        page_size=args.page_size,
        num_pages=pages,
        max_running_requests=biggest,
        max_batch_tokens=max(biggest * max(args.prompt_len), biggest),
        chunk_size=max(args.prompt_len),
        max_prompt_tokens=max(args.prompt_len),
        max_new_tokens=args.decode_steps + 1,
    )
    run_case(config, 1, min(args.prompt_len), 4)  # warm-up: lazy init, allocator caches

    device = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
    )
    print(
        f"model={args.model} device={args.device} ({device or 'cpu'}) dtype={args.dtype} "
        f"threads={torch.get_num_threads()} page_size={args.page_size} "
        f"decode_steps={args.decode_steps} torch={torch.__version__}"
    )
    print()
    print("| batch | prompt len | prefill tok/s | decode tok/s | decode ms/step |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batch:
        for prompt_len in args.prompt_len:
            r = run_case(config, batch, prompt_len, args.decode_steps)
            print(
                f"| {r.batch} | {r.prompt_len} | {r.prefill_tok_s:,.0f} | "
                f"{r.decode_tok_s:,.0f} | {r.decode_ms_per_step:.2f} |"
            )


if __name__ == "__main__":
    main()
