"""Our engine against vLLM's CPU build: same box, same model directory, same prompts, one run.

    .venv/bin/python bench/engine_vs_vllm.py                    # the table in docs/benchmarks.md
    .venv/bin/python bench/engine_vs_vllm.py --baseline HEAD~3  # also ours at an older commit
    .venv/bin/python bench/engine_vs_vllm.py --skip-vllm --batch 16 --temperature 1.0

The model is a random-weight Llama directory (float32; hidden 512, 4
layers, 8 query / 2 KV heads, MLP 1536, a Llama-3-sized vocabulary of
128,256: 143M parameters), written once per run. Every engine runs in a
process of its own: ours with this checkout's interpreter (and, with
`--baseline REV`, the same interpreter importing a copy of REV), vLLM with
the cached interpreter of `e2e/vllmenv` (its torch pin differs from ours).

Decode tokens/s of `batch` requests with distinct `--prompt-len`-token
prompts (token ids, no tokenizer): the time of a `--new-tokens` generation
minus the time of a one-token generation (both go through the same
prefill), so tok/s = batch × (new tokens − 1) / difference. Prefix caching
is off in both engines, `ignore_eos` on, no seeds (the default request).
Each case runs `--repeats` times after one untimed warm-up; the median is
reported. Both engines get `--threads` compute threads (vLLM: OpenMP
threads, unbound; ours: torch intra-op threads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VOCAB = 128_256
MODEL_SHAPE = {
    "num_layers": 4,
    "hidden_size": 512,
    "num_heads": 8,
    "num_kv_heads": 2,
    "intermediate_size": 1536,
}


# ---------------------------------------------------------------- shared case list


def prompts_for(batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Distinct token-id prompts (the same in every engine's process)."""
    rng = random.Random(seed * 1_000_003 + batch)
    return [[rng.randrange(3, 32_000) for _ in range(prompt_len)] for _ in range(batch)]


def decode_tok_s(batch: int, new_tokens: int, t_full: float, t_first: float) -> float:
    return batch * (new_tokens - 1) / max(t_full - t_first, 1e-9)


def time_cases(
    run: Any, cases: list[tuple[int, float]], prompt_len: int, new_tokens: int, repeats: int
) -> list[dict[str, Any]]:
    """`run(prompts, max_tokens, temperature)` generates and returns when all are done."""
    run(prompts_for(2, prompt_len, seed=99), new_tokens, 1.0)  # warm-up, untimed
    rows = []
    for batch, temperature in cases:
        prompts = prompts_for(batch, prompt_len)
        speeds, steps_ms = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(prompts, 1, temperature)
            t1 = time.perf_counter()
            run(prompts, new_tokens, temperature)
            t2 = time.perf_counter()
            speeds.append(decode_tok_s(batch, new_tokens, t2 - t1, t1 - t0))
            steps_ms.append(1000 * ((t2 - t1) - (t1 - t0)) / (new_tokens - 1))
        rows.append(
            {
                "batch": batch,
                "temperature": temperature,
                "decode_tok_s": statistics.median(speeds),
                "ms_per_step": statistics.median(steps_ms),
                "all_tok_s": [round(s, 1) for s in speeds],
            }
        )
        print(f"  batch {batch} T={temperature}: {rows[-1]['decode_tok_s']:.1f} tok/s", flush=True)
    return rows


# ---------------------------------------------------------------- workers (one process each)


def ours_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    from pdcluster.runtime.engine import engine as engine_module
    from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
    from pdcluster.runtime.engine.engine_config import EngineConfig
    from pdcluster.runtime.engine.sampling import SamplingParams
    from pdcluster.runtime.spec import pages_for

    batch = max(b for b, _ in args.cases)
    longest = args.prompt_len + args.new_tokens
    config = EngineConfig(
        model=args.model_dir,
        compute_dtype="float32",
        kv_dtype="float32",
        page_size=16,
        num_pages=batch * pages_for(longest, 16) + 16,
        max_running_requests=batch,
        max_batch_tokens=batch * args.prompt_len,
        chunk_size=args.prompt_len,
        max_prompt_tokens=args.prompt_len,
        max_new_tokens=args.new_tokens,
    )
    engine = LLMEngine(config)
    counter = iter(range(1 << 62))

    def run(prompts: list[list[int]], max_tokens: int, temperature: float) -> None:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
        rids = set()
        for p in prompts:
            rid = f"r{next(counter)}"
            rids.add(rid)
            engine.add_request(EngineRequest(rid, list(p), params))
        while rids:
            for out in engine.step():
                if out.finished:
                    rids.discard(out.rid)

    rows = time_cases(run, args.cases, args.prompt_len, args.new_tokens, args.repeats)
    return {
        "engine": "ours",
        "source": str(Path(engine_module.__file__).resolve().parent.parent.parent),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def vllm_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model_dir,
        dtype="float32",
        max_model_len=args.prompt_len + args.new_tokens,
        enforce_eager=not args.vllm_compile,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        max_num_seqs=max(b for b, _ in args.cases),
        seed=0,
    )

    def run(prompts: list[list[int]], max_tokens: int, temperature: float) -> None:
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    rows = time_cases(run, args.cases, args.prompt_len, args.new_tokens, args.repeats)
    return {
        "engine": "vllm",
        "source": f"vllm {vllm.__version__}" + (" (compiled)" if args.vllm_compile else " (eager)"),
        "torch": torch.__version__,
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
        "rows": rows,
    }


# ---------------------------------------------------------------- driver


def _write_model(directory: Path) -> None:
    sys.path.insert(0, str(REPO))
    from tests.engine.testing import write_random_hf_dir

    write_random_hf_dir(directory, "llama", seed=0, extra={"vocab_size": VOCAB}, **MODEL_SHAPE)


def _baseline_pythonpath(rev: str, into: Path) -> Path:
    """A copy of `rev`'s tree and a PYTHONPATH folder that imports it as `pdcluster.*`."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    archive = into / "tree.tar"
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "-o", str(archive), rev, "runtime", "operator"],
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    sys.path.insert(0, str(REPO))
    from e2e.vllmenv.build import checkout_pythonpath

    return checkout_pythonpath(tree)


def _spawn(python: str, args: argparse.Namespace, worker: str, env: dict[str, str]) -> Any:
    out = Path(args.workdir) / f"{worker}-{len(os.listdir(args.workdir))}.json"
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--worker",
        worker,
        "--model-dir",
        args.model_dir,
        "--json-out",
        str(out),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
        "--batch",
        *[str(b) for b in args.batch],
        "--temperature",
        *[str(t) for t in args.temperature],
    ] + (["--vllm-compile"] if args.vllm_compile else [])
    started = time.monotonic()
    subprocess.run(cmd, check=True, env={**os.environ, **env}, cwd=str(REPO))
    result = json.loads(out.read_text())
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def _table(results: list[dict[str, Any]]) -> str:
    names = [r["label"] for r in results]
    head = "| batch | T | " + " | ".join(f"{n} tok/s" for n in names)
    vllm = next((r for r in results if r["engine"] == "vllm"), None)
    ours = [r for r in results if r["engine"] == "ours"]
    head += "".join(f" | {r['label']} / vLLM" for r in ours) if vllm else ""
    lines = [head + " |", "|" + " ---: |" * (head.count("|"))]
    for i, row in enumerate(results[0]["rows"]):
        cells = [str(row["batch"]), f"{row['temperature']:g}"]
        cells += [f"{r['rows'][i]['decode_tok_s']:.1f}" for r in results]
        if vllm:
            base = vllm["rows"][i]["decode_tok_s"]
            cells += [f"{r['rows'][i]['decode_tok_s'] / base:.2f}×" for r in ours]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", metavar="REV", help="also run ours at this git revision")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-compile", action="store_true", help="vLLM without enforce_eager")
    parser.add_argument("--json", help="write every result here")
    # Internal: one engine's process.
    parser.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.cases = [(b, t) for b in args.batch for t in args.temperature]

    if args.worker is not None:
        result = (ours_worker if args.worker == "ours" else vllm_worker)(args)
        Path(args.json_out).write_text(json.dumps(result))
        return

    with tempfile.TemporaryDirectory(prefix="engine-vs-vllm-") as tmp:
        args.workdir = tmp
        args.model_dir = str(Path(tmp) / "model")
        _write_model(Path(args.model_dir))
        threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        runs: list[tuple[str, str, dict[str, str]]] = []
        if args.baseline:
            path = _baseline_pythonpath(args.baseline, Path(tmp) / "baseline")
            runs.append((f"ours@{args.baseline}", "ours", {"PYTHONPATH": str(path)}))
        runs.append(("ours", "ours", {}))
        if not args.skip_vllm:
            sys.path.insert(0, str(REPO))
            from e2e.vllmenv.build import ensure_vllm_env

            vllm_env = {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "VLLM_LOGGING_LEVEL": "WARNING",
            }
            runs.append(("vLLM", str(ensure_vllm_env().python), vllm_env))
        results = []
        for label, python, env in runs:
            print(f"== {label}", flush=True)
            worker = "vllm" if label == "vLLM" else "ours"
            python = sys.executable if worker == "ours" else python
            result = _spawn(python, args, worker, {**threads, **env})
            result["label"] = label
            results.append(result)
            print(f"   from {result['source']} (torch {result['torch']}, {result['wall_s']} s)")
    print()
    print(
        f"decode tok/s, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
        f"float32, {args.threads} thread(s), median of {args.repeats}"
    )
    print(_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
