"""Where the time of a short PD request goes: a stage-by-stage breakdown.

Starts the 1P1D example (`examples/pd-1p1d.yaml`, `tcp`) with
``PDCLUSTER_STAGE_TRACE`` set, so the router and both workers stamp each
room at every hop (`runtime/stage_trace.py`), sends `--trials` streaming
`/generate` requests of `--length` tokens one after another through the
router (after `--warmup` untimed ones), and prints, per stage, the median
time since the client sent the request and the median step from the stage
above it.

    .venv/bin/python bench/pd_stages.py [--trials 30] [--length 16]

Stage names are ``<process>.<what>``: ``router.*`` in the router,
``prefill.*`` / ``decode.*`` in the workers (``rx``/``tx`` a ZMQ control
message received on the I/O thread / sent, ``bcast`` a group command from
the engine thread to the rank agents, ``report`` a rank agent's report to
the engine thread's coordinator), ``client.*`` in this script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import start_example  # noqa: E402

from pdcluster.runtime import stage_trace  # noqa: E402


def timed_request(client: httpx.Client, endpoint: str, prompt: list[int]) -> tuple[int, int]:
    """(send, first token) stamps on the host's monotonic clock, in ns."""
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
    }
    sent = time.monotonic_ns()
    first = 0
    with client.stream("POST", f"{endpoint}/generate", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not first and line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("output_ids"):
                    first = time.monotonic_ns()
    if not first:
        raise RuntimeError("stream ended without a token")
    return sent, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--length", type=int, default=16)
    ap.add_argument("--example", default="pd-1p1d.yaml")
    ap.add_argument(
        "--span",
        action="append",
        default=[],
        metavar="FROM:TO",
        help="also print the median and p90 of TO - FROM per request (repeatable), "
        "e.g. prefill.http:prefill.engine_add",
    )
    args = ap.parse_args()
    spans = [parse_span(text) for text in args.span]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(tmp) / "trace"
        os.environ[stage_trace.ENV] = str(trace_dir)  # inherited by every process
        cluster = start_example(args.example, Path(tmp))
        stamps: list[tuple[int, int]] = []
        try:
            with httpx.Client(timeout=120) as client:
                for i in range(args.warmup + args.trials):
                    prompt = [rng.randrange(1, 256) for _ in range(args.length)]
                    sent, first = timed_request(client, cluster.plan.endpoint, prompt)
                    if i >= args.warmup:
                        stamps.append((sent, first))
        finally:
            cluster.stop()
        lines: list[str] = []
        for path in trace_dir.glob("*.tsv"):
            lines.extend(path.read_text().splitlines())
    rooms = stage_trace.parse_lines(lines)
    # Requests ran one at a time: the i-th room the router saw is the i-th request.
    ordered = sorted(
        (r for r in rooms.values() if "router.recv" in r), key=lambda r: r["router.recv"]
    )
    timed = ordered[args.warmup :]
    if len(timed) != len(stamps):
        raise RuntimeError(f"{len(timed)} traced rooms for {len(stamps)} requests")
    for stages, (sent, first) in zip(timed, stamps, strict=True):
        stages["client.send"] = sent
        stages["client.first_token"] = first
    rows = stage_trace.summarize(dict(enumerate(timed)), origin="client.send")
    print(f"{args.trials} requests of {args.length} tokens, {args.example}, one at a time")
    print(f"{'stage':<34} {'rooms':>5} {'since send':>11} {'step':>9}")
    for row in rows:
        print(f"{row.stage:<34} {row.num_rooms:>5} {row.offset_ms:>8.2f} ms {row.step_ms:>6.2f} ms")
    for start, end in spans:
        gaps = sorted(
            (stages[end] - stages[start]) / 1e6
            for stages in timed
            if start in stages and end in stages
        )
        if not gaps:
            print(f"span {start} -> {end}: no request has both stages")
            continue
        p50, p90 = gaps[len(gaps) // 2], gaps[min(len(gaps) - 1, int(len(gaps) * 0.9))]
        print(f"span {start} -> {end}: p50 {p50:.2f} ms, p90 {p90:.2f} ms ({len(gaps)} requests)")


def parse_span(text: str) -> tuple[str, str]:
    start, sep, end = text.partition(":")
    if not sep or not start or not end:
        raise SystemExit(f"--span takes FROM:TO (two stage names), got {text!r}")
    return start, end


if __name__ == "__main__":
    main()
