"""`failurePolicy: recompute` at the router: a failed prefill leg is left to decode.

Under `recompute` a decode worker whose KV never arrives computes the prompt
itself, so the router must not cut its leg short: the client gets decode's
answer (success or error) and the prefill failure is only counted. Under
`fail` (the default) the same failure ends the request at once with the
prefill's error, as test_app_pd.py checks in detail. The decode stand-ins
here run `solo` (they do not wait for their prefill leg), like a decode
that recomputes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .harness import Cluster, LoopThread, start_cluster, wait_until
from .standin import words
from .test_app_pd import assert_idle


@pytest.fixture
def recompute(loop: LoopThread) -> Iterator[Cluster]:
    with start_cluster(loop, failure_policy="recompute") as c:
        c.decode[0].behaviour.solo = True
        yield c


def text_of(n: int) -> str:
    return "".join(words(n))


def leg_failures(cluster: Cluster) -> dict[tuple[str, str], float]:
    with cluster.client() as http:
        text = http.get("/metrics").text
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("pdcluster_router_leg_failures_total{"):
            labels, value = line[len("pdcluster_router_leg_failures_total{") :].split("} ")
            fields = dict(item.split("=") for item in labels.split(","))
            out[(fields["role"].strip('"'), fields["reason"].strip('"'))] = float(value)
    return out


def sse_payloads(resp: httpx.Response) -> list[Any]:
    lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


@pytest.mark.parametrize("stream", [False, True], ids=["non_stream", "stream"])
def test_prefill_error_leaves_the_answer_to_decode(recompute: Cluster, stream: bool) -> None:
    recompute.prefill[0].behaviour.fail_status = 500
    recompute.prefill[0].behaviour.fail_message = "prefill rank crashed"
    result = recompute.openai().completions.create(
        model="tiny", prompt="one two", max_tokens=5, stream=stream
    )
    if stream:
        chunks = list(result)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        text, finish = result.choices[0].text, result.choices[0].finish_reason
    assert (text, finish) == (text_of(5), "length")
    rid = recompute.decode[0].bodies()[0]["rid"]
    assert rid not in recompute.decode[0].aborted_rids()
    # A worker that answered an error status is not running the request: no abort.
    assert rid not in recompute.prefill[0].aborted_rids()
    assert leg_failures(recompute)[("prefill", "prefill_error_status")] == 1
    assert_idle(recompute)


def test_prefill_error_event_mid_stream_does_not_end_the_decode_stream(
    recompute: Cluster,
) -> None:
    prefill, decode = recompute.prefill[0], recompute.decode[0]
    prefill.behaviour.set(hang=True, error_after_tokens=1)
    decode.behaviour.token_delay_s = 0.02
    body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 12}}
    with recompute.client() as http, http.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        payloads = sse_payloads(resp)
    assert not any("error" in p for p in payloads)
    assert payloads[-1]["text"] == text_of(12)
    assert payloads[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert leg_failures(recompute)[("prefill", "prefill_error_event")] == 1
    assert decode.bodies()[0]["rid"] not in decode.aborted_rids()
    assert_idle(recompute)


def test_unreachable_prefill_leaves_the_pool_and_decode_answers(recompute: Cluster) -> None:
    recompute._served[0].stop()  # the prefill stand-in's server
    with recompute.client() as http:
        first = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 3}})
        assert first.status_code == 200, first.text
        assert first.json()["text"] == text_of(3)
        assert first.headers["x-request-id"] not in recompute.decode[0].aborted_rids()
        # No prefill to pair with any more: new requests are refused as before.
        second = http.post("/generate", json={"text": "x"})
        assert second.status_code == 503
    assert leg_failures(recompute)[("prefill", "prefill_unreachable")] == 1
    assert_idle(recompute)


def test_decode_failure_is_the_answer_and_aborts_a_running_prefill(recompute: Cluster) -> None:
    recompute.prefill[0].behaviour.hang = True
    recompute.decode[0].behaviour.fail_status = 502
    recompute.decode[0].behaviour.fail_message = "kv transfer failed; recompute rejected"
    rid = recompute.generate_error(502, "recompute rejected").headers["x-request-id"]
    wait_until(lambda: rid in recompute.prefill[0].aborted_rids())
    assert_idle(recompute)


@pytest.mark.parametrize("stream", [False, True], ids=["non_stream", "stream"])
def test_the_deadline_still_bounds_a_decode_left_alone(loop: LoopThread, stream: bool) -> None:
    with start_cluster(loop, failure_policy="recompute", request_timeout_s=0.5) as cluster:
        cluster.prefill[0].behaviour.fail_status = 500
        cluster.decode[0].behaviour.solo = True
        cluster.decode[0].behaviour.hang = True
        cluster.decode[0].behaviour.start_delay_s = 0.0 if stream else 5.0
        body = {"text": "x", "stream": stream}
        started = time.monotonic()
        with cluster.client() as http:
            if stream:
                with http.stream("POST", "/generate", json=body) as resp:
                    payloads = sse_payloads(resp)
                error = payloads[-1]["error"]
                assert error["code"] == 504 and "0.5s" in error["message"]
            else:
                resp = http.post("/generate", json=body)
                assert resp.status_code == 504 and "0.5s" in resp.json()["error"]["message"]
        assert time.monotonic() - started < 3.0
        rid = cluster.decode[0].bodies()[0]["rid"]
        wait_until(lambda: rid in cluster.decode[0].aborted_rids())
        assert_idle(cluster)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_policy_decides_what_a_prefill_failure_means(loop: LoopThread, policy: str) -> None:
    with start_cluster(loop, failure_policy=policy) as cluster:
        cluster.prefill[0].behaviour.fail_status = 500
        cluster.prefill[0].behaviour.fail_message = "KV bootstrap failed"
        # The decode could finish alone (it recomputes); only `recompute` lets it.
        cluster.decode[0].behaviour.solo = True
        cluster.decode[0].behaviour.token_delay_s = 0.05
        started = time.monotonic()
        if policy == "fail":
            with pytest.raises(openai.APIStatusError) as err:
                cluster.openai().completions.create(model="tiny", prompt="x", max_tokens=20)
            assert err.value.status_code == 502 and "KV bootstrap failed" in err.value.message
            # Failed fast: well before decode's 20 tokens × 50 ms.
            assert time.monotonic() - started < 0.9
            rid = cluster.decode[0].bodies()[0]["rid"]
            wait_until(lambda: rid in cluster.decode[0].aborted_rids())
        else:
            out = cluster.openai().completions.create(model="tiny", prompt="x", max_tokens=20)
            assert out.choices[0].text == text_of(20)
            assert cluster.decode[0].aborted_rids() == []
        assert_idle(cluster)
