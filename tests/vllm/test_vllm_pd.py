"""Stock vLLM prefill and decode (NixlConnector) behind our router, in local mode.

One cluster for the module: `pdcluster up` on a `kind: vllm` manifest with
two prefill instances and one decode (real `vllm serve` processes from the
cached vLLM CPU environment, the tiny random Llama). The colocated
reference is the same decode vLLM answering the request alone (no
`kv_transfer_params`): greedy, so PD must give the same tokens.

- interop: `/v1/completions` and `/v1/chat/completions`, streamed and not,
  through the official `openai` client on 2P1D (both prefills in turn):
  tokens equal colocated, and the decode really read the KV (its NIXL reads
  count up); 1P1D is the Kubernetes journey's (e2e/test_vllm_journey.py);
- a client that leaves mid-stream or mid-prefill leaves no request running
  or waiting and no KV block held on any vLLM (their own metrics);
- kill -9 of a prefill during a burst: requests that already stream finish
  unchanged; those still waiting for its KV start again on the other prefill
  at once (same tokens); with no other prefill they end at once with a 502
  naming the lost worker; the decode keeps serving with nothing held; the
  supervisor restarts the prefills (`pdcluster ps`).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.local.cluster import RunningCluster, local_cluster, ps_rows, write_manifest
from tests.vllm.harness import MODEL_NAME, is_idle, read_metrics, vllm_spec, wait_for

# The module's cluster starts inside the first test's time.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 10
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox and a dog. " * 8}]
# vLLM starts slowly on a busy 2-core box; the launcher waits this long.
READY_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, vllm_python: str, vllm_model: Path
) -> Iterator[RunningCluster]:
    tmp = tmp_path_factory.mktemp("vllm-pd")
    manifest = write_manifest(tmp, "vllm-2p1d", vllm_spec(vllm_model, prefills=2))
    state = tmp / "state"
    state.mkdir()
    args = ["--vllm", vllm_python, "--ready-timeout", str(READY_TIMEOUT_S)]
    with local_cluster(manifest, state, timeout=READY_TIMEOUT_S + 60, args=args) as running:
        yield running


def url_of(cluster: RunningCluster, name: str) -> str:
    return str(cluster.worker(name)["url"])


def client(cluster: RunningCluster, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.endpoint + "/v1", api_key="unused", **kwargs)


def generate(
    cluster: RunningCluster, endpoint: str, stream: bool, max_tokens: int = 16
) -> list[int]:
    """The output token ids of one greedy request through the router."""
    oai = client(cluster, timeout=300)
    extra = {"return_token_ids": True}
    if endpoint == "completions":
        if not stream:
            c = oai.completions.create(
                model=MODEL_NAME,
                prompt=PROMPT,
                max_tokens=max_tokens,
                temperature=0,
                extra_body=extra,
            )
            return list(c.choices[0].model_extra["token_ids"])
        ids: list[int] = []
        for chunk in oai.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body=extra,
        ):
            ids += chunk.choices[0].model_extra.get("token_ids") or []
        return ids
    if not stream:
        r = oai.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=max_tokens,
            temperature=0,
            extra_body=extra,
        )
        return list(r.choices[0].model_extra["token_ids"])
    ids = []
    for chunk in oai.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,  # type: ignore[arg-type]
        stream=True,
        extra_body=extra,
    ):
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
    return ids


def colocated(cluster: RunningCluster, endpoint: str, max_tokens: int = 16) -> list[int]:
    """The same request served by the decode vLLM alone (no kv_transfer_params)."""
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0}
    body["return_token_ids"] = True
    if endpoint == "completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = MESSAGES
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    resp = httpx.post(
        url_of(cluster, "decode-0") + path,
        json=body,
        headers=cluster.auth,
        timeout=300,
    )
    resp.raise_for_status()
    return list(resp.json()["choices"][0]["token_ids"])


def router_health(cluster: RunningCluster) -> dict[str, bool]:
    workers = httpx.get(cluster.endpoint + "/health", timeout=10).json()["workers"]
    return {w["url"]: w["healthy"] for w in workers}


CASES = [(e, s) for e in ("completions", "chat") for s in (False, True)]


def test_pd_output_equals_colocated_on_2p1d(cluster: RunningCluster) -> None:
    """Each endpoint, streamed and not, through the router: the decode's own tokens.
    (1P1D runs the same four cases on Kubernetes: e2e/test_vllm_journey.py.)"""
    reference = {e: colocated(cluster, e) for e in ("completions", "chat")}
    decode = url_of(cluster, "decode-0")
    prefills = [url_of(cluster, f"prefill-{i}") for i in range(2)]
    reads = read_metrics(decode).kv_reads
    served = [read_metrics(p).prompt_tokens for p in prefills]
    table = {(e, s): generate(cluster, e, s) == reference[e] for e, s in CASES}
    assert table == dict.fromkeys(CASES, True), table
    assert read_metrics(decode).kv_reads >= reads + len(CASES), "the decode read the KV"
    # Round robin: the four requests went to both prefills.
    grew = [read_metrics(p).prompt_tokens > b for p, b in zip(prefills, served, strict=True)]
    assert grew == [True, True]


def test_a_client_leaving_leaves_nothing_running_or_held(cluster: RunningCluster) -> None:
    oai = client(cluster, timeout=300)
    # Mid-stream: a few tokens of a long answer, then the client goes.
    stream = oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=500, temperature=0, stream=True
    )
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    # Mid-prefill: a request given up 0.3 s after it was sent.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            cluster.endpoint + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": PROMPT * 2, "max_tokens": 500},
            timeout=0.3,
        )
    for name in ("prefill-0", "prefill-1", "decode-0"):
        url = url_of(cluster, name)
        # A prefill keeps the blocks a decode never read for vLLM's KV lease (30 s).
        wait_for(lambda url=url: is_idle(url), 45, f"{name} idle with no KV held")


def prompt_of(i: int) -> str:
    """A prompt no other request shares (no prefix-cache hit: each prefill computes)."""
    return f"Request {i}: " + PROMPT


def burst(cluster: RunningCluster, first: int, n: int) -> list[concurrent.futures.Future[Any]]:
    """`n` streamed requests at once (prompts `first`..), each read to its end."""
    pool = concurrent.futures.ThreadPoolExecutor(n)

    def one(i: int) -> dict[str, Any]:
        out: dict[str, Any] = {"i": i, "ids": []}
        body = {
            "model": MODEL_NAME,
            "prompt": prompt_of(i),
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        url = cluster.endpoint + "/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=300) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = json.loads(r.read())["error"]["message"]
            for line in r.iter_lines() if r.status_code == 200 else ():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]["message"]
                else:
                    out["ids"] += event["choices"][0].get("token_ids") or []
        out["ended_at"] = time.monotonic()
        return out

    futures = [pool.submit(one, i) for i in range(first, first + n)]
    pool.shutdown(wait=False)
    return futures


def colocated_ids(cluster: RunningCluster, i: int) -> list[int]:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt_of(i),
        "max_tokens": 24,
        "temperature": 0,
        "return_token_ids": True,
    }
    decode = url_of(cluster, "decode-0")
    resp = httpx.post(decode + "/v1/completions", json=body, headers=cluster.auth, timeout=300)
    resp.raise_for_status()
    return list(resp.json()["choices"][0]["token_ids"])


def kill_during_burst(
    cluster: RunningCluster, name: str, first: int, n: int
) -> tuple[list[concurrent.futures.Future[Any]], float]:
    """A burst of `n` requests, and kill -9 of the instance's process group (the pod
    dies) while prefill legs are in flight on it: its futures, and when it died.

    The instance is frozen (SIGSTOP) before the burst, so its legs stay in flight
    until the kill: a prefill leg of these short prompts takes less than the
    router's /health poll below, and a burst could otherwise end unseen.
    """
    url, pid = url_of(cluster, name), int(cluster.worker(name)["pid"])

    def busy() -> bool:
        workers = httpx.get(cluster.endpoint + "/health", timeout=10).json()["workers"]
        return any(w["url"] == url and w["outstanding"] > 0 for w in workers)

    os.killpg(pid, signal.SIGSTOP)
    try:
        futures = burst(cluster, first, n)
        wait_for(busy, 60, f"a prefill leg on {name}")
    finally:
        os.killpg(pid, signal.SIGKILL)
    return futures, time.monotonic()


def test_kill_9_of_a_prefill_during_a_burst(cluster: RunningCluster) -> None:
    reference = {i: colocated_ids(cluster, i) for i in range(8)}
    decode = url_of(cluster, "decode-0")

    # Two prefills: the killed one's requests start again on the other, and the
    # decode serves them all (same tokens as alone).
    futures, _ = kill_during_burst(cluster, "prefill-0", 0, 5)
    results = [f.result(timeout=600) for f in futures]
    assert [r["status"] for r in results] == [200] * 5, results
    assert [r["ids"] for r in results] == [reference[i] for i in range(5)]
    metrics = httpx.get(cluster.endpoint + "/metrics", timeout=10).text
    assert 'pdcluster_router_leg_failures_total{reason="prefill_lost",role="prefill"}' in metrics

    # One prefill left (prefill-0 restarts): killing it ends the requests still
    # waiting for its KV at once, with an error naming it, and none hangs; a
    # request the restarted prefill-0 took, if it is back by then, is served
    # unchanged.
    lost = url_of(cluster, "prefill-1")
    futures, killed_at = kill_during_burst(cluster, "prefill-1", 5, 3)
    results = [f.result(timeout=600) for f in futures]
    failed = [r for r in results if "error" in r]
    assert failed, "a prefill leg was in flight on the killed prefill"
    for r in failed:
        if r["status"] != 200:
            # Waiting for the prefill leg: the router ends it, naming the pod.
            assert r["status"] == 502 and lost in r["error"] and "lost" in r["error"], r
        else:
            # Its decode leg had already started reading the KV: the decode's
            # failed load ends the stream with vLLM's error (policy `fail`).
            assert not r["ids"], r
        assert r["ended_at"] - killed_at < 10, "ended at once, not at vLLM's timeouts"
    for r in results:
        if "error" not in r:
            assert r["ids"] == reference[r["i"]]

    # The decode is unharmed (nothing running or held) and both prefills are being
    # restarted by the supervisor, as `pdcluster ps` shows (a vLLM start takes
    # minutes here; the e2e journey waits for one to serve again).
    wait_for(lambda: is_idle(decode), 45, "decode idle with no KV held")

    # The supervisor notices an exit on its next poll and may be in its restart
    # backoff when the decode goes idle: wait for both restarts to show.
    def both_restarted() -> bool:
        rows = ps_rows(cluster.state_dir)
        return all(
            rows[n]["RESTARTS"] == "1" and rows[n]["ALIVE"] == "yes"
            for n in ("prefill-0", "prefill-1")
        )

    wait_for(both_restarted, 60, "both prefills restarted once")
    rows = ps_rows(cluster.state_dir)
    assert rows["decode-0"]["STATE"] == "running" and rows["decode-0"]["RESTARTS"] == "0"
    for name in ("prefill-0", "prefill-1"):
        assert rows[name]["LAST EXIT"] == "killed by SIGKILL"
