"""SGLang's PD router (the `sglang-router` package) drives our prefill and decode workers.

One 2-prefill, 2-decode worker set runs as real local processes for the
whole module (the fault harness: workers can be killed one by one), with
two SGLang routers in PD mode in front of it: `1p1d` knows prefill-0 and
decode-0 only, `2p2d` knows all four. The routers run the way a user runs
them: `python -m sglang_router.launch_router --pd-disaggregation`, from a
directory outside the repository, on free ports (its `--prometheus-port`
default 29000 would clash between runs).

That router sends no rid, the same body to both legs (with its own
`bootstrap_room`), and returns decode's answer; it opens each decode
connection with an HTTP/2 preface. Outputs must equal a colocated engine's
(greedy), whatever the endpoint, stream or not.

Retries: both routers run with `--disable-retries` and
`--disable-circuit-breaker`, so a failed request is reported to the client
as it happened (not retried on another pair) and round robin keeps
alternating prefills — the kill -9 scenario counts its failures exactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from pdcluster.runtime.engine.engine import LLMEngine
from pdcluster.runtime.engine.engine_config import engine_config_from_spec
from pdcluster.runtime.engine.tokenizer import load_tokenizer
from pdcluster.runtime.engine.topology import ParallelConfig
from pdcluster.runtime.local.sglang_router import SGLangRouter, start_sglang_router
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.server.colocated import ColocatedBackend
from pdcluster.runtime.server.worker_app import WorkerInfo, create_worker_app
from pdcluster.runtime.serving.engine_service import EngineService
from tests.faults.harness import FaultCluster, base_spec, parse_counter, wait_until

pytestmark = pytest.mark.slow

PROMPTS = ["Hello", "The capital of France is", "x" * 300, "a b c d e f g"]
MAX_TOKENS = 8


def start_router(
    cluster: FaultCluster, prefills: list[str], decodes: list[str], tmp: Path
) -> SGLangRouter:
    return start_sglang_router(
        [(cluster.url(name), cluster.bootstrap(name)[1]) for name in prefills],
        [cluster.url(name) for name in decodes],
        cluster.token,
        tmp,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    spec = base_spec()
    spec["prefill"]["replicas"] = 2
    spec["decode"]["replicas"] = 2
    with FaultCluster(tmp_path_factory.mktemp("interop"), "interop-2p2d", spec) as c:
        yield c


@pytest.fixture(scope="module")
def routers(
    cluster: FaultCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, SGLangRouter]]:
    tmp = tmp_path_factory.mktemp("sglang-router")
    started: dict[str, SGLangRouter] = {}
    try:
        started["1p1d"] = start_router(cluster, ["prefill-0"], ["decode-0"], tmp)
        started["2p2d"] = start_router(
            cluster, cluster.workers("prefill"), cluster.workers("decode"), tmp
        )
        yield started
    finally:
        for router in started.values():
            router.stop()


@pytest.fixture(scope="module")
def colocated(cluster: FaultCluster) -> Iterator[TestClient]:
    """A colocated worker, in-process, with the cluster's engine settings: the reference."""
    spec = cluster.manifest.spec
    assert spec.decode is not None
    cfg = replace(engine_config_from_spec(spec, spec.decode), parallel=ParallelConfig())
    engine = LLMEngine(cfg)
    tok = load_tokenizer(cfg.model, engine.model_config.eos_token_id)
    service = EngineService(engine, tok)
    info = WorkerInfo(
        "tiny", "tiny", cfg.max_prompt_tokens, cfg.max_new_tokens, engine.model_config.vocab_size
    )
    app = create_worker_app(ColocatedBackend(service), tok, info, WorkerMetrics("null"))
    service.start()
    with TestClient(app) as client:
        yield client
    service.stop()


def body_for(path: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    if path == "/generate":
        sampling = {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True}
        return {"text": prompt, "sampling_params": sampling, "stream": stream}
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def answer_text(path: str, resp: httpx.Response | Any, stream: bool) -> tuple[str, list[int]]:
    """(text, output ids — /generate only) of a whole or streamed answer."""
    assert resp.status_code == 200, resp.text
    if not stream:
        data = resp.json()
        if path == "/generate":
            return data["text"], data["output_ids"]
        return data["choices"][0]["text"], []
    events = [
        json.loads(line[6:])
        for line in resp.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert events and not any("error" in e for e in events), resp.text
    if path == "/generate":  # cumulative: the last event holds everything
        return events[-1]["text"], events[-1]["output_ids"]
    return "".join(e["choices"][0]["text"] for e in events), []


def expected(colocated: TestClient, path: str, prompt: str, stream: bool) -> tuple[str, list[int]]:
    return answer_text(path, colocated.post(path, json=body_for(path, prompt, stream)), stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
@pytest.mark.parametrize("topology", ["1p1d", "2p2d"])
def test_outputs_through_sglang_router_equal_colocated(
    cluster: FaultCluster,
    routers: dict[str, SGLangRouter],
    colocated: TestClient,
    topology: str,
    path: str,
    stream: bool,
) -> None:
    url = routers[topology].url + path
    want = [expected(colocated, path, p, stream) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        resps = list(
            pool.map(
                lambda p: httpx.post(
                    url,
                    json=body_for(path, p, stream),
                    headers=routers[topology].headers,
                    timeout=60,
                ),
                PROMPTS,
            )
        )
    got = [answer_text(path, r, stream) for r in resps]
    for prompt, g, w in zip(PROMPTS, got, want, strict=True):
        assert g == w, f"{topology} {path} stream={stream} prompt {prompt[:20]!r}"
    cluster.assert_clean(cluster.workers())


def test_chat_through_sglang_router_equals_colocated(
    routers: dict[str, SGLangRouter], colocated: TestClient
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    want = colocated.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    resp = httpx.post(
        routers["2p2d"].url + "/v1/chat/completions",
        json=body,
        headers=routers["2p2d"].headers,
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"] == want


def test_sglang_router_names_the_model_our_workers_serve(
    routers: dict[str, SGLangRouter],
) -> None:
    # It reads `served_model_name` from the workers' /model_info (else "unknown").
    models = httpx.get(
        routers["2p2d"].url + "/v1/models", headers=routers["2p2d"].headers, timeout=10
    ).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_decode_answers_the_routers_http2_preface_without_a_warning(
    cluster: FaultCluster, routers: dict[str, SGLangRouter]
) -> None:
    for name in cluster.workers():
        assert "Invalid HTTP request" not in cluster.log(name, 2000), name


def _requests_by_reason(cluster: FaultCluster, name: str) -> dict[str, float]:
    text = cluster.http.get(cluster.url(name) + "/metrics").text
    return parse_counter(text, "pdcluster_requests", "reason")


def test_client_disconnect_through_sglang_router_frees_both_legs(
    cluster: FaultCluster, routers: dict[str, SGLangRouter]
) -> None:
    limit = int(cluster.info("decode-0")["max_new_tokens"])
    before = _requests_by_reason(cluster, "decode-0").get("client_disconnect", 0.0)
    body = body_for("/v1/completions", "Hello", stream=True, max_tokens=limit)
    with httpx.Client(timeout=30, headers=routers["1p1d"].headers) as client:
        with client.stream("POST", routers["1p1d"].url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "error" not in first
        # Leaving the block closes the connection mid-stream: the router drops both legs.
    wait_until(
        lambda: _requests_by_reason(cluster, "decode-0").get("client_disconnect", 0.0) > before,
        15,
        0.1,
        "decode-0 to abort the dropped request",
    )
    cluster.assert_clean(["prefill-0", "decode-0"])


def test_kill9_of_one_prefill_fails_only_its_requests(
    cluster: FaultCluster, routers: dict[str, SGLangRouter], colocated: TestClient
) -> None:
    # Last in the module: prefill-1 stays dead. Round robin over two prefills,
    # no retries, no circuit breaker: of 2n requests, exactly n go to prefill-1
    # (refused or failed) and n to prefill-0 (answered as colocated).
    cluster.kill("prefill-1")
    url = routers["2p2d"].url + "/generate"
    prompts = PROMPTS * 2
    want = [expected(colocated, "/generate", p, False) for p in prompts]
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        resps = list(
            pool.map(
                lambda p: httpx.post(
                    url,
                    json=body_for("/generate", p, False),
                    headers=routers["2p2d"].headers,
                    timeout=60,
                ),
                prompts,
            )
        )
    elapsed = time.monotonic() - started
    ok = [(p, r) for p, r in zip(range(len(prompts)), resps, strict=True) if r.status_code == 200]
    failed = [r for r in resps if r.status_code != 200]
    assert len(failed) == len(prompts) // 2, [(r.status_code, r.text[:200]) for r in resps]
    assert all(r.status_code >= 500 for r in failed)
    for i, r in ok:
        assert answer_text("/generate", r, False) == want[i]
    # Failures come from the dead peer's verdict or its timeouts, never a hang.
    settings = cluster.manifest.spec.transfer
    assert elapsed < settings.bootstrap_timeout_seconds + 10, elapsed
    cluster.assert_clean(["prefill-0", "decode-0", "decode-1"])
