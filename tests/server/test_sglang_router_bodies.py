"""The bodies SGLang's PD router sends are accepted as they are, and its info reads answer.

Captured from `sglang-router` 0.3.2 (bootstrap fields left out: this is a
colocated worker). It sends `model: null` and booleans we do not use; a
worker must neither refuse them nor let them change the answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdcluster.runtime.engine.tokenizer import load_tokenizer
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.server.worker_app import WorkerInfo, create_worker_app
from pdcluster.runtime.serving.engine_service import TokenEvent
from pdcluster.runtime.serving.request import PreparedRequest

EXTRAS: dict[str, Any] = {
    "model": None,
    "return_text_in_logprobs": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "echo": False,
    "no_stop_trim": False,
    "skip_special_tokens": True,
}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": False}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        ),
    ],
    ids=["generate", "completions", "chat"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_router_body_with_null_model_and_extra_fields_is_served_unchanged(
    worker, path: str, body: dict[str, Any], stream: bool
) -> None:
    client, _ = worker
    sampling = {"temperature": 0} if path != "/generate" else {}
    plain = {**body, **sampling, "stream": stream}
    if path == "/generate":
        plain["sampling_params"] = {**body["sampling_params"], "temperature": 0}
    sent = {**plain, **EXTRAS}
    want = client.post(path, json=plain)
    got = client.post(path, json=sent)
    assert got.status_code == 200, got.text
    assert want.status_code == 200, want.text
    if stream:
        assert [ln for ln in got.text.splitlines() if ln.startswith("data: ")][-1] == "data: [DONE]"
        assert "error" not in got.text
    else:
        out, ref = got.json(), want.json()
        if path == "/generate":
            assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
        else:
            assert out["choices"] == ref["choices"]
            assert out["model"] == "tiny"  # null names the served model


def test_model_and_server_info_name_the_served_model(worker) -> None:
    client, _ = worker
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["served_model_name"] == "tiny" and info["is_generation"] is True
        assert info["vocab_size"] > 0 and info["max_req_input_len"] > 0
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["served_model_name"] == "tiny"
        assert info["disaggregation_mode"] == "null"


class _Recorder:
    """A backend that records what the HTTP layer prepared and answers one token."""

    role = "decode"

    def __init__(self) -> None:
        self.seen: list[PreparedRequest] = []

    def check(self, req: PreparedRequest) -> None:
        self.seen.append(req)

    async def events(self, req: PreparedRequest) -> AsyncIterator[TokenEvent]:
        yield TokenEvent([65], "A", True, "length")

    def abort(self, rid: str) -> None: ...

    def abort_all(self) -> None: ...

    def server_info(self) -> dict[str, Any]:
        return {}

    def is_healthy(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("path", "extra", "local"),
    [
        ("/generate", {}, True),
        ("/generate", {"rid": "caller-1"}, False),
        # A worker relaying to another dp group of its instance passes its own rid on.
        ("/generate", {"rid": "minted-1", "rid_is_local": True}, True),
        ("/v1/completions", {}, True),
        ("/v1/completions", {"rid": "caller-2"}, False),
        ("/v1/chat/completions", {}, True),
    ],
)
def test_a_rid_the_worker_mints_is_marked_local(
    path: str, extra: dict[str, Any], local: bool
) -> None:
    backend = _Recorder()
    info = WorkerInfo("tiny", "tiny", 64, 16, 320)  # the tiny vocabulary: bytes, BOS, EOS
    app = create_worker_app(backend, load_tokenizer("tiny"), info, WorkerMetrics("decode"))
    body: dict[str, Any] = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 5}
    if path == "/generate":
        body |= {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    elif path == "/v1/completions":
        body |= {"prompt": "hi", "max_tokens": 1}
    else:
        body |= {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with TestClient(app) as client:
        resp = client.post(path, json=body | extra)
    assert resp.status_code == 200, resp.text
    (req,) = backend.seen
    assert req.rid_is_local is local
    assert req.rid == extra.get("rid", req.rid) and req.rid
