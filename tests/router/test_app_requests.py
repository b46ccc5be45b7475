"""What a client sees for bad requests, keys, models, metrics and health."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from .harness import Cluster, LoopThread, start_cluster

KEY = "sk-test-key-0123"


@pytest.fixture
def cluster(loop: LoopThread) -> Iterator[Cluster]:
    with start_cluster(loop, max_body_bytes=4096) as c:
        yield c


def assert_openai_error(body: dict[str, object], status: int) -> dict[str, object]:
    error = body["error"]
    assert isinstance(error, dict)
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] == status or isinstance(error["code"], str)
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize(
    ("path", "content", "status", "words"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", b'{"model": "tiny"}', 400, "prompt"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages"),
        ("/generate", b'{"text": "a", "rid": "req-1"}', 400, "set by the router"),
        ("/generate", b'{"text": ["a", "b"]}', 400, "one request per prompt"),
        ("/v1/completions", b'{"model": "gpt-4", "prompt": "a"}', 404, "gpt-4"),
    ],
)
def test_bad_requests_get_openai_errors_and_reach_no_worker(
    cluster: Cluster, path: str, content: bytes, status: int, words: str
) -> None:
    with cluster.client() as http:
        resp = http.post(path, content=content, headers={"content-type": "application/json"})
        assert resp.status_code == status
        error = assert_openai_error(resp.json(), status)
        assert words in str(error["message"])
        # State intact: nothing reached a worker, and the next request works.
        assert all(not w.received for w in cluster.workers())
        assert http.post("/generate", json={"text": "ok"}).status_code == 200


def test_unknown_model_is_a_not_found_error_for_the_openai_client(cluster: Cluster) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        cluster.openai().completions.create(model="gpt-4", prompt="a")


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
def test_oversized_body_is_413(cluster: Cluster, chunked: bool) -> None:
    body = b'{"text": "' + b"a" * 5000 + b'"}'
    with cluster.client() as http:
        if chunked:
            resp = http.post("/generate", content=iter([body[:2000], body[2000:]]))
        else:
            resp = http.post("/generate", content=body)
        assert resp.status_code == 413
        assert "4096-byte limit" in resp.json()["error"]["message"]
        assert http.post("/generate", json={"text": "small"}).status_code == 200
    assert all(len(w.received) == 1 for w in cluster.workers())


def test_unknown_route_and_wrong_method_are_openai_shaped(cluster: Cluster) -> None:
    with cluster.client() as http:
        missing = http.post("/v1/embeddings", json={})
        assert missing.status_code == 404
        assert_openai_error(missing.json(), 404)
        wrong = http.get("/v1/completions")
        assert wrong.status_code == 405
        assert_openai_error(wrong.json(), 405)


def test_models_lists_the_served_model(cluster: Cluster) -> None:
    models = cluster.openai().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].owned_by == "pdcluster"


def test_api_keys_guard_the_api_but_not_health_or_metrics(loop: LoopThread) -> None:
    with start_cluster(loop, api_keys=(KEY, "second-key")) as cluster:
        with pytest.raises(openai.AuthenticationError):
            cluster.openai().completions.create(model="tiny", prompt="a")
        with pytest.raises(openai.AuthenticationError):
            cluster.openai(api_key="wrong").models.list()
        out = cluster.openai(api_key=KEY).completions.create(model="tiny", prompt="a", max_tokens=1)
        assert out.choices[0].text == " w0"
        assert cluster.openai(api_key="second-key").models.list().data[0].id == "tiny"
        with cluster.client() as http:
            no_key = http.post("/generate", json={"text": "a"})
            assert no_key.status_code == 401
            assert no_key.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/health").status_code == 200
            assert http.get("/metrics").status_code == 200
        # Refused requests never reached a worker.
        assert len(cluster.decode[0].received) == 1


def test_health_lists_workers(cluster: Cluster) -> None:
    with cluster.client() as http:
        resp = http.get("/health")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "ok"
    roles = {w["role"]: w for w in body["workers"]}
    assert roles["prefill"]["bootstrap_port"] == cluster.prefill[0].bootstrap_port
    assert roles["prefill"]["healthy"] and roles["decode"]["healthy"]


def test_metrics_count_requests_latency_and_worker_state(cluster: Cluster) -> None:
    with cluster.client() as http:
        for _ in range(3):
            http.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
        http.post("/v1/completions", json={"model": "nope", "prompt": "a"})
        text = http.get("/metrics").text
    assert 'pdcluster_router_requests_total{code="200",route="/v1/completions"} 3.0' in text
    assert 'pdcluster_router_requests_total{code="404",route="/v1/completions"} 1.0' in text
    assert 'pdcluster_router_request_duration_seconds_count{route="/v1/completions"} 4.0' in text
    for worker in (cluster.prefill[0], cluster.decode[0]):
        role = worker.role
        assert f'pdcluster_router_worker_healthy{{role="{role}",worker="{worker.url}"}} 1.0' in text
        assert (
            f'pdcluster_router_worker_outstanding{{role="{role}",worker="{worker.url}"}} 0.0'
            in text
        )


def test_the_time_to_first_token_histogram_covers_the_prefill_leg(cluster: Cluster) -> None:
    """What the operator's autoscaler reads from the router: every PD request's time
    from its leg plan to the prefill's answer, which includes the prefill's own time."""
    cluster.prefill[0].behaviour.start_delay_s = 0.3
    with cluster.client() as http:
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "a"}).is_success
        body = {"model": "tiny", "prompt": "a", "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            resp.read()
        text = http.get("/metrics").text
    assert "pdcluster_router_time_to_first_token_seconds_count 2.0" in text
    assert 'pdcluster_router_time_to_first_token_seconds_bucket{le="0.25"} 0.0' in text
