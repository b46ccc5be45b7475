"""Local-mode autoscaling adds and removes workers at the router at runtime."""

from __future__ import annotations

from typing import Any

from pdcluster.runtime.router.workers import KVEventPorts

from .harness import LoopThread, start_cluster, wait_until
from .test_app_pool import healthy_urls, served_by

TOKEN = "router-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SETTINGS: dict[str, Any] = {"health_check_interval_s": 0.05, "worker_token": TOKEN}


def pool_urls(http: Any) -> set[str]:
    return {w["url"] for w in http.get("/health").json()["workers"]}


def test_a_removed_worker_gets_no_request_and_an_added_one_serves_after_its_probe(
    loop: LoopThread,
) -> None:
    with start_cluster(loop, prefill=2, **SETTINGS) as cluster, cluster.client() as http:
        kept, scaled = cluster.prefill
        resp = http.post("/admin/remove_worker", json={"url": scaled.url}, headers=AUTH)
        assert resp.status_code == 200, resp.text
        assert scaled.url not in pool_urls(http)
        for _ in range(4):
            assert http.post("/generate", json={"text": "a"}).status_code == 200
        assert served_by(cluster.prefill) == [4, 0]
        again = http.post("/admin/remove_worker", json={"url": scaled.url}, headers=AUTH)
        assert again.status_code == 404

        body = {"url": scaled.url, "role": "prefill"}
        resp = http.post("/admin/add_worker", json=body, headers=AUTH)
        assert resp.status_code == 200 and resp.json()["healthy"] is False
        wait_until(lambda: scaled.url in healthy_urls(cluster))
        for _ in range(4):
            assert http.post("/generate", json={"text": "a"}).status_code == 200
        assert served_by(cluster.prefill) == [6, 2]
        # Adding it again changes nothing.
        assert http.post("/admin/add_worker", json=body, headers=AUTH).status_code == 200
        assert {kept.url, scaled.url} <= healthy_urls(cluster)


def test_bad_add_and_remove_calls_are_refused_and_change_nothing(loop: LoopThread) -> None:
    with start_cluster(loop, prefill=1, decode=1, **SETTINGS) as cluster, cluster.client() as http:
        prefill, decode = cluster.prefill[0].url, cluster.decode[0].url
        before = healthy_urls(cluster)
        new = {"url": "http://127.0.0.1:1", "role": "decode"}
        assert http.post("/admin/add_worker", json=new).status_code == 401
        wrong = {"Authorization": "Bearer x"}
        assert http.post("/admin/add_worker", json=new, headers=wrong).status_code == 403
        assert http.post("/admin/remove_worker", json={"url": decode}).status_code == 401
        for body, status in (
            ({"url": "http://127.0.0.1:1"}, 422),  # no role
            ({"url": "http://127.0.0.1:1", "role": "colocated"}, 422),  # not in a PD router
            ({"url": "ftp://127.0.0.1:1", "role": "decode"}, 422),
            ({"url": prefill, "role": "decode"}, 409),  # it is a prefill
        ):
            resp = http.post("/admin/add_worker", json=body, headers=AUTH)
            assert resp.status_code == status, (body, resp.text)
        assert http.post("/admin/remove_worker", json={"url": 3}, headers=AUTH).status_code == 422
        assert pool_urls(http) == {prefill, decode}
        assert healthy_urls(cluster) == before


def test_an_added_vllm_worker_names_where_it_publishes_its_cache_events(
    loop: LoopThread,
) -> None:
    with start_cluster(loop, decode=1, **SETTINGS) as cluster, cluster.client() as http:
        before = pool_urls(http)
        for kv_events, problem in (
            ({"publish": 5557}, "kv_events must be"),
            ({"publish": "5557", "replay": 5558}, "kv_events must be"),
            ({"publish": True, "replay": 5558}, "got True"),
            ([5557, 5558], "kv_events must be"),
            ({"publish": 5557, "replay": 5557}, "both 5557"),
            ({"publish": 5557, "replay": 0}, "1..65535"),
        ):
            body = {"url": "http://127.0.0.1:1", "role": "decode", "kv_events": kv_events}
            resp = http.post("/admin/add_worker", json=body, headers=AUTH)
            assert resp.status_code == 422 and problem in resp.text, (kv_events, resp.text)
        assert pool_urls(http) == before
        body = {
            "url": "http://127.0.0.1:1",
            "role": "decode",
            "kv_events": {"publish": 5557, "replay": 5558},
        }
        resp = http.post("/admin/add_worker", json=body, headers=AUTH)
        assert resp.status_code == 200, resp.text
        assert resp.json()["kv_events"] == {"publish": 5557, "replay": 5558}
        added = cluster.state.pool.get("http://127.0.0.1:1")
        assert added is not None and added.kv_events == KVEventPorts(5557, 5558)


def test_a_worker_with_a_leg_in_flight_is_not_removed(loop: LoopThread) -> None:
    with start_cluster(loop, decode=1, **SETTINGS) as cluster, cluster.client() as http:
        busy = cluster.decode[0]
        busy.behaviour.hang = True
        with http.stream("POST", "/generate", json={"text": "long", "stream": True}) as long:
            assert long.status_code == 200
            resp = http.post("/admin/remove_worker", json={"url": busy.url}, headers=AUTH)
            assert resp.status_code == 409 and "in flight" in resp.text
            assert busy.url in pool_urls(http)
            busy.behaviour.hang = False
        wait_until(lambda: http.get("/health").json()["workers"][-1]["outstanding"] == 0)
        resp = http.post("/admin/remove_worker", json={"url": busy.url}, headers=AUTH)
        assert resp.status_code == 200, resp.text
