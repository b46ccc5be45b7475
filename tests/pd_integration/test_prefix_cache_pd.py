"""PD with the prefix cache on for prefill: prefill computes only the uncached
suffix (every rank of a multi-rank prefill follows the leader's plan, so all
agree on the hits) and still delivers the whole prompt's KV, so decode's output equals
colocated output token for token; the prefill worker's metrics show the
reuse, and no page leaks on either side (cached pages count as free).
"""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml

from pdcluster.runtime.cli import load_manifest
from pdcluster.runtime.engine.engine import LLMEngine
from pdcluster.runtime.engine.engine_config import engine_config_from_spec
from pdcluster.runtime.engine.topology import ParallelConfig
from tests.local.cluster import RunningCluster, local_cluster, write_manifest
from tests.pd_integration.reference import colocated_outputs, greedy_outputs
from tests.pd_integration.test_topologies import (
    FLOAT64_ELSEWHERE,
    MAX_TOKENS,
    assert_no_page_leak,
    generate,
    generate_all,
)
from tests.transfer.nixl_helpers import need_nixl


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not exported"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill",
    # Multi-rank prefills only: every rank must agree on the hits (a single-rank
    # engine's cache is covered in-process by tests/engine/test_prefix_cache_engine.py).
    # prefill tp2 (to decode tp1) over tcp is pd-prefill-tp2-decode-tp1 in the
    # every-topology test below, which checks the same hits on its prefill.
    [{"topology": {"cp": 2}}],
    ids=["prefill-cp2"],
)
def test_prefill_with_the_prefix_cache_equals_colocated(prefill: dict, tmp_path: Path) -> None:
    spec = {
        # float64: a cached prefix changes which tokens one step computes together.
        "model": {"name": "tiny", "computeDtype": "float64"},
        "kvCache": {"pageSize": 16, "numPages": 256, "dtype": "float64"},
        "prefill": {**prefill, "engine": {"prefixCache": True}},
        "decode": {},
    }
    manifest = write_manifest(tmp_path, "prefix", spec)
    rng = random.Random(21)
    system = [rng.randrange(1, 256) for _ in range(100)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(1, 256) for _ in range(n)]

    # One at a time, so each finds what the ones before cached: a miss, every
    # full page of the shared 100 tokens, all of them again, some pages, an
    # unrelated prompt, an exact repeat.
    serial = [system + tail(9), system + tail(30), system, system[:40] + tail(5), tail(50)]
    serial.append(list(serial[0]))
    burst = [system + tail(rng.randrange(0, 40)) for _ in range(6)]
    expected = colocated_outputs(load_manifest(str(manifest)), serial + burst, MAX_TOKENS)
    with local_cluster(manifest, tmp_path / "state") as cluster:
        got = [generate(cluster.endpoint, p) for p in serial]
        got += generate_all(cluster, burst, 6)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"prompt {i}: PD {g} != colocated {e}"
        text = httpx.get(cluster.worker("prefill-0")["url"] + "/metrics", timeout=10).text
        hit = _metric(text, "pdcluster_prefix_cache_hit_tokens_total")
        lookup = _metric(text, "pdcluster_prefix_cache_lookup_tokens_total")
        # At least the serial hits: 6 full pages (96 tokens) twice, 2 pages
        # (32), and the repeat's 6 pages.
        assert hit >= 96 + 96 + 32 + 96, text
        assert lookup == sum(len(p) for p in serial + burst)
        assert _metric(text, "pdcluster_prefix_cache_pages") > 0
        assert_no_page_leak(cluster)


def _counter(text: str, name: str) -> float:
    """A counter's value, 0 when it was never incremented (a labelled one not exported yet)."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return 0.0 if match is None else float(match.group(1))


_IN_BYTES = 'pdcluster_transfer_bytes_total{direction="in"}'
_OUT_BYTES = 'pdcluster_transfer_bytes_total{direction="out"}'


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "decode", "prefill_cache"),
    [
        ("tcp", {}, False),  # the prefill's cache off: decode reuse alone
        ("shm", {"topology": {"tp": 2}}, True),  # every decode rank keeps the same pages
        ("nixl", {}, True),  # one-sided writes into decode pages past the reused ones
    ],
    ids=["tcp-decode-tp1", "shm-decode-tp2", "nixl-decode-tp1"],
)
def test_decode_reuses_the_pages_it_holds_and_output_equals_colocated(
    backend: str, decode: dict, prefill_cache: bool, tmp_path: Path
) -> None:
    if backend == "nixl":
        need_nixl()
    page_size = 16
    spec = {
        "model": {"name": "tiny", "computeDtype": "float64"},
        # A small pool: decode's cached pages are evicted to admit later prompts.
        "kvCache": {"pageSize": page_size, "numPages": 28, "dtype": "float64"},
        "transfer": {"backend": backend},
        "prefill": {"engine": {"prefixCache": prefill_cache}},
        "decode": {**decode, "engine": {"prefixCache": True}},
    }
    manifest = write_manifest(tmp_path, "dreuse", spec)
    rng = random.Random(33)
    system = [rng.randrange(1, 256) for _ in range(100)]  # 6 full pages + 4 tokens

    def tail(n: int) -> list[int]:
        return [rng.randrange(1, 256) for _ in range(n)]

    # (prompt, pages decode may reuse): a miss, every full page of the shared
    # 100 tokens, the shared prompt itself, some pages, an unrelated prompt,
    # an exact repeat, a page-aligned prefix (its last page travels).
    cases = [
        (system + tail(9), 0),
        (system + tail(30), 6),
        (list(system), 6),
        (system[:40] + tail(5), 2),
        (tail(50), 0),
    ]
    cases.append((list(cases[0][0]), 6))
    cases.append((system[:96], 5))
    # Unrelated prompts that need most of the pool evict what decode cached;
    # the shared prompt then comes back to a cold decode.
    evicting = [tail(300) for _ in range(2)]
    after = [system + tail(3)]
    prompts = [p for p, _ in cases] + evicting + after
    expected = colocated_outputs(load_manifest(str(manifest)), prompts, MAX_TOKENS)
    with local_cluster(manifest, tmp_path / "state") as cluster:
        url = cluster.worker("decode-0")["url"] + "/metrics"
        prefill_url = cluster.worker("prefill-0")["url"] + "/metrics"
        got, moved, reused, sent_out = [], [], [], []
        for prompt in prompts:
            before = httpx.get(url, timeout=10).text
            out_before = _counter(httpx.get(prefill_url, timeout=10).text, _OUT_BYTES)
            got.append(generate(cluster.endpoint, prompt))
            now = httpx.get(url, timeout=10).text
            moved.append(_counter(now, _IN_BYTES) - _counter(before, _IN_BYTES))
            out_now = _counter(httpx.get(prefill_url, timeout=10).text, _OUT_BYTES)
            sent_out.append(out_now - out_before)
            name = "pdcluster_decode_reuse_pages_total"
            reused.append(_counter(now, name) - _counter(before, name))
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"prompt {i}: PD with decode reuse {g} != colocated {e}"
        # Prefill counts what it sent, not the whole prompt: both ends agree.
        assert sent_out == moved
        per_token = moved[0] / len(prompts[0])  # the first prompt moved all of its KV
        for i, (prompt, pages) in enumerate(cases):
            assert reused[i] == pages, f"prompt {i}: reused {reused[i]} pages, not {pages}"
            sent = len(prompt) - pages * page_size
            assert moved[i] == pytest.approx(sent * per_token), f"prompt {i}"
        # The repeat moved a fraction of what the first prompt did.
        assert moved[5] < 0.2 * moved[0]
        # Evicted: the shared prompt travels whole again and still decodes right.
        assert reused[-1] == 0 and moved[-1] == pytest.approx(len(after[0]) * per_token)
        assert_no_page_leak(cluster)


# ---- every example topology: caching on == caching off, in float64 -----------

_ROOT = Path(__file__).resolve().parents[2]
# Every PD example but pd-1p1d-nixl (shown above as written, both roles cached,
# a small pool: nixl-decode-tp1), which test_topologies then no longer runs as
# written, and the colocated one.
# 2P2D is left out: test_cache_aware_pd.py runs 2P2D in float64 with every cache
# on (outputs == colocated), test_topologies.py 64 concurrent requests on it, and
# bursts and evictions with caches on run here on every other topology.
_TOPOLOGY_EXAMPLES = ["colocated.yaml", *sorted(FLOAT64_ELSEWHERE - {"pd-2p2d.yaml"})]
# These run here over nixl, not as written (tcp): one cluster start covers the
# topology in float64 with every cache on and on nixl, which test_topologies.py
# then does not start again. Their tcp path runs elsewhere:
# - pd-prefill-cp2: test_prefill_with_the_prefix_cache_equals_colocated[prefill-cp2];
# - pd-prefill-dp2: the dp2 cluster of test_handshake_rules.py (each dp group
#   served like colocated);
# - pd-prefill-tp2-2pods: tests/local/test_multi_pod.py, as written.
ON_NIXL_HERE = frozenset(
    {"pd-prefill-cp2.yaml", "pd-prefill-dp2.yaml", "pd-prefill-tp2-2pods.yaml"}
)
# One multi-rank prefill instance: its leader's hit and lookup counts are exact.
_PREFILL_HITS_CHECKED = frozenset({"pd-prefill-tp2-decode-tp1.yaml", "pd-prefill-cp2.yaml"})
_SMALL_POOL = 40  # pages of 16 tokens: the two 600-token prompts evict what came before


def _float64_copy(example: str, tmp_path: Path) -> Path:
    """The example in float64 with the prefix cache on for every role and a small pool
    (over nixl for the examples in ON_NIXL_HERE)."""
    doc = yaml.safe_load((_ROOT / "examples" / example).read_text())
    spec = doc["spec"]
    if example in ON_NIXL_HERE:
        spec["transfer"] = {**(spec.get("transfer") or {}), "backend": "nixl"}
    spec["model"] = {**spec.get("model", {}), "computeDtype": "float64"}
    spec["kvCache"] = {**spec.get("kvCache", {}), "dtype": "float64", "numPages": _SMALL_POOL}
    for role in ("prefill", "decode", "colocated"):
        if role in spec:
            role_spec = spec[role] or {}
            role_spec["engine"] = {**role_spec.get("engine", {}), "prefixCache": True}
            spec[role] = role_spec
    if "nixl" in yaml.safe_dump(spec):
        need_nixl()
    copy = tmp_path / f"float64-{example}"
    copy.write_text(yaml.safe_dump(doc))
    return copy


def _uncached_outputs(manifest: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of one in-process colocated engine with no prefix cache."""
    spec = load_manifest(str(manifest)).spec
    role = spec.decode or spec.colocated
    assert role is not None
    cfg = engine_config_from_spec(spec, role)
    need = sum(-(-(len(p) + MAX_TOKENS) // cfg.page_size) for p in prompts)
    cfg = replace(cfg, parallel=ParallelConfig(), num_pages=need + 8, prefix_cache=False)
    engine = LLMEngine(cfg)
    assert not engine.prefix_cache_stats().cached_pages
    return greedy_outputs(engine, prompts, MAX_TOKENS)


def _sum_over_workers(cluster: RunningCluster, name: str) -> float:
    """A counter summed over every worker process (each dp group and pod leader)."""
    total = 0.0
    for proc in cluster.state["processes"]:
        if proc["role"] != "router" and proc.get("url"):
            total += _counter(httpx.get(proc["url"] + "/metrics", timeout=10).text, name)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("example", _TOPOLOGY_EXAMPLES)
def test_caching_on_equals_caching_off_on_every_example_topology(
    example: str, tmp_path: Path
) -> None:
    manifest = _float64_copy(example, tmp_path)
    rng = random.Random(55)
    system = [rng.randrange(1, 256) for _ in range(100)]  # 6 full pages + 4 tokens

    def tail(n: int) -> list[int]:
        return [rng.randrange(1, 256) for _ in range(n)]

    # One at a time: a miss, every full page of the shared 100 tokens, the
    # shared prompt itself, some pages, an unrelated prompt, an exact repeat,
    # a page-aligned prefix. Then a burst sharing the prompt, then two long
    # unrelated prompts that evict what every role cached, then the shared
    # prompt again on cold caches, and a repeat of one of those.
    serial = [system + tail(9), system + tail(30), list(system), system[:40] + tail(5), tail(50)]
    serial += [list(serial[0]), system[:96]]
    burst = [system + tail(rng.randrange(0, 30)) for _ in range(6)]
    evicting = [tail(600) for _ in range(2)]
    after = [system + tail(3), system[:64] + tail(20)]
    after.append(list(after[0]))
    prompts = serial + burst + evicting + after
    expected = _uncached_outputs(manifest, prompts)
    with local_cluster(manifest, tmp_path / "state") as cluster:
        got = [generate(cluster.endpoint, p) for p in prompts[: len(serial)]]
        if example in _PREFILL_HITS_CHECKED:
            # A multi-rank prefill follows its leader's plan: at least the serial hits,
            # 6 full pages of the shared 100 tokens twice, 2 pages (32), the repeat's 6;
            # one lookup per serial prompt (no burst yet, so nothing was readmitted).
            text = httpx.get(cluster.worker("prefill-0")["url"] + "/metrics", timeout=10).text
            assert _metric(text, "pdcluster_prefix_cache_hit_tokens_total") >= 96 + 96 + 32 + 96
            lookup = _metric(text, "pdcluster_prefix_cache_lookup_tokens_total")
            assert lookup == sum(len(p) for p in serial), text
        got += generate_all(cluster, burst, 3)
        evictions_before = _sum_over_workers(cluster, "pdcluster_prefix_cache_evictions_total")
        got += [generate(cluster.endpoint, p) for p in evicting + after]
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"prompt {i}: caching on {g} != caching off {e}"
        # Caching was on and used: prefill (or colocated) hit its cache,
        # decode reused pages it held, and the long prompts evicted cached pages.
        assert _sum_over_workers(cluster, "pdcluster_prefix_cache_hit_tokens_total") > 0
        if any(proc["role"] == "decode" for proc in cluster.state["processes"]):
            assert _sum_over_workers(cluster, "pdcluster_decode_reuse_pages_total") > 0
        evictions = _sum_over_workers(cluster, "pdcluster_prefix_cache_evictions_total")
        assert evictions > evictions_before
        if example == "pd-prefill-dp2.yaml":
            # Each dp group caches on its own and the router reaches group 0
            # only: the worker publishes no key set, so no router index can
            # disagree with a group's cache (cache_aware routes it by load).
            url = cluster.worker("prefill-0")["url"] + "/prefix_cache/snapshot"
            assert httpx.get(url, headers=cluster.auth, timeout=10).status_code == 404
        assert_no_page_leak(cluster)
