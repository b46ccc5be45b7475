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
Both engines get `--threads` compute threads (vLLM: OpenMP threads,
unbound; ours: torch intra-op threads).

Every engine stays loaded for the whole run and they take turns: each
repeat times every case on every engine, one after the other, so a change
in the machine's load reaches all of them alike (the box this runs on is
shared). The median of `--repeats` is reported, after one untimed warm-up.
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


RESULT = "RESULT "  # the prefix of a worker's answer lines (engines log to stdout too)


def serve_cases(run: Any, info: dict[str, Any], prompt_len: int, new_tokens: int) -> None:
    """A worker's loop: warm up, say ready, then time one case per request line.

    `run(prompts, max_tokens, temperature)` generates and returns when all are done.
    """
    run(prompts_for(2, prompt_len, seed=99), new_tokens, 1.0)  # warm-up, untimed
    print(RESULT + json.dumps(info), flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        prompts = prompts_for(case["batch"], prompt_len)
        t0 = time.perf_counter()
        run(prompts, 1, case["temperature"])
        t1 = time.perf_counter()
        run(prompts, new_tokens, case["temperature"])
        t2 = time.perf_counter()
        print(RESULT + json.dumps({"t_first": t1 - t0, "t_full": t2 - t1}), flush=True)


# ---------------------------------------------------------------- workers (one process each)


def ours_worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from pdcluster.runtime.engine import engine as engine_module
    from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
    from pdcluster.runtime.engine.engine_config import EngineConfig
    from pdcluster.runtime.engine.sampling import SamplingParams
    from pdcluster.runtime.spec import pages_for

    batch = max(args.batch)
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

    info = {
        "engine": "ours",
        "source": str(Path(engine_module.__file__).resolve().parent.parent.parent),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    serve_cases(run, info, args.prompt_len, args.new_tokens)


def vllm_worker(args: argparse.Namespace) -> None:
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
        max_num_seqs=max(args.batch),
        seed=0,
    )

    def run(prompts: list[list[int]], max_tokens: int, temperature: float) -> None:
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    info = {
        "engine": "vllm",
        "source": f"vllm {vllm.__version__}" + (" (compiled)" if args.vllm_compile else " (eager)"),
        "torch": torch.__version__,
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
    }
    serve_cases(run, info, args.prompt_len, args.new_tokens)


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


class Worker:
    """One engine's process: loaded once, then times the cases it is sent."""

    def __init__(
        self, label: str, python: str, args: argparse.Namespace, kind: str, env: dict[str, str]
    ) -> None:
        self.label = label
        cmd = [
            python,
            str(Path(__file__).resolve()),
            "--worker",
            kind,
            "--model-dir",
            args.model_dir,
            "--prompt-len",
            str(args.prompt_len),
            "--new-tokens",
            str(args.new_tokens),
            "--threads",
            str(args.threads),
            "--batch",
            *[str(b) for b in args.batch],
        ] + (["--vllm-compile"] if args.vllm_compile else [])
        self._log = open(Path(args.workdir) / f"{label}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **env},
            cwd=str(REPO),
        )
        started = time.monotonic()
        self.info: dict[str, Any] = self._answer()
        self.info["start_s"] = round(time.monotonic() - started, 1)
        self.info["label"] = label

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                answer: dict[str, Any] = json.loads(line[len(RESULT) :])
                return answer
        raise RuntimeError(f"{self.label} exited ({self.proc.wait()}); see {self._log.name}")

    def time_case(self, batch: int, temperature: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"batch": batch, "temperature": temperature}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


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
    args = parser.parse_args()
    args.cases = [(b, t) for b in args.batch for t in args.temperature]

    if args.worker is not None:
        (ours_worker if args.worker == "ours" else vllm_worker)(args)
        return

    with tempfile.TemporaryDirectory(prefix="engine-vs-vllm-") as tmp:
        args.workdir = tmp
        args.model_dir = str(Path(tmp) / "model")
        _write_model(Path(args.model_dir))
        threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        runs: list[tuple[str, str, str, dict[str, str]]] = []
        if args.baseline:
            path = _baseline_pythonpath(args.baseline, Path(tmp) / "baseline")
            label = f"ours@{args.baseline}"
            runs.append((label, sys.executable, "ours", {"PYTHONPATH": str(path)}))
        runs.append(("ours", sys.executable, "ours", {}))
        if not args.skip_vllm:
            sys.path.insert(0, str(REPO))
            from e2e.vllmenv.build import ensure_vllm_env

            vllm_env = {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "VLLM_LOGGING_LEVEL": "WARNING",
            }
            runs.append(("vLLM", str(ensure_vllm_env().python), "vllm", vllm_env))
        workers: list[Worker] = []
        try:
            for label, python, kind, env in runs:
                print(f"== starting {label}", flush=True)
                workers.append(Worker(label, python, args, kind, {**threads, **env}))
                info = workers[-1].info
                print(f"   {info['source']} (torch {info['torch']}, {info['start_s']} s)")
            timings: dict[tuple[str, int, float], list[float]] = {}
            for repeat in range(args.repeats):
                for batch, temperature in args.cases:
                    for worker in workers:  # the engines take turns, case by case
                        t = worker.time_case(batch, temperature)
                        speed = decode_tok_s(batch, args.new_tokens, t["t_full"], t["t_first"])
                        timings.setdefault((worker.label, batch, temperature), []).append(speed)
                        print(
                            f"  [{repeat + 1}/{args.repeats}] {worker.label} batch {batch} "
                            f"T={temperature}: {speed:.1f} tok/s",
                            flush=True,
                        )
        finally:
            for worker in workers:
                worker.close()
    results = []
    for worker in workers:
        rows = [
            {
                "batch": batch,
                "temperature": temperature,
                "decode_tok_s": statistics.median(timings[(worker.label, batch, temperature)]),
                "all_tok_s": [round(v, 1) for v in timings[(worker.label, batch, temperature)]],
            }
            for batch, temperature in args.cases
        ]
        results.append({**worker.info, "rows": rows})
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
