"""PD output equals colocated output, token for token, for every example topology.

Each example manifest runs as real processes (router, prefill and decode
ranks) on 127.0.0.1; prompts of 1 to 2,000 tokens go through the router
concurrently and greedy outputs are compared with an in-process colocated
engine using the same settings. No page may leak on any worker.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from pdcluster.runtime.cli import load_manifest
from tests.local.cluster import local_cluster
from tests.pd_integration.reference import colocated_outputs
from tests.transfer.nixl_helpers import need_nixl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("pd-*.yaml"))
MAX_TOKENS = 8


def make_prompts(n: int, seed: int, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2000, 15, 16, 17] + [rng.randint(1, 2000) for _ in range(n - 5)]
    return [[rng.randrange(1, vocab) for _ in range(k)] for k in lengths]


def generate(endpoint: str, prompt: list[int]) -> list[int]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
    }
    resp = httpx.post(f"{endpoint}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out: list[int] = resp.json()["output_ids"]
    return out


def generate_all(cluster, prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """Every prompt's output through the cluster's router, `concurrency` at a time."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: generate(cluster.endpoint, p), prompts))


def assert_no_page_leak(cluster, timeout: float = 10.0) -> None:
    for proc in cluster.state["processes"]:
        if proc["role"] == "router":
            continue
        deadline = time.monotonic() + timeout
        while True:
            info = httpx.get(
                proc["url"] + "/get_server_info", headers=cluster.auth, timeout=10
            ).json()
            if info["num_free_pages"] == info["num_total_pages"]:
                break
            assert time.monotonic() < deadline, f"{proc['name']} leaked pages: {info}"
            time.sleep(0.1)


def with_backend(example: str, backend: str | None, tmp_path: Path) -> Path:
    """The example as written (backend None), or a copy moving KV with `backend`."""
    manifest = ROOT / "examples" / example
    if backend is None:
        if "nixl" in manifest.read_text():
            need_nixl()
        return manifest
    if backend == "nixl":
        need_nixl()
    doc = yaml.safe_load(manifest.read_text())
    doc["spec"].setdefault("transfer", {})["backend"] = backend
    copy = tmp_path / f"{backend}-{example}"
    copy.write_text(yaml.safe_dump(doc))
    return copy


# Every example as written, and again with nixl each topology no other test
# already runs on nixl: pd-1p1d-nixl and pd-nixl-prefill-tp1-decode-tp2 are
# examples; 2p2d over nixl is the 64-concurrent test below; prefill tp2 to
# decode tp1 is test_transport_and_policy_variants_equal_colocated[nixl] (and
# [nixl-prefill_complete]); cp2, dp2 and tp2-2pods run over nixl in
# test_prefix_cache_pd.py's every-topology test (ON_NIXL_HERE there).
_ON_NIXL_ELSEWHERE = {
    "pd-1p1d.yaml",
    "pd-prefill-tp1-decode-tp2.yaml",
    "pd-2p2d.yaml",
    "pd-prefill-tp2-decode-tp1.yaml",
    "pd-prefill-cp2.yaml",
    "pd-prefill-dp2.yaml",
    "pd-prefill-tp2-2pods.yaml",
}
# Not copied onto nixl either: wide dp over pods (pd-prefill-dp2-2pods) moves KV
# as dp2 on one pod does — each dp group has its own transfer endpoints, at its
# own pod's address — and dp2 over nixl is the every-topology test's [dp2]; the
# example runs in float64 (tcp) there and at one rank a pod in
# tests/local/test_multi_pod.py.
_NOT_ON_NIXL = {"pd-prefill-dp2-2pods.yaml"}
# As written, the two-pod example runs in tests/local/test_multi_pod.py (one
# cluster start for PD == colocated and the gang restart).
_AS_WRITTEN_ELSEWHERE = {"pd-prefill-tp2-2pods.yaml"}
# Every other example's topology serves in float64 with the prefix cache on in
# test_prefix_cache_pd.py's every-topology test (prompts sharing pages, evictions,
# against an uncached colocated engine): one cluster start for both checks;
# 2P2D in float64 with caches on is test_cache_aware_pd.py's, and as written the
# 64-concurrent test below. The float32 path stays covered by pd-1p1d-nixl as
# written, the nixl copies below and the 64-concurrent 2P2D test.
FLOAT64_ELSEWHERE = frozenset(ex for ex in EXAMPLES if ex != "pd-1p1d-nixl.yaml")
CASES: list = [
    (ex, None) for ex in EXAMPLES if ex not in _AS_WRITTEN_ELSEWHERE | FLOAT64_ELSEWHERE
] + [
    (ex, "nixl")
    for ex in EXAMPLES
    if "nixl" not in ex and ex not in _ON_NIXL_ELSEWHERE | _NOT_ON_NIXL
]
CASE_IDS = [f"{e}-{b}" if b else e for e, b in CASES]


@pytest.mark.slow
@pytest.mark.parametrize(("example", "backend"), CASES, ids=CASE_IDS)
def test_pd_equals_colocated(example: str, backend: str | None, tmp_path: Path) -> None:
    manifest = with_backend(example, backend, tmp_path)
    cluster_spec = load_manifest(str(manifest))
    prompts = make_prompts(20, seed=7)
    expected = colocated_outputs(cluster_spec, prompts, MAX_TOKENS)
    with local_cluster(manifest, tmp_path / "state") as cluster:
        got = generate_all(cluster, prompts, 8)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"prompt {i} ({len(prompts[i])} tokens): PD {g} != colocated {e}"
        assert_no_page_leak(cluster)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [None, "nixl"], ids=["as-written", "nixl"])
def test_64_concurrent_requests_on_2p2d(backend: str | None, tmp_path: Path) -> None:
    manifest = with_backend("pd-2p2d.yaml", backend, tmp_path)
    rng = random.Random(64)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(1, 300))] for _ in range(64)]
    expected = colocated_outputs(load_manifest(str(manifest)), prompts, MAX_TOKENS)
    with local_cluster(manifest, tmp_path / "state") as cluster:
        got = generate_all(cluster, prompts, 64)
        assert got == expected
        assert_no_page_leak(cluster)


@pytest.mark.slow
def test_openai_client_through_pd_matches_colocated(tmp_path: Path) -> None:
    import openai

    manifest = ROOT / "examples" / "pd-1p1d.yaml"
    prompts = ["Hello", "The capital of France is", "x" * 700]
    # Sampled, penalised, with logprobs: the first token and its logprobs come from
    # prefill, the rest from decode; a seed makes both runs draw alike.
    sampled = {
        "max_tokens": 10,
        "temperature": 0.8,
        "seed": 11,
        "frequency_penalty": 0.5,
        "logprobs": 2,
    }
    with local_cluster(ROOT / "examples" / "colocated.yaml", tmp_path / "c") as coloc:
        ref = openai.OpenAI(base_url=coloc.endpoint + "/v1", api_key="unused")
        expected = [
            ref.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
            .choices[0]
            .text
            for p in prompts
        ]
        ref_sampled = [
            ref.completions.create(model="tiny", prompt=p, **sampled).choices[0] for p in prompts
        ]
    with local_cluster(manifest, tmp_path / "pd") as cluster:
        client = openai.OpenAI(base_url=cluster.endpoint + "/v1", api_key="unused")
        for prompt, want in zip(prompts, expected, strict=True):
            whole = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0
            )
            assert whole.choices[0].text == want
            chunks = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in chunks) == want
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
        )
        assert chat.choices[0].message.role == "assistant"
        for prompt, want in zip(prompts, ref_sampled, strict=True):
            got = client.completions.create(model="tiny", prompt=prompt, **sampled).choices[0]
            assert got.text == want.text
            assert got.logprobs is not None and want.logprobs is not None
            assert got.logprobs.tokens == want.logprobs.tokens
            assert got.logprobs.token_logprobs == pytest.approx(
                want.logprobs.token_logprobs, abs=1e-4
            )
        assert_no_page_leak(cluster)


@pytest.mark.slow
# tcp: tests/faults/test_recompute.py::test_checksummed_transfers_equal_colocated runs
# a checksummed tcp cluster anyway and checks the same (outputs, stats, metrics).
@pytest.mark.parametrize("backend", ["shm"])
def test_checksummed_kv_arrives_bit_identical(tmp_path: Path, backend: str) -> None:
    """Debug check: each source's Success carries a CRC of its source pages, verified
    on decode's pages (and, with tcp, every KV frame a CRC of prefill's bytes, verified
    by decode before it is written); all must verify and outputs must equal colocated."""
    from tests.local.cluster import write_manifest

    spec = {
        "model": {"name": "tiny"},
        "kvCache": {"pageSize": 16, "numPages": 512},
        "transfer": {"checksum": True, "backend": backend},
        "prefill": {},
        "decode": {},
    }
    manifest = write_manifest(tmp_path, "checksummed", spec)
    prompts = make_prompts(8, seed=3)
    expected = colocated_outputs(load_manifest(str(manifest)), prompts, MAX_TOKENS)
    with local_cluster(manifest, tmp_path / "state") as cluster:
        got = [generate(cluster.endpoint, p) for p in prompts]
        assert got == expected
        decode = cluster.worker("decode-0")
        stats = httpx.get(
            decode["url"] + "/get_server_info", headers=cluster.auth, timeout=10
        ).json()["kv_receive_stats"]
        if backend == "tcp":  # shm writes land without the receiver
            assert stats.get("accepted", 0) >= len(prompts)
        assert not any("checksum" in k for k in stats), stats
        failed = httpx.get(
            decode["url"] + "/get_server_info", headers=cluster.auth, timeout=10
        ).json()
        assert not any("checksum" in k for k in failed.get("pd_stats", {})), failed["pd_stats"]
        # The transfer is visible in both workers' metrics.
        measured = (("decode-0", "in"), ("prefill-0", "out")) if backend == "tcp" else ()
        for name, direction in measured:
            text = httpx.get(cluster.worker(name)["url"] + "/metrics", timeout=10).text
            line = next(
                ln
                for ln in text.splitlines()
                if ln.startswith(f'pdcluster_transfer_bytes_total{{direction="{direction}"}}')
            )
            assert float(line.split()[-1]) > 0, line
            assert "pdcluster_transfer_seconds_count" in text
            assert 'pdcluster_rooms{state="failed"} 0.0' in text


@pytest.mark.slow
@pytest.mark.parametrize(
    "transfer",
    [
        # shm under `early` alone: shm-prefill_complete runs the same two writers into
        # one decode's pages, and shm under early runs in test_prefix_cache_pd.py
        # (shm-decode-tp2) and in the fault suite's one-sided cluster.
        {"allocationPolicy": "prefill_complete"},
        {"backend": "shm", "allocationPolicy": "prefill_complete"},
        {"backend": "nixl"},
        {"backend": "nixl", "allocationPolicy": "prefill_complete"},
    ],
    ids=["prefill_complete", "shm-prefill_complete", "nixl", "nixl-prefill_complete"],
)
def test_transport_and_policy_variants_equal_colocated(transfer: dict, tmp_path: Path) -> None:
    """The one-sided transports (shm, nixl: writes into decode's pool) and the
    prefill_complete policy give the same tokens as colocated, with no leak."""
    from tests.local.cluster import write_manifest

    if transfer.get("backend") == "nixl":
        need_nixl()

    spec = {
        # float64: the prefill tp all-reduce cannot flip a greedy token.
        "model": {"name": "tiny", "computeDtype": "float64"},
        "kvCache": {"pageSize": 16, "numPages": 512, "dtype": "float64"},
        "transfer": transfer,
        "prefill": {"topology": {"tp": 2}},
        "decode": {},
    }
    manifest = write_manifest(tmp_path, "variant", spec)
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (1, 17, 600, 1500, 40, 5)]
    expected = colocated_outputs(load_manifest(str(manifest)), prompts, MAX_TOKENS)
    with local_cluster(manifest, tmp_path / "state") as cluster:
        got = generate_all(cluster, prompts, 4)
        assert got == expected
        assert_no_page_leak(cluster)
        if transfer.get("backend") == "nixl":
            assert_nixl_negotiated(cluster)


def assert_nixl_negotiated(cluster) -> None:
    """The prefill leaders say they WROTE with NIXL, and which UCX transports carried it."""
    prefills = [p for p in cluster.state["processes"] if p["role"] == "prefill"]
    assert prefills
    for proc in prefills:
        info = httpx.get(proc["url"] + "/get_server_info", headers=cluster.auth, timeout=10)
        report = info.json()["kv_transport"]
        assert report["backend"] == "nixl" and report["agent"]
        assert report["writes"]["writes"] > 0 and report["writes"]["errors"] == 0
        # No RDMA on a CPU box: UCX moved the bytes over TCP / shared memory.
        assert "tcp" in report["ucx_transports"] and report["tcp_fallback"]
        assert report["rdma_missing"] is False  # the manifest did not ask for RDMA
        metrics = httpx.get(proc["url"] + "/metrics", timeout=10).text
        assert 'pdcluster_kv_transport_info{backend="nixl"' in metrics
