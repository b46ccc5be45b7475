"""What the router counts per request: outcome by reason, tokens, and its cluster's facts.

Behind stand-in workers that answer like ours (`usage` in a whole answer,
a closing `: usage` comment on a stream).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdcluster.runtime.router.request_record import usage_of

from .harness import Cluster, LoopThread, start_cluster


@pytest.fixture
def cluster(loop: LoopThread) -> Iterator[Cluster]:
    with start_cluster(loop, cluster_name="demo", ttft_slo_s=1.5) as c:
        yield c


def metrics(cluster: Cluster) -> str:
    with cluster.client() as http:
        return http.get("/metrics").text


def test_answers_count_as_successes_with_their_tokens(cluster: Cluster) -> None:
    with cluster.client() as http:
        whole = http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "a b c", "max_tokens": 4}
        )
        assert whole.status_code == 200
        body = {"model": "tiny", "prompt": "a b", "max_tokens": 3, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            streamed = resp.read().decode()
    assert ": usage" not in streamed  # the comment is the router's, never the client's
    usage = whole.json()["usage"]
    text = metrics(cluster)
    assert 'pdcluster_router_request_success_total{reason="length"} 2.0' in text
    prompt = usage["prompt_tokens"] + 2
    assert f"pdcluster_router_prompt_tokens_total {float(prompt)}" in text
    assert (
        f"pdcluster_router_generation_tokens_total {float(usage['completion_tokens'] + 3)}" in text
    )


def test_failures_count_by_reason(cluster: Cluster) -> None:
    cluster.decode[0].behaviour.fail_status = 500
    with cluster.client() as http:
        assert (
            http.post("/v1/completions", json={"model": "tiny", "prompt": "a"}).status_code == 502
        )
        assert (
            http.post("/v1/completions", json={"model": "nope", "prompt": "a"}).status_code == 404
        )
    text = metrics(cluster)
    assert 'pdcluster_router_request_failure_total{reason="decode_error_status"} 1.0' in text
    assert 'pdcluster_router_request_failure_total{reason="unknown_model"} 1.0' in text
    assert "pdcluster_router_request_success_total{" not in text


def test_the_router_exports_its_cluster_its_slo_and_ready_workers_per_role(
    cluster: Cluster,
) -> None:
    text = metrics(cluster)
    assert 'pdcluster_router_info{pdcluster="demo"} 1.0' in text
    assert "pdcluster_router_slo_ttft_p90_seconds 1.5" in text
    assert 'pdcluster_router_ready_workers{role="prefill"} 1.0' in text
    assert 'pdcluster_router_ready_workers{role="decode"} 1.0' in text


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (
            {
                "usage": {"prompt_tokens": 3, "completion_tokens": 4},
                "choices": [{"finish_reason": "stop"}],
            },
            (3, 4, "stop"),
        ),
        (
            {
                "meta_info": {
                    "prompt_tokens": 5,
                    "completion_tokens": 1,
                    "finish_reason": {"type": "length"},
                }
            },
            (5, 1, "length"),
        ),
        ({"usage": {"prompt_tokens": "x"}}, (0, 0, None)),
        ([1, 2], (0, 0, None)),
        ({"usage": "nope", "choices": []}, (0, 0, None)),
    ],
)
def test_usage_of_reads_openai_and_sglang_answers(
    payload: object, expected: tuple[int, int, str | None]
) -> None:
    assert usage_of(payload) == expected
