"""The worker HTTP API as a client sees it: shapes, errors, aborts, stops."""

from __future__ import annotations

import json
import threading
import time

from pdcluster.runtime.autoscale.samples import parse_worker_metrics
from pdcluster.runtime.serving.engine_service import EngineService

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _free_pages(service: EngineService) -> int:
    return service.engine.num_free_pages


def test_generate_is_deterministic_and_shaped(worker) -> None:
    client, _ = worker
    body = {"text": "Hello there", "sampling_params": GREEDY, "rid": "g-1"}
    a = client.post("/generate", json=body).json()
    b = client.post("/generate", json={**body, "rid": "g-2"}).json()
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 12
    assert a["meta_info"]["id"] == "g-1"
    assert a["meta_info"]["completion_tokens"] == 12
    assert a["meta_info"]["finish_reason"] == {"type": "length"}
    other = client.post("/generate", json={**body, "text": "Something else", "rid": "g-3"}).json()
    assert other["output_ids"] != a["output_ids"]


def test_input_ids_and_text_agree(worker) -> None:
    client, service = worker
    ids = service.tokenizer.encode("abc")
    a = client.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    b = client.post("/generate", json={"text": "abc", "sampling_params": GREEDY}).json()
    assert a["output_ids"] == b["output_ids"]


def test_streaming_matches_non_streaming(worker) -> None:
    client, _ = worker
    body = {"text": "stream me", "sampling_params": GREEDY}
    full = client.post("/generate", json=body).json()
    events = []
    with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["output_ids"] == full["output_ids"]
    assert last["text"] == full["text"]


def test_openai_completion_and_chat_shapes(worker) -> None:
    client, _ = worker
    c = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0}
    ).json()
    assert c["object"] == "text_completion"
    assert c["usage"]["completion_tokens"] <= 5
    assert c["choices"][0]["finish_reason"] in {"stop", "length"}
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    ).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"


def test_stop_string_truncates_output(worker) -> None:
    client, _ = worker
    base = client.post("/generate", json={"text": "stop test", "sampling_params": GREEDY}).json()
    text = base["text"]
    # Pick a stop string from the middle of the greedy output.
    stop = next(
        (text[i : i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i : i + 2]), None
    )
    assert stop is not None, "greedy output too short to pick a stop string"
    cut = client.post(
        "/generate",
        json={"text": "stop test", "sampling_params": {**GREEDY, "stop": stop}},
    ).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop"}
    assert cut["text"] == text[: text.find(stop)]
    assert stop not in cut["text"]


def test_bad_bodies_are_rejected_and_change_nothing(worker) -> None:
    client, service = worker
    before = _free_pages(service)
    cases = [
        ("/generate", b"{not json", 422),
        ("/generate", json.dumps({"sampling_params": {}}).encode(), 422),
        ("/generate", json.dumps({"text": "a", "input_ids": [1]}).encode(), 422),
        (
            "/generate",
            json.dumps({"text": "a", "sampling_params": {"temperature": -1}}).encode(),
            422,
        ),
        ("/generate", json.dumps({"input_ids": [10**9]}).encode(), 400),
        ("/generate", json.dumps({"input_ids": []}).encode(), 400),
        (
            "/generate",
            json.dumps({"text": "a", "sampling_params": {"max_new_tokens": 10**6}}).encode(),
            400,
        ),
        ("/v1/completions", json.dumps({"prompt": 5}).encode(), 422),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 422),
        ("/abort_request", json.dumps({}).encode(), 422),
    ]
    for path, raw, code in cases:
        resp = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == code, (path, raw, resp.text)
        assert resp.json()["error"]["message"]
    assert _free_pages(service) == before


def test_oversized_prompt_and_body(worker) -> None:
    client, service = worker
    before = _free_pages(service)
    resp = client.post("/generate", json={"input_ids": [65] * 201})
    assert resp.status_code == 400 and "at most 200" in resp.json()["error"]["message"]
    resp = client.post("/generate", json={"text": "x" * 100_000})
    assert resp.status_code == 413
    assert _free_pages(service) == before


def test_abort_is_exact_and_frees_pages(worker) -> None:
    client, service = worker
    before = _free_pages(service)
    results: dict[str, dict] = {}
    long = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}

    def run(rid: str) -> None:
        results[rid] = client.post(
            "/generate", json={"text": "abort me " * 10, "sampling_params": long, "rid": rid}
        ).json()

    threads = [threading.Thread(target=run, args=(r,)) for r in ("req-1", "req-10")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while _free_pages(service) == before and time.monotonic() < deadline:
        time.sleep(0.005)
    assert client.post("/abort_request", json={"rid": "req-"}).json()["found"] is False
    assert client.post("/abort_request", json={"rid": "req-1"}).json()["found"] is True
    for t in threads:
        t.join(30)
    assert results["req-1"]["meta_info"]["finish_reason"] == {"type": "abort"}
    assert results["req-10"]["meta_info"]["finish_reason"] == {"type": "length"}
    assert len(results["req-10"]["output_ids"]) == 64
    assert _free_pages(service) == before


def test_info_endpoints(worker) -> None:
    client, service = worker
    assert client.get("/health").status_code == 200
    info = client.get("/get_server_info").json()
    assert info["disaggregation_mode"] == "null"
    assert info["num_total_pages"] == 64
    assert client.get("/get_model_info").json()["is_generation"] is True
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    metrics = client.get("/metrics").text
    assert "pdcluster_rejected_requests_total" in metrics


def test_a_finished_request_is_timed_per_output_token(worker) -> None:
    client, _ = worker

    def tpot_count() -> float:
        hist = parse_worker_metrics(client.get("/metrics").text).tpot
        return 0.0 if hist is None else hist.count

    before = tpot_count()
    client.post("/generate", json={"text": "time me", "sampling_params": GREEDY})
    one_token = {**GREEDY, "max_new_tokens": 1}
    client.post("/generate", json={"text": "one token", "sampling_params": one_token})
    assert tpot_count() == before + 1  # a single-token answer has no time per token
