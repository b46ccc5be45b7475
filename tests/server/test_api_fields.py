"""Sampling fields of the worker API: honoured (logprobs, penalties, usage in a
stream) or refused with a 400 naming them, never silently ignored."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdcluster.runtime.engine.engine import LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.tokenizer import load_tokenizer
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.server.colocated import ColocatedBackend
from pdcluster.runtime.server.worker_app import WorkerInfo, create_worker_app
from pdcluster.runtime.serving.engine_service import EngineService
from tests.engine.testing import write_chat_tokenizer, write_random_hf_dir

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}
GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/chat/completions", {"n": 2}, "n"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {}}]}, "tools"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/completions", {"n": 3}, "n"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("/generate", {"sampling_params": {"max_new_tokens": 4, "n": 2}}, "sampling_params.n"),
        ("/generate", {"sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
        ("/generate", {"logprob_start_len": 0}, "logprob_start_len"),
        ("/generate", {"lora_path": "adapter"}, "lora_path"),
    ],
)
def test_an_unsupported_field_is_a_400_naming_it(
    worker: Any, path: str, extra: dict[str, Any], field: str
) -> None:
    client, service = worker
    before = service.engine.num_free_pages
    base = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/generate": GENERATE}
    resp = client.post(path, json={**base[path], **extra})
    assert resp.status_code == 400, resp.text
    assert f"`{field}` is not supported" in resp.json()["error"]["message"]
    assert service.engine.num_free_pages == before


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (
            "/v1/chat/completions",
            {"n": 1, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
        ),
        ("/v1/completions", {"n": 1, "best_of": 1, "echo": False, "logit_bias": {}}),
        ("/generate", {"sampling_params": {"n": 1, "skip_special_tokens": True}}),
    ],
)
def test_neutral_values_of_those_fields_are_served(
    worker: Any, path: str, extra: dict[str, Any]
) -> None:
    client, _ = worker
    base = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/generate": GENERATE}
    assert client.post(path, json={**base[path], **extra}).status_code == 200


def _is_logprob(value: Any) -> bool:
    return isinstance(value, float) and value <= 0 and math.isfinite(value)


def test_logprobs_on_every_endpoint(worker: Any) -> None:
    client, _ = worker
    greedy = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
    chat = client.post(
        "/v1/chat/completions", json={**CHAT, **greedy, "logprobs": True, "top_logprobs": 3}
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] == 5
    for item in content:
        tops = item["top_logprobs"]
        assert len(tops) == 3 and _is_logprob(item["logprob"])
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert item["token"] == tops[0]["token"] and item["logprob"] == tops[0]["logprob"]
        assert item["bytes"] == list(item["token"].encode())
    assert "".join(item["token"] for item in content) == chat["choices"][0]["message"]["content"]

    completion = client.post("/v1/completions", json={**COMPLETION, **greedy, "logprobs": 2}).json()
    lp = completion["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(_is_logprob(v) for v in lp["token_logprobs"])
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])

    generate = client.post(
        "/generate",
        json={
            "text": "hi",
            "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    ).json()
    meta = generate["meta_info"]
    chosen = meta["output_token_logprobs"]
    assert [c[1] for c in chosen] == generate["output_ids"]
    assert all(_is_logprob(c[0]) and isinstance(c[2], str) for c in chosen)
    assert [len(t) for t in meta["output_top_logprobs"]] == [2] * 5
    # Without the flags the answers carry none.
    plain = client.post("/v1/completions", json={**COMPLETION, **greedy}).json()
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["text"] == completion["choices"][0]["text"]


def test_logprobs_stream_with_the_tokens_and_usage_comes_last(worker: Any) -> None:
    client, _ = worker
    body = {
        **CHAT,
        "temperature": 0,
        "max_tokens": 6,
        "ignore_eos": True,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    streamed = [
        item
        for c in chunks[:-1]
        for choice in c["choices"]
        if choice["logprobs"] is not None
        for item in choice["logprobs"]["content"]
    ]
    whole = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert streamed == whole["choices"][0]["logprobs"]["content"]


def test_penalties_reach_the_sampler(worker: Any) -> None:
    client, _ = worker
    greedy = {"text": "aaaa", "sampling_params": {"temperature": 0, "max_new_tokens": 16}}

    def tokens(**penalties: float) -> list[int]:
        body = json.loads(json.dumps(greedy))
        body["sampling_params"] |= penalties | {"ignore_eos": True}
        resp = client.post("/generate", json=body)
        assert resp.status_code == 200, resp.text
        ids: list[int] = resp.json()["output_ids"]
        return ids

    plain = tokens()
    assert len(set(plain)) < len(plain)  # greedy repeats itself on this prompt
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        penalised = tokens(**{name: 2.0})
        assert penalised == tokens(**{name: 2.0})  # deterministic
        assert penalised != plain, name
    strongest = tokens(presence_penalty=2.0, repetition_penalty=10.0)
    assert len(set(strongest)) > len(set(plain))
    resp = client.post("/v1/completions", json={**COMPLETION, "presence_penalty": 3.0})
    assert resp.status_code == 422 and "presence_penalty" in resp.json()["error"]["message"]


def test_the_openai_client_reads_logprobs_and_refusals(worker: Any) -> None:
    import openai

    client, _ = worker
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    chat = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 2 for t in logprobs.content)
    with pytest.raises(openai.BadRequestError, match="`response_format` is not supported"):
        api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_object"},
        )


@pytest.mark.parametrize("style", ["llama3", "qwen2"])
def test_a_chat_prompt_is_the_ids_transformers_builds(style: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    directory = write_random_hf_dir(tmp_path / "model", "llama" if style == "llama3" else "qwen2")
    write_chat_tokenizer(directory, style)
    engine = LLMEngine(EngineConfig(model=str(directory), num_pages=32, page_size=8))
    tok = load_tokenizer(directory, engine.model_config.eos_token_id)
    service = EngineService(engine, tok)
    info = WorkerInfo("m", str(directory), 200, 16, engine.model_config.vocab_size)
    app = create_worker_app(ColocatedBackend(service), tok, info, WorkerMetrics("null"))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}]
    want = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )["input_ids"]
    service.start()
    try:
        with TestClient(app) as client:
            body = {"messages": messages, "max_tokens": 2, "temperature": 0}
            resp = client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["prompt_tokens"] == len(want)
            ids = client.post(
                "/generate", json={"input_ids": want, "sampling_params": {"max_new_tokens": 2}}
            )
            assert ids.status_code == 200
    finally:
        service.stop()
