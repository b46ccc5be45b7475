"""PD with the prefix cache on for prefill: prefill computes only the uncached
suffix (every rank of a multi-rank prefill follows the leader's plan, so all
agree on the hits) and still delivers the whole prompt's KV, so decode's output equals
colocated output token for token; the prefill worker's metrics show the
reuse, and no page leaks on either side (cached pages count as free).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import httpx
import pytest

from pdcluster.runtime.cli import load_manifest
from tests.local.cluster import local_cluster, write_manifest
from tests.pd_integration.reference import colocated_outputs
from tests.pd_integration.test_topologies import (
    MAX_TOKENS,
    assert_no_page_leak,
    generate,
    generate_all,
)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not exported"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.parametrize(
    "prefill",
    # Multi-rank prefills only: every rank must agree on the hits (a single-rank
    # engine's cache is covered in-process by tests/engine/test_prefix_cache_engine.py).
    [{"topology": {"tp": 2}}, {"topology": {"cp": 2}}],
    ids=["prefill-tp2", "prefill-cp2"],
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
