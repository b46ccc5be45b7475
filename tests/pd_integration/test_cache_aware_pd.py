"""cache_aware through a real local cluster, two prefills and two decodes, each
with the prefix cache on and routed by cache_aware: requests sharing a system
prompt all reach the prefill that cached it (its hit counters say so; the
other prefill never hits that prompt) and the decode that holds it from the
first transfer (it reuses every full page and prefill sends only the rest),
outputs equal colocated output token for token, and the router's index
equals each worker's published key set. A router started later, with no
traffic of its own, gets the same index from the workers' snapshots.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from pdcluster.runtime.cli import load_manifest
from pdcluster.runtime.ports import free_port
from tests.local.cluster import RunningCluster, local_cluster, write_manifest
from tests.pd_integration.reference import colocated_outputs
from tests.pd_integration.test_topologies import MAX_TOKENS, assert_no_page_leak, generate

PAGE = 16
DEADLINE_S = 120.0  # generous: a loaded 2-core box


def _metric(text: str, name: str, **labels: str) -> float | None:
    for match in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    return None


def _wait_for(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _hits(cluster: RunningCluster, name: str) -> float:
    text = httpx.get(cluster.worker(name)["url"] + "/metrics", timeout=10).text
    value = _metric(text, "pdcluster_prefix_cache_hit_tokens_total")
    assert value is not None, text
    return value


def _published_pages(cluster: RunningCluster, name: str) -> int:
    url = cluster.worker(name)["url"] + "/prefix_cache/snapshot"
    resp = httpx.get(url, headers=cluster.auth, timeout=10)
    assert resp.status_code == 200, resp.text
    return len(resp.json()["keys"])


def _indexed_pages(router: str, worker_url: str) -> float | None:
    text = httpx.get(router + "/metrics", timeout=10).text
    return _metric(text, "pdcluster_router_prefix_index_pages", worker=worker_url)


WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
DECODES = ("decode-0", "decode-1")


def _reused(cluster: RunningCluster, name: str) -> float:
    """Prompt pages a decode reused instead of receiving (0 before the first)."""
    text = httpx.get(cluster.worker(name)["url"] + "/metrics", timeout=10).text
    return _metric(text, "pdcluster_decode_reuse_pages_total") or 0.0


def _index_matches_workers(cluster: RunningCluster, router: str) -> bool:
    for name in WORKERS:
        got = _indexed_pages(router, cluster.worker(name)["url"])
        if got is None or got != _published_pages(cluster, name):
            return False
    return True


@pytest.mark.slow
def test_cache_aware_sends_a_shared_prompt_to_the_prefill_and_decode_that_hold_it(
    tmp_path: Path,
) -> None:
    spec = {
        "model": {"name": "tiny", "computeDtype": "float64"},
        "kvCache": {"pageSize": PAGE, "numPages": 256, "dtype": "float64"},
        "prefill": {"replicas": 2, "engine": {"prefixCache": True}},
        "decode": {"replicas": 2, "engine": {"prefixCache": True}},
        "router": {"policy": {"prefill": "cache_aware", "decode": "cache_aware"}},
    }
    manifest = write_manifest(tmp_path, "aware", spec)
    rng = random.Random(7)
    systems = [[rng.randrange(1, 256) for _ in range(6 * PAGE)] for _ in range(2)]
    prompts = [
        system + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 20))]
        for _ in range(4)
        for system in systems
    ]
    expected = colocated_outputs(load_manifest(str(manifest)), prompts, MAX_TOKENS)
    with local_cluster(manifest, tmp_path / "state") as cluster:
        router = cluster.endpoint
        names = ("prefill-0", "prefill-1")
        _wait_for(
            "the router to follow every worker", lambda: _index_matches_workers(cluster, router)
        )
        got = []
        holder: dict[int, str] = {}
        decode_holder: dict[int, str] = {}
        for i, prompt in enumerate(prompts):
            before = {n: _hits(cluster, n) for n in names}
            reused_before = {n: _reused(cluster, n) for n in DECODES}
            published = {n: _published_pages(cluster, n) for n in WORKERS}
            got.append(generate(router, prompt))
            gained = {n: _hits(cluster, n) - before[n] for n in names}
            reused = {n: _reused(cluster, n) - reused_before[n] for n in DECODES}
            family = i % len(systems)
            if family not in holder:
                assert sum(gained.values()) == 0, f"prompt {i}: a first sight hit {gained}"
                assert sum(reused.values()) == 0, f"prompt {i}: a first sight reuse {reused}"
                # The workers that served it are the ones that published new keys.
                for role, held in ((names, holder), (DECODES, decode_holder)):
                    grew = [n for n in role if _published_pages(cluster, n) > published[n]]
                    assert len(grew) == 1, f"prompt {i}: keys published by {grew}"
                    held[family] = grew[0]
            else:
                # Every page of the shared prompt hit, on the prefill that held
                # it, and the decode that held it reused them all.
                assert gained == {n: (6 * PAGE if n == holder[family] else 0) for n in names}, (
                    f"prompt {i} (system prompt {family}): hits {gained}, holder {holder}"
                )
                assert reused == {n: (6 if n == decode_holder[family] else 0) for n in DECODES}, (
                    f"prompt {i} (system prompt {family}): reused {reused}, {decode_holder}"
                )
            # The next request must see this one's pages in the router's index.
            _wait_for(
                f"the index to catch up after prompt {i}",
                lambda: _index_matches_workers(cluster, router),
            )
        assert got == expected

        # A router that starts now, with no traffic of its own, builds the same
        # index from the workers' snapshots.
        port = free_port()
        late_url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PDCLUSTER_TOKEN": cluster.auth["Authorization"].split()[1]}
        argv = [sys.executable, "-m", "pdcluster.runtime.cli", "router", "-f", str(manifest)]
        argv += ["--port", str(port)]
        for name in WORKERS:
            role = name.split("-")[0]
            argv += [f"--{role}", cluster.worker(name)["url"]]
        log = open(tmp_path / "late-router.log", "wb")  # noqa: SIM115
        late = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:

            def late_ready() -> bool:
                assert late.poll() is None, (tmp_path / "late-router.log").read_text()
                try:
                    return httpx.get(late_url + "/health", timeout=5).status_code == 200
                except httpx.HTTPError:
                    return False

            _wait_for("the late router to serve", late_ready)
            _wait_for(
                "the late router's snapshots", lambda: _index_matches_workers(cluster, late_url)
            )
            # And it routes by them: a shared prompt goes to its holder at once.
            family = 1
            before = {n: _hits(cluster, n) for n in names}
            reused_before = {n: _reused(cluster, n) for n in DECODES}
            prompt = systems[family] + [3, 1, 4]
            out = generate(late_url, prompt)
            gained = {n: _hits(cluster, n) - before[n] for n in names}
            assert gained == {n: (6 * PAGE if n == holder[family] else 0) for n in names}
            reused = {n: _reused(cluster, n) - reused_before[n] for n in DECODES}
            assert reused == {n: (6 if n == decode_holder[family] else 0) for n in DECODES}
            assert out == colocated_outputs(load_manifest(str(manifest)), [prompt], MAX_TOKENS)[0]
        finally:
            late.send_signal(signal.SIGINT)
            try:
                late.wait(30)
            except subprocess.TimeoutExpired:
                late.kill()
                late.wait(10)
            log.close()
        assert_no_page_leak(cluster)


@pytest.mark.slow
def test_cache_aware_sends_repeats_to_the_colocated_worker_that_cached_them(
    tmp_path: Path,
) -> None:
    spec = {
        "model": {"name": "tiny", "computeDtype": "float64"},
        "kvCache": {"pageSize": PAGE, "numPages": 128, "dtype": "float64"},
        "colocated": {"replicas": 2, "engine": {"prefixCache": True}},
        "router": {"policy": {"decode": "cache_aware"}},  # colocated follows decode's
    }
    manifest = write_manifest(tmp_path, "aware-colocated", spec)
    rng = random.Random(11)
    systems = [[rng.randrange(1, 256) for _ in range(4 * PAGE)] for _ in range(2)]
    prompts = [system + [rng.randrange(1, 256), i] for i in range(3) for system in systems]
    expected = colocated_outputs(load_manifest(str(manifest)), prompts, MAX_TOKENS)
    with local_cluster(manifest, tmp_path / "state") as cluster:
        router = cluster.endpoint
        names = ("colocated-0", "colocated-1")

        def index_matches() -> bool:
            return all(
                _indexed_pages(router, cluster.worker(n)["url"]) == _published_pages(cluster, n)
                for n in names
            )

        _wait_for("the router to follow both workers", index_matches)
        got: list[list[int]] = []
        holder: dict[int, str] = {}
        for i, prompt in enumerate(prompts):
            before = {n: _hits(cluster, n) for n in names}
            published = {n: _published_pages(cluster, n) for n in names}
            got.append(generate(router, prompt))
            gained = {n: _hits(cluster, n) - before[n] for n in names}
            family = i % len(systems)
            if family in holder:
                assert gained == {n: (4 * PAGE if n == holder[family] else 0) for n in names}, (
                    f"prompt {i} (system prompt {family}): hits {gained}, holder {holder}"
                )
            else:
                assert sum(gained.values()) == 0, f"prompt {i}: a first sight hit {gained}"
                grew = [n for n in names if _published_pages(cluster, n) > published[n]]
                assert len(grew) == 1, f"prompt {i}: keys published by {grew}"
                holder[family] = grew[0]
            _wait_for(f"the index to catch up after prompt {i}", index_matches)
        assert got == expected
        assert_no_page_leak(cluster)
