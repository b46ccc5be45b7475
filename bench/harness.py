"""What the local-mode benchmarks share: a tiny-model manifest, a local cluster
started from it, a streamed request's time to first token, and the
shared-prefix workload (issue 15's shape).

The scripts run as `python bench/<name>.py`, so this folder is on `sys.path`
and they import this module by its bare name.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdcluster.runtime.cli import load_manifest
from pdcluster.runtime.local.launcher import LocalCluster
from pdcluster.runtime.local.plan import LocalPlan, build_local_plan, count_ports
from pdcluster.runtime.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
READY_S = 300  # a cold start of a few tiny-model ranks on a loaded CPU box


def tiny_cluster(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A PDCluster document serving the built-in tiny model; `spec` adds the rest."""
    return {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": name},
        "spec": {"model": {"name": "tiny"}, **spec},
    }


def write_manifest(doc: dict[str, Any], folder: Path) -> Path:
    """Writes `doc` as `<folder>/<metadata.name>.yaml` and returns the path."""
    path = folder / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def local_plan(path: Path) -> LocalPlan:
    """The local plan of the manifest at `path`, on fresh loopback ports."""
    manifest = load_manifest(str(path))
    return build_local_plan(
        manifest, str(path), free_ports(count_ports(manifest)), python=sys.executable
    )


def start(path: Path, state: Path) -> LocalCluster:
    """Starts the manifest at `path` under `<state>/<metadata.name>` and waits until it serves."""
    plan = local_plan(path)
    cluster = LocalCluster(plan, state / plan.cluster)
    cluster.start()
    cluster.wait_ready(READY_S)
    return cluster


def start_example(example: str, state: Path) -> LocalCluster:
    """Starts `examples/<example>` (see `start`)."""
    return start(ROOT / "examples" / example, state)


def start_doc(doc: dict[str, Any], state: Path) -> LocalCluster:
    """Writes `doc` into `state` and starts it (see `start`)."""
    return start(write_manifest(doc, state), state)


def ttft(
    client: httpx.Client,
    endpoint: str,
    prompt: list[int],
    new_tokens: int,
    headers: dict[str, str] | None = None,
) -> float:
    """Seconds from sending a streaming greedy `/generate` to the first event carrying a
    token; reads the stream to its end so the next request finds the cluster idle."""
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }
    first = None
    t0 = time.perf_counter()
    with client.stream("POST", f"{endpoint}/generate", json=body, headers=headers) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("output_ids"):
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("stream ended without a token")
    return first


def add_prefix_workload_args(ap: argparse.ArgumentParser, requests: int) -> None:
    """The shared-prefix workload's options (read back by `prefix_systems`)."""
    ap.add_argument("--requests", type=int, default=requests)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1536)
    ap.add_argument("--suffix-tokens", type=int, default=64)


def prefix_systems(rng: random.Random, args: argparse.Namespace) -> list[list[int]]:
    """`--systems` shared prompts of `--system-tokens` random tokens each."""
    return [[rng.randrange(1, 256) for _ in range(args.system_tokens)] for _ in range(args.systems)]


def round_robin_prompts(rng: random.Random, args: argparse.Namespace) -> list[list[int]]:
    """`--requests` prompts: the shared prompts in turn, each plus `--suffix-tokens` unique ones."""
    systems = prefix_systems(rng, args)
    return [
        systems[i % args.systems] + [rng.randrange(1, 256) for _ in range(args.suffix_tokens)]
        for i in range(args.requests)
    ]
