"""The worker API's guards: the cluster token, streamed body limits, stop-id cap.

A worker created with a token refuses its data plane (`/generate`,
`/abort_request`, `/v1/*`) and its detailed info without that token; an
`abort_all` without it aborts nothing. `/health`, `/metrics` and the model
info stay open. `auth.workerApi: open` opens the data plane only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from pdcluster.runtime.engine.engine import LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.tokenizer import load_tokenizer
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.server.colocated import ColocatedBackend
from pdcluster.runtime.server.worker_app import MAX_STOP_TOKEN_IDS, WorkerInfo, create_worker_app
from pdcluster.runtime.serving.engine_service import EngineService

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY_LIMIT = 64 * 1024


@contextmanager
def _serving(**app_kw: object) -> Iterator[tuple[TestClient, EngineService]]:
    """A tiny colocated worker app with the cluster token, its engine running."""
    cfg = EngineConfig(num_pages=64, page_size=8, max_prompt_tokens=200, max_new_tokens=64)
    engine = LLMEngine(cfg)
    tok = load_tokenizer("tiny", engine.model_config.eos_token_id)
    info = WorkerInfo("tiny", "tiny", 200, 64, engine.model_config.vocab_size)
    service = EngineService(engine, tok)
    app = create_worker_app(
        ColocatedBackend(service),
        tok,  # type: ignore[arg-type]
        info,
        WorkerMetrics("null"),
        token=TOKEN,
        **app_kw,  # type: ignore[arg-type]
    )
    service.start()
    try:
        with TestClient(app) as client:
            yield client, service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[TestClient, EngineService]]:
    with _serving(max_body_bytes=BODY_LIMIT) as served:
        yield served


def gen(max_tokens: int = 4, **sp: object) -> dict[str, object]:
    return {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, **sp},
    }


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/generate", gen()),
        ("POST", "/abort_request", {"abort_all": True}),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("GET", "/v1/models", None),
        ("GET", "/get_server_info", None),
        ("GET", "/server_info", None),
    ],
)
def test_data_plane_and_info_need_the_token(guarded, method, path, body) -> None:
    client, _ = guarded
    missing = client.request(method, path, json=body)
    assert missing.status_code == 401, missing.text
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = client.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403
    right = client.request(method, path, json=body, headers=AUTH)
    assert right.status_code == 200, right.text


def test_abort_all_without_the_token_aborts_nothing(guarded) -> None:
    client, service = guarded
    result: dict[str, object] = {}

    def run() -> None:
        resp = client.post("/generate", json=gen(60, ignore_eos=True), headers=AUTH)
        result["body"] = resp.json()

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 5
    while not service._tracked and time.monotonic() < deadline:
        time.sleep(0.005)
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 401
    t.join(30)
    body = result["body"]
    assert isinstance(body, dict)
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    assert len(body["output_ids"]) == 60


def test_open_endpoints_name_no_peer(guarded) -> None:
    client, _ = guarded
    for path in ("/health", "/health_generate", "/metrics", "/model_info", "/get_model_info"):
        assert client.get(path).status_code == 200, path
    info = client.get("/get_server_info", headers=AUTH).json()
    health = client.get("/health").text + client.get("/metrics").text
    for value in info.values():
        if isinstance(value, str) and ("tcp://" in value or ":" in value):
            assert value not in health


def test_a_chunked_body_over_the_limit_is_refused_while_streaming(guarded) -> None:
    client, _ = guarded
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        for _ in range(9 * 16):  # 9 MiB in 64 KiB chunks, no Content-Length
            sent += 1
            yield b" " * 65536

    resp = client.post(
        "/generate", content=chunks(), headers={**AUTH, "content-type": "application/json"}
    )
    assert resp.status_code == 413
    assert f"over {BODY_LIMIT} bytes" in resp.json()["error"]["message"]


def test_stop_token_ids_are_capped(guarded) -> None:
    client, _ = guarded
    ok = client.post("/generate", json=gen(stop_token_ids=[1] * MAX_STOP_TOKEN_IDS), headers=AUTH)
    assert ok.status_code == 200
    over = client.post(
        "/generate", json=gen(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), headers=AUTH
    )
    assert over.status_code == 400
    assert f"at most {MAX_STOP_TOKEN_IDS}" in over.json()["error"]["message"]


def test_an_open_data_plane_still_guards_the_info() -> None:
    with _serving(data_plane_open=True) as (client, _):
        assert client.post("/generate", json=gen()).status_code == 200
        assert client.post("/abort_request", json={"rid": "x"}).status_code == 200
        assert client.get("/get_server_info").status_code == 401
