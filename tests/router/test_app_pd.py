"""The router in front of prefill/decode stand-ins, driven by real clients.

The stand-ins meet by room (see standin.py), so every test here also checks
that both legs are sent concurrently: sequential legs would time out.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pdcluster.runtime.router.rooms import MAX_ROOM, is_valid_rid

from .harness import Cluster, LoopThread, start_cluster, wait_until
from .standin import StandinWorker, words

# Generous bound for "abort within 100 ms" on a loaded 2-core CI machine;
# the measured delay is a few milliseconds (see test_disconnect_delay_*).
ABORT_BOUND_S = 0.5


@pytest.fixture
def cluster(loop: LoopThread) -> Iterator[Cluster]:
    with start_cluster(loop) as c:
        yield c


def text_of(n: int) -> str:
    return "".join(words(n))


def assert_idle(cluster: Cluster) -> None:
    """No leg in flight and no room held once every request ended."""

    def idle() -> bool:
        state = cluster.state
        ctx = state.ctx
        assert ctx is not None
        legs = sum(w.outstanding for w in state.pool.all())
        return legs == 0 and not ctx.rooms_in_use

    wait_until(lambda: cluster.loop.call(idle))


def wait_first_aborted(worker: StandinWorker) -> str:
    """The rid of the first leg `worker` received, once that leg was aborted."""
    rid: str = worker.bodies()[0]["rid"]
    wait_until(lambda: rid in worker.aborted_rids())
    return rid


def test_openai_completions_non_stream(cluster: Cluster) -> None:
    out = cluster.openai().completions.create(model="tiny", prompt="one two", max_tokens=3)
    assert out.choices[0].text == text_of(3)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        2,
        3,
        5,
    )
    assert_idle(cluster)


def test_openai_completions_stream(cluster: Cluster) -> None:
    stream = cluster.openai().completions.create(
        model="tiny",
        prompt="one two",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text_of(5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert_idle(cluster)


def test_openai_chat_non_stream_and_stream(cluster: Cluster) -> None:
    client = cluster.openai()
    messages: Any = [{"role": "user", "content": "say three words"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert out.choices[0].message.content == text_of(3)
    assert out.choices[0].message.role == "assistant"
    assert out.usage is not None and out.usage.prompt_tokens == 3
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text_of(4)
    assert chunks[-1].choices[0].finish_reason == "length"
    # The worker, not the router, applies the chat template: it got `messages`.
    assert [b["messages"] for b in cluster.decode[0].bodies("/v1/chat/completions")] == [
        messages,
        messages,
    ]
    assert_idle(cluster)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"input_ids": [5, 6], "stream": True}),
        ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}]}),
    ],
)
def test_both_legs_get_the_same_body_rid_and_bootstrap_fields(
    cluster: Cluster, path: str, body: dict[str, Any]
) -> None:
    with cluster.client() as http:
        for _ in range(3):
            assert http.post(path, json=body).status_code == 200
    prefill_bodies = cluster.prefill[0].bodies(path)
    decode_bodies = cluster.decode[0].bodies(path)
    assert prefill_bodies == decode_bodies
    assert len(prefill_bodies) == 3
    rids, rooms = set(), set()
    for leg in decode_bodies:
        assert {k: v for k, v in leg.items() if k not in ("rid",) and "bootstrap" not in k} == body
        assert is_valid_rid(leg["rid"])
        assert leg["bootstrap_host"] == "127.0.0.1"
        assert leg["bootstrap_port"] == cluster.prefill[0].bootstrap_port
        assert 0 < leg["bootstrap_room"] <= MAX_ROOM
        rids.add(leg["rid"])
        rooms.add(leg["bootstrap_room"])
    assert len(rids) == len(rooms) == 3


def test_generate_stream_passthrough_ends_with_done(cluster: Cluster) -> None:
    body = {"text": "x", "sampling_params": {"max_new_tokens": 3}, "stream": True}
    with cluster.client() as http, http.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        rid = resp.headers["x-request-id"]
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert payloads[-2]["text"] == text_of(3)
    assert payloads[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert {p["meta_info"]["id"] for p in payloads} == {rid}


def test_streams_relayed_to_their_done_leave_the_leg_connections_reusable(
    cluster: Cluster,
) -> None:
    """A worker's chunked terminator comes after `[DONE]`, in a write of its own:
    the router reads it before pooling the connection, so one after another,
    streamed requests reach each worker over one connection."""
    for worker in cluster.workers():
        worker.behaviour.set(end_delay_s=0.02)
    body = {"text": "x", "sampling_params": {"max_new_tokens": 3}, "stream": True}
    with cluster.client() as http:
        for _ in range(6):
            with http.stream("POST", "/generate", json=body) as resp:
                assert [line for line in resp.iter_lines() if line][-1] == "data: [DONE]"
            wait_until(lambda: not cluster.state.ctx.tasks, timeout=5)
    for worker in cluster.workers():
        assert {r.client_port for r in worker.received if r.path == "/generate"} != {0}
        assert len({r.client_port for r in worker.received if r.path == "/generate"}) == 1


def test_generate_non_stream_passthrough(cluster: Cluster) -> None:
    with cluster.client() as http:
        resp = http.post("/generate", json={"input_ids": [1, 2, 3]})
    assert resp.status_code == 200
    data = resp.json()
    assert data["text"] == text_of(4)
    assert data["meta_info"]["prompt_tokens"] == 3
    assert data["meta_info"]["id"] == resp.headers["x-request-id"]


# ---------------------------------------------------------------- failures
@pytest.mark.parametrize("stream", [False, True])
def test_prefill_failure_cancels_decode_and_reports_a_clear_error(
    cluster: Cluster, stream: bool
) -> None:
    cluster.prefill[0].behaviour.fail_status = 500
    cluster.prefill[0].behaviour.fail_message = "KV bootstrap failed"
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        result = cluster.openai().completions.create(
            model="tiny", prompt="x", max_tokens=3, stream=stream
        )
        if stream:
            list(result)
    elapsed = time.monotonic() - start
    assert err.value.status_code == 502
    assert "prefill" in err.value.message and "KV bootstrap failed" in err.value.message
    # Without cancel propagation the decode leg would sit out its 5 s rendezvous.
    assert elapsed < 2.0
    wait_first_aborted(cluster.decode[0])
    assert_idle(cluster)


def test_prefill_rejecting_the_prompt_is_the_clients_error(cluster: Cluster) -> None:
    cluster.prefill[0].behaviour.fail_status = 400
    cluster.prefill[0].behaviour.fail_message = "prompt is longer than 4096 tokens"
    with pytest.raises(openai.BadRequestError) as err:
        cluster.openai().completions.create(model="tiny", prompt="x")
    assert "4096" in err.value.message
    wait_first_aborted(cluster.decode[0])


def test_decode_failure_aborts_the_prefill_leg(cluster: Cluster) -> None:
    cluster.decode[0].behaviour.fail_status = 503
    cluster.decode[0].behaviour.fail_message = "no KV pages"
    cluster.generate_error(502, "no KV pages")
    wait_first_aborted(cluster.prefill[0])
    assert_idle(cluster)


def test_decode_error_event_mid_stream_reaches_the_client_and_aborts_prefill(
    cluster: Cluster,
) -> None:
    cluster.prefill[0].behaviour.hang = True
    cluster.decode[0].behaviour.error_after_tokens = 2
    cluster.decode[0].behaviour.fail_message = "decode rank lost"
    seen = []
    with pytest.raises(openai.APIError, match="decode rank lost"):
        for chunk in cluster.openai().completions.create(
            model="tiny", prompt="x", max_tokens=8, stream=True
        ):
            seen.append(chunk.choices[0].text)
    assert "".join(seen) == text_of(2)
    rid = wait_first_aborted(cluster.prefill[0])
    assert rid not in cluster.decode[0].aborted_rids()
    assert_idle(cluster)


def test_prefill_failing_mid_stream_ends_the_stream_with_an_error_and_aborts_decode(
    cluster: Cluster,
) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    prefill.behaviour.set(
        hang=True, token_delay_s=0.02, error_after_tokens=3, fail_message="prefill rank crashed"
    )
    decode.behaviour.set(hang=True, token_delay_s=0.01)
    body = {"text": "x", "stream": True}
    with cluster.client() as http, http.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == 502 and "prefill rank crashed" in error["message"]
    assert len(events) > 3  # decode tokens reached the client before the failure
    wait_first_aborted(decode)
    assert_idle(cluster)


def test_truncated_decode_stream_is_an_error_not_a_short_answer(cluster: Cluster) -> None:
    cluster.decode[0].behaviour.omit_done = True
    with pytest.raises(openai.APIError, match="ended before"):
        list(cluster.openai().completions.create(model="tiny", prompt="x", stream=True))
    assert_idle(cluster)


def test_deadline_aborts_both_legs_with_504(loop: LoopThread) -> None:
    with start_cluster(loop, request_timeout_s=0.3) as cluster:
        cluster.prefill[0].behaviour.hang = True
        cluster.decode[0].behaviour.hang = True
        cluster.generate_error(504, "0.3s")
        rid = wait_first_aborted(cluster.decode[0])
        wait_until(lambda: rid in cluster.prefill[0].aborted_rids())
        assert_idle(cluster)


@pytest.mark.parametrize("prefill_hangs", [False, True], ids=["prefill-done", "prefill-running"])
def test_deadline_mid_stream_ends_it_with_a_504_event_and_aborts_the_legs(
    loop: LoopThread, prefill_hangs: bool
) -> None:
    """Decode streams tokens past the deadline; with the prefill leg finished (the
    stream's reads are not raced against it) and still running (they are)."""
    with start_cluster(loop, request_timeout_s=0.5) as cluster:
        prefill, decode = cluster.prefill[0], cluster.decode[0]
        if prefill_hangs:
            prefill.behaviour.set(hang=True, token_delay_s=0.05)
        decode.behaviour.set(hang=True, token_delay_s=0.02)
        started = time.monotonic()
        body = {"text": "x", "stream": True}
        with cluster.client() as http, http.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line]
        took = time.monotonic() - started
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["code"] == 504 and "did not finish within 0.5s" in error["message"]
        assert len(events) > 3  # tokens reached the client before the deadline
        assert took < 5, f"the stream ended {took:.1f}s after it started"
        wait_first_aborted(decode)
        if prefill_hangs:
            wait_first_aborted(prefill)
        assert_idle(cluster)


def test_prefill_that_died_fails_fast_and_leaves_the_pool(cluster: Cluster) -> None:
    cluster._served[0].stop()  # the prefill stand-in's server
    with cluster.client() as http:
        first = http.post("/generate", json={"text": "x"})
        assert first.status_code == 502
        assert "prefill worker failed: worker unreachable" in first.json()["error"]["message"]
        # The decode leg may or may not have reached its worker; it is aborted either way.
        rid = first.headers["x-request-id"]
        wait_until(lambda: rid in cluster.decode[0].aborted_rids())
        second = http.post("/generate", json={"text": "x"})
        assert second.status_code == 503
        assert second.json()["error"]["code"] == "no_healthy_worker"
        assert http.get("/health").status_code == 503
    assert_idle(cluster)


# ----------------------------------------------------------- disconnects
def raw_request(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def disconnect_delay(cluster: Cluster, stream: bool) -> float:
    """Close the client socket mid-request; seconds until both legs got the abort."""
    cluster.prefill[0].behaviour.hang = True
    cluster.decode[0].behaviour.hang = True
    sock = raw_request(cluster.router_url, "/generate", {"text": "x", "stream": stream})
    try:
        if stream:
            received = b""
            while b"data:" not in received:
                received += sock.recv(4096)
        else:
            wait_until(lambda: len(cluster.decode[0].received) == 1)
            wait_until(lambda: len(cluster.prefill[0].received) == 1)
    finally:
        closed_at = time.monotonic()
        sock.close()
    rid = cluster.decode[0].bodies()[0]["rid"]
    wait_until(lambda: cluster.decode[0].abort_time(rid) is not None)
    wait_until(lambda: cluster.prefill[0].abort_time(rid) is not None)
    times = [cluster.decode[0].abort_time(rid), cluster.prefill[0].abort_time(rid)]
    assert_idle(cluster)
    return max(t for t in times if t is not None) - closed_at


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non_stream"])
def test_disconnect_delay_client_gone_aborts_both_legs(cluster: Cluster, stream: bool) -> None:
    assert disconnect_delay(cluster, stream) < ABORT_BOUND_S
    assert cluster.decode[0].aborted_rids() == cluster.prefill[0].aborted_rids()


def test_client_disconnect_shows_as_499_in_metrics(cluster: Cluster) -> None:
    disconnect_delay(cluster, stream=True)
    with cluster.client() as http:
        text = http.get("/metrics").text
    assert 'pdcluster_router_requests_total{code="499",route="/generate"} 1.0' in text
    assert 'pdcluster_router_aborts_sent_total{reason="client_disconnect",role="decode"}' in text
