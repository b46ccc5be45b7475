"""Peak temporary memory of one decode step of one 8k and fifteen 64-token sequences (CPU).

    .venv/bin/python bench/attention_memory.py                    # this checkout
    .venv/bin/python bench/attention_memory.py --baseline ae2964b # and an older commit

The built-in tiny model (4 layers, 8 query / 4 KV heads of 32, float32) with
random KV already in the pool: one forward step in which all sixteen
sequences feed one token, next to the same step for the 8k sequence alone
and for the fifteen short ones alone. Peak resident memory above the level
before the step, in a process whose allocator unmaps every freed block of
64 KiB or more (glibc's MALLOC_MMAP_THRESHOLD_), so resident memory follows
what is live; best of five. Each revision runs in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = 16
CASES = {"mixed": [8192] + [64] * 15, "long alone": [8192], "short alone": [64] * 15}


def measure() -> dict[str, int]:
    import torch

    from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
    from pdcluster.runtime.engine.model import LlamaModel, build_forward_batch
    from pdcluster.runtime.engine.weights import load_tiny

    torch.set_num_threads(1)
    weights = load_tiny(dtype=torch.float32)
    pages = sum(-(-n // PAGE) for n in CASES["mixed"])
    pool = KVPool(KVPoolShape(4, pages, PAGE, weights.num_kv_heads, 32, "float32"))
    pool.buffer.normal_()
    model = LlamaModel(weights)

    def step(lengths: list[int]) -> None:
        chunks, page = [], 0
        for n in lengths:
            used = -(-n // PAGE)
            chunks.append(([65], n - 1, list(range(page, page + used))))
            page += used
        batch = build_forward_batch(chunks, PAGE)
        with torch.inference_mode():
            model.forward(batch, pool, model.embed(batch.token_ids))

    def status(field: str) -> int:
        found = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
        assert found is not None
        return int(found.group(1)) * 1024

    out = {}
    for name, lengths in CASES.items():
        step(lengths)  # warm up
        peaks = []
        for _ in range(5):
            Path("/proc/self/clear_refs").write_text("5")
            before = status("VmRSS")
            step(lengths)
            peaks.append(status("VmHWM") - before)
        out[name] = min(peaks)
    return out


def _run(label: str, pythonpath: str | None) -> dict[str, int]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(
        [sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, check=True
    )
    return {"label": label, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", metavar="REV", help="also measure this git revision")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure()))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="attention-memory-") as tmp:
        if args.baseline:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from engine_vs_vllm import _baseline_pythonpath

            path = _baseline_pythonpath(args.baseline, Path(tmp))
            rows.append(_run(f"ours@{args.baseline}", str(path)))
        rows.append(_run("ours", None))
    print("| engine | " + " | ".join(f"{name} (MiB)" for name in CASES) + " |")
    print("| --- |" + " ---: |" * len(CASES))
    for row in rows:
        cells = " | ".join(f"{row[name] / 2**20:.1f}" for name in CASES)
        print(f"| {row['label']} | {cells} |")


if __name__ == "__main__":
    main()
