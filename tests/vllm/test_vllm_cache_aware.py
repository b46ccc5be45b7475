"""cache_aware over stock vLLM: the router follows each vLLM worker's own
prefix-cache events (`--kv-events-config`, ZMQ) and sends a prompt to the
worker that holds its prefix.

One cluster for the module: `pdcluster up` on a colocated `kind: vllm`
manifest with two instances routed by cache_aware (real `vllm serve`
processes, the tiny random Llama, KV blocks of 128 tokens). Each worker is
given a prefix of its own straight to its port (the router sees no such
request); the router learns them only from the workers' events (its
`pdcluster_router_prefix_index_pages`), then routes prompts that share each
prefix to its holder, and vLLM's own counters show the hits.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.local.cluster import RunningCluster, local_cluster, write_manifest
from tests.vllm.harness import MODEL_NAME, read_metrics, vllm_spec, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

READY_TIMEOUT_S = 900
BLOCK = 128


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, vllm_python: str, vllm_model: Path
) -> Iterator[RunningCluster]:
    tmp = tmp_path_factory.mktemp("vllm-cache-aware")
    spec: dict[str, Any] = vllm_spec(vllm_model)
    for role in ("prefill", "decode"):
        del spec[role]
    spec["transfer"] = {}
    spec["colocated"] = {"replicas": 2}
    spec["router"] = {"policy": {"decode": "cache_aware"}}
    manifest = write_manifest(tmp, "vllm-cache", spec)
    state = tmp / "state"
    state.mkdir()
    args = ["--vllm", vllm_python, "--ready-timeout", str(READY_TIMEOUT_S)]
    with local_cluster(manifest, state, timeout=READY_TIMEOUT_S + 60, args=args) as running:
        yield running


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 290) for _ in range(n)]  # the tiny vocabulary: 300


def complete(url: str, prompt: list[int] | str, headers: dict[str, str] | None = None) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)
    resp.raise_for_status()


def indexed_pages(cluster: RunningCluster) -> dict[str, float]:
    text = httpx.get(cluster.endpoint + "/metrics", timeout=10).text
    return {
        sample.labels["worker"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pdcluster_router_prefix_index_pages"
    }


def served(url: str) -> float:
    return read_metrics(url).get("vllm:request_success_total")


def test_prompts_go_to_the_vllm_worker_whose_events_show_their_prefix(
    cluster: RunningCluster,
) -> None:
    urls = [str(cluster.worker(f"colocated-{i}")["url"]) for i in range(2)]
    # Both workers are followed from the start (an empty index entry each).
    wait_for(lambda: set(indexed_pages(cluster)) == set(urls), 60, "both workers followed")
    prefixes = [ids(seed, 3 * BLOCK) for seed in (1, 2)]
    # Each worker caches a prefix of its own, asked straight at its port.
    for url, prefix in zip(urls, prefixes, strict=True):
        complete(url, [*prefix, *ids(100, 8)], headers=cluster.auth)
    wait_for(
        lambda: all(indexed_pages(cluster).get(u, 0) >= 3 for u in urls),
        60,
        "the router's index fed by both workers' events",
    )
    hits_before = [read_metrics(u).get("vllm:prefix_cache_hits_total") for u in urls]
    # Prompts sharing a prefix go to its holder, whatever order they come in.
    order = [0, 1, 1, 0, 1, 0]
    went = []
    for n, holder in enumerate(order):
        before = [served(u) for u in urls]
        complete(cluster.endpoint, [*prefixes[holder], *ids(200 + n, 16)])
        after = [served(u) for u in urls]
        went.append([a - b for a, b in zip(after, before, strict=True)].index(1))
    assert went == order
    # vLLM's own counters agree: each worker found the 3 blocks of its prefix, 3 times.
    hits = [read_metrics(u).get("vllm:prefix_cache_hits_total") for u in urls]
    assert [h - b for h, b in zip(hits, hits_before, strict=True)] == [3 * 3 * BLOCK] * 2


def test_text_prompts_are_tokenized_as_vllm_does_and_follow_their_prefix(
    cluster: RunningCluster,
) -> None:
    urls = [str(cluster.worker(f"colocated-{i}")["url"]) for i in range(2)]
    text = "A fox and a dog share one long story about a quiet river town. " * 8
    pages = indexed_pages(cluster)
    complete(urls[1], text + "First.", headers=cluster.auth)
    wait_for(
        lambda: indexed_pages(cluster).get(urls[1], 0) > pages.get(urls[1], 0),
        60,
        "the text prefix in the router's index",
    )
    before = [served(u) for u in urls]
    for ending in ("Second.", "Third, and last."):
        complete(cluster.endpoint, text + ending)
    after = [served(u) for u in urls]
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 2]
