"""`vllm serve` with our connector behind our router, in local mode: the whole path.

One cluster for the module: `pdcluster up` on a `kind: vllm` manifest with
`kvConnector: PDClusterConnector` over tcp, one prefill and one decode (real
`vllm serve` processes from the cached vLLM CPU environment, the tiny random
Llama). The launcher gives each vLLM a side port, tells the decode the
prefill's, and the router pairs the legs by a room it mints (both legs at
once). The colocated reference is the prefill vLLM answering the request
alone (greedy: PD must give the same tokens).

- interop: `/v1/completions` and `/v1/chat/completions`, streamed and not,
  through the official `openai` client: tokens equal colocated, and the
  decode loaded the prompt's KV through our connector (its side port's counts);
- a client leaving mid-stream or mid-prefill: both legs end, neither vLLM
  runs, queues or holds a block, neither side port keeps a room;
- kill -9 of the prefill while the decode waits in a room for its KV: the
  local supervisor's report (`fail_peer` at the decode's side port) ends the
  request with an error and frees its blocks; the decode serves on; the
  supervisor restarts the prefill and the next request through the router
  gives the right tokens again (no stale peer state).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.local.cluster import RunningCluster, local_cluster, ps_rows, write_manifest
from tests.vllm.harness import MODEL_NAME, is_idle, vllm_spec, wait_for

# The module's cluster starts inside the first test's time.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 10
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox and a dog. " * 8}]
READY_TIMEOUT_S = 900
CASES = [(e, s) for e in ("completions", "chat") for s in (False, True)]


def our_spec(model_dir: Path) -> dict[str, Any]:
    spec = vllm_spec(model_dir)
    spec["engine"]["vllm"]["kvConnector"] = "PDClusterConnector"
    spec["transfer"] = {"backend": "tcp", "failurePolicy": "fail", "checksum": True}
    return spec


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, vllm_python: str, vllm_model: Path
) -> Iterator[RunningCluster]:
    tmp = tmp_path_factory.mktemp("vllm-ours")
    manifest = write_manifest(tmp, "vllm-ours", our_spec(vllm_model))
    state = tmp / "state"
    state.mkdir()
    args = ["--vllm", vllm_python, "--ready-timeout", str(READY_TIMEOUT_S)]
    with local_cluster(manifest, state, timeout=READY_TIMEOUT_S + 60, args=args) as running:
        yield running


def url_of(cluster: RunningCluster, name: str) -> str:
    return str(cluster.worker(name)["url"])


def side_of(cluster: RunningCluster, name: str) -> str:
    """The connector's side port of a vLLM process (bootstrap server, admin API)."""
    return f"http://127.0.0.1:{cluster.worker(name)['side_port']}"


def side_get(cluster: RunningCluster, name: str, path: str) -> Any:
    resp = httpx.get(side_of(cluster, name) + path, headers=cluster.auth, timeout=10)
    resp.raise_for_status()
    return resp.json()


def rooms_of(cluster: RunningCluster, name: str) -> list[Any]:
    return list(side_get(cluster, name, "/admin/rooms")["rooms"])


def loaded_tokens(cluster: RunningCluster) -> int:
    return int(side_get(cluster, "decode-0", "/get_server_info")["pd_stats"]["loaded_tokens"])


def generate(cluster: RunningCluster, endpoint: str, stream: bool) -> list[int]:
    """The output token ids of one greedy request through the router (openai client)."""
    oai = openai.OpenAI(base_url=cluster.endpoint + "/v1", api_key="unused", timeout=300)
    common: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {"return_token_ids": True},
    }
    ids: list[int] = []
    if endpoint == "completions":
        if not stream:
            c = oai.completions.create(prompt=PROMPT, **common)
            return list(c.choices[0].model_extra["token_ids"])
        for chunk in oai.completions.create(prompt=PROMPT, stream=True, **common):
            ids += chunk.choices[0].model_extra.get("token_ids") or []
        return ids
    if not stream:
        r = oai.chat.completions.create(messages=MESSAGES, **common)  # type: ignore[arg-type]
        return list(r.choices[0].model_extra["token_ids"])
    for part in oai.chat.completions.create(messages=MESSAGES, stream=True, **common):  # type: ignore[arg-type]
        if part.choices:
            ids += part.choices[0].model_extra.get("token_ids") or []
    return ids


def colocated(cluster: RunningCluster, endpoint: str) -> list[int]:
    """The same request served by the prefill vLLM alone (no kv_transfer_params)."""
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 16, "temperature": 0}
    body["return_token_ids"] = True
    if endpoint == "completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = MESSAGES
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    resp = httpx.post(
        url_of(cluster, "prefill-0") + path, json=body, headers=cluster.auth, timeout=300
    )
    resp.raise_for_status()
    return list(resp.json()["choices"][0]["token_ids"])


def assert_quiet(cluster: RunningCluster, timeout: float = 30) -> None:
    """No request running or waiting, no block held, no room left, on both vLLMs."""
    for name in ("prefill-0", "decode-0"):
        url = url_of(cluster, name)
        wait_for(lambda url=url: is_idle(url), timeout, f"{name} idle with no KV held")
        wait_for(lambda name=name: not rooms_of(cluster, name), timeout, f"{name} has no room")


def test_pd_through_the_router_equals_colocated_with_the_openai_client(
    cluster: RunningCluster,
) -> None:
    """Each endpoint, streamed and not: the tokens vLLM gives alone; the decode
    loaded the prompt's KV from the prefill through our connector."""
    before = loaded_tokens(cluster)
    table = {(e, s): generate(cluster, e, s) for e, s in CASES}
    reference = {e: colocated(cluster, e) for e in ("completions", "chat")}
    assert {k: v == reference[k[0]] for k, v in table.items()} == dict.fromkeys(CASES, True)
    # At least both prompts' KV, less the last token the decode computes itself.
    assert loaded_tokens(cluster) - before >= 2 * 64
    assert_quiet(cluster)


def test_a_client_leaving_ends_both_legs_and_leaves_no_room_or_block(
    cluster: RunningCluster,
) -> None:
    oai = openai.OpenAI(base_url=cluster.endpoint + "/v1", api_key="unused", timeout=300)
    # Mid-stream: a few tokens of a long answer, then the client goes.
    stream = oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=500, temperature=0, stream=True
    )
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    # Mid-prefill: a request given up 0.3 s after it was sent (its 500 tokens,
    # no early end of sequence from the random model, take longer).
    body = {"model": MODEL_NAME, "prompt": PROMPT * 2, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(cluster.endpoint + "/v1/completions", json=body, timeout=0.3)
    # Our prefill frees at the decode's ABORT, not after a lease.
    assert_quiet(cluster)


def test_a_killed_prefill_is_reported_the_waiting_room_fails_and_a_restart_serves(
    cluster: RunningCluster,
) -> None:
    """kill -9 of the prefill while the decode waits in a room for its KV (the
    prefill leg never comes): the supervisor tells the decode (fail_peer), the
    client gets vLLM's error at once, nothing is held, the decode serves on;
    the prefill restarts and PD through the router is right again."""
    reference = colocated(cluster, "completions")
    prefill = cluster.worker("prefill-0")
    params = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill["side_port"],
        "bootstrap_room": random.Random(34).randrange(1, 1 << 62),
    }
    body = {
        "model": MODEL_NAME,
        "prompt": "Waiting for a prefill that dies. " * 30,
        "max_tokens": 8,
        "temperature": 0,
        "kv_transfer_params": params,
    }
    answer: dict[str, Any] = {}

    def decode_leg() -> None:
        resp = httpx.post(
            url_of(cluster, "decode-0") + "/v1/completions",
            json=body,
            headers=cluster.auth,
            timeout=300,
        )
        answer.update(status=resp.status_code, ended=time.monotonic())

    waiter = threading.Thread(target=decode_leg)
    waiter.start()
    wait_for(lambda: bool(rooms_of(cluster, "decode-0")), 30, "the decode's room to open")
    failed_before = side_get(cluster, "decode-0", "/admin/failures")["failures"]
    os.killpg(int(prefill["pid"]), signal.SIGKILL)
    killed = time.monotonic()
    waiter.join(120)
    assert not waiter.is_alive(), "the decode leg still waits for a dead prefill"
    # vLLM's answer to a failed load under policy `fail`.
    assert answer["status"] == 500
    failures = side_get(cluster, "decode-0", "/admin/failures")["failures"]
    key = "room_failed:prefill_pod_lost"
    assert failures.get(key, 0) == failed_before.get(key, 0) + 1, failures
    print(f"prefill killed -> decode leg ended in {answer['ended'] - killed:.2f}s")
    url = url_of(cluster, "decode-0")
    wait_for(lambda: is_idle(url), 30, "decode idle with no KV held")
    # The decode serves on alone...
    alone = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "Still here?", "max_tokens": 4},
        headers=cluster.auth,
        timeout=300,
    )
    assert alone.status_code == 200
    # ... and once the supervisor restarted the prefill, PD is right again.
    wait_for(lambda: ps_rows(cluster.state_dir)["prefill-0"]["RESTARTS"] == "1", 60, "a restart")
    ids: list[int] = []

    def pd_is_back() -> bool:
        try:
            ids[:] = generate(cluster, "completions", stream=False)
        except openai.APIError:
            return False
        return True

    wait_for(pd_is_back, READY_TIMEOUT_S, "PD through the restarted prefill")
    assert ids == reference
    assert_quiet(cluster)
