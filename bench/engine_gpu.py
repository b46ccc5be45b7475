"""Our engine alone on a GPU: decode tokens/s and the memory of a mixed-length step.

    .venv/bin/python bench/engine_gpu.py                        # ~1B Llama, bfloat16, cuda
    .venv/bin/python bench/engine_gpu.py --device cpu --preset small --batch 1 4  # smoke run

The model is a random-weight Llama directory shaped like Llama 3.2 1B
(hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, 128,256-token
vocabulary: 1.24B parameters), written once per run, served in bfloat16
(compute and KV, the GPU default). Decode tokens/s as in
`bench/engine_vs_vllm.py`: the time of a `--new-tokens` generation minus a
one-token one, batch × (new tokens − 1) / difference, median of
`--repeats`, for each batch size, temperature 0 and 1.0, with decode CUDA
graphs on and off. Then the peak device memory of one decode step of one
8k-token and fifteen 64-token sequences, next to what copying their K/V
padded to the longest (the engine before) would have allocated for one layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine  # noqa: E402
from pdcluster.runtime.engine.engine_config import EngineConfig  # noqa: E402
from pdcluster.runtime.engine.sampling import SamplingParams  # noqa: E402
from pdcluster.runtime.spec import pages_for  # noqa: E402

_FINISHED = SimpleNamespace(output_token_ids=[0])  # a request no longer in the scheduler

PRESETS = {
    # Llama 3.2 1B's shape.
    "1b": {
        "num_layers": 16,
        "hidden_size": 2048,
        "num_heads": 32,
        "num_kv_heads": 8,
        "intermediate_size": 8192,
        "vocab": 128_256,
    },
    "small": {
        "num_layers": 2,
        "hidden_size": 256,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 512,
        "vocab": 4096,
    },
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _write_model(directory: Path, preset: str) -> None:
    from tests.engine.testing import write_random_hf_dir

    shape = dict(PRESETS[preset])
    vocab = shape.pop("vocab")
    extra = {"vocab_size": vocab, "max_position_embeddings": 16384}
    write_random_hf_dir(directory, "llama", seed=0, extra=extra, **shape)


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    rids = set()
    for p in prompts:
        rid = f"r{time.monotonic_ns()}-{len(rids)}"
        rids.add(rid)
        engine.add_request(EngineRequest(rid, list(p), params))
    while rids:
        for out in engine.step():
            if out.finished:
                rids.discard(out.rid)


def decode_tok_s(
    engine: LLMEngine, batch: int, temperature: float, args: argparse.Namespace
) -> float:
    vocab = engine.model_config.vocab_size
    prompts = [
        [(i * 7919 + j * 31) % (vocab - 3) + 3 for j in range(args.prompt_len)]
        for i in range(batch)
    ]
    speeds = []
    for _ in range(args.repeats):
        _sync(args.device)
        t0 = time.perf_counter()
        _run(engine, prompts, 1, temperature)
        _sync(args.device)
        t1 = time.perf_counter()
        _run(engine, prompts, args.new_tokens, temperature)
        _sync(args.device)
        t2 = time.perf_counter()
        speeds.append(batch * (args.new_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
    return statistics.median(speeds)


def mixed_step_peak(engine: LLMEngine, device: str) -> tuple[int, int]:
    """(peak bytes of a decode step of one 8k and fifteen 64-token sequences, bytes
    one layer's K/V copy padded to 8k would take)."""
    vocab = engine.model_config.vocab_size
    lengths = [8191] + [63] * 15
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for i, n in enumerate(lengths):
        prompt = [3 + (i + j) % (vocab - 3) for j in range(n)]
        engine.add_request(EngineRequest(f"m{i}", prompt, params))
    # The short ones decode while the long one prefills in chunks; once it has
    # its first token, the next step decodes all sixteen.
    while not (engine.scheduler.get("m0") or _FINISHED).output_token_ids:
        engine.step()
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine.step()
    _sync(device)
    peak = torch.cuda.max_memory_allocated() - base
    while engine.has_work():
        engine.step()
    shape = engine.runner.pool.shape
    itemsize = engine.runner.pool.buffer.element_size()
    padded = len(lengths) * 8192 * 2 * shape.num_kv_heads * shape.head_dim * itemsize
    return peak, padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="engine-gpu-") as tmp:
        started = time.monotonic()
        _write_model(Path(tmp) / "model", args.preset)
        print(f"model written in {time.monotonic() - started:.0f} s", flush=True)
        biggest = max(args.batch)
        longest = args.prompt_len + args.new_tokens
        base = EngineConfig(
            model=str(Path(tmp) / "model"),
            device=args.device,
            compute_dtype=args.dtype,
            kv_dtype=args.dtype,
            num_pages=max(biggest * pages_for(longest, 16), 16 * pages_for(8192, 16)) + 64,
            max_running_requests=max(biggest, 16),
            max_batch_tokens=max(biggest * args.prompt_len, 2048),
            chunk_size=2048,
            max_prompt_tokens=8192,
            max_new_tokens=args.new_tokens,
        )
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        print(f"{name} | torch {torch.__version__} | {args.preset} {args.dtype}", flush=True)
        print()
        print("| batch | T | graphs | decode tok/s |")
        print("| ---: | ---: | :---: | ---: |")
        for graphs in (True, False):
            engine = LLMEngine(dataclasses.replace(base, cuda_graphs=graphs))
            active = engine.runner.graphs is not None
            _run(engine, [[5] * 16], 4, 1.0)  # warm-up
            for batch in args.batch:
                for temperature in (0.0, 1.0):
                    speed = decode_tok_s(engine, batch, temperature, args)
                    state = "on" if active else "off"
                    print(f"| {batch} | {temperature:g} | {state} | {speed:,.0f} |")
            if graphs and args.device.startswith("cuda"):
                peak, padded = mixed_step_peak(engine, args.device)
                mixed = (peak, padded)
            del engine
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        if args.device.startswith("cuda"):
            peak, padded = mixed
            print()
            print(
                f"one 8k + fifteen 64-token decode step: peak {peak / 2**20:.1f} MiB above the "
                f"pool and weights; a K/V copy padded to 8k would take {padded / 2**20:.1f} MiB "
                "for each layer"
            )


if __name__ == "__main__":
    main()
