"""Worker pool behaviour seen through the router: health, policies, modes."""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections import Counter
from typing import Any

import pytest

from pdcluster.runtime.ports import free_port
from pdcluster.runtime.router.workers import WorkerTarget
from pdcluster.runtime.spec import Role

from .harness import Cluster, LoopThread, start_cluster, wait_until
from .standin import words


def served_by(workers: list[Any], path: str = "/generate") -> list[int]:
    return [len(w.bodies(path)) for w in workers]


def healthy_urls(cluster: Cluster) -> set[str]:
    with cluster.client() as http:
        return {w["url"] for w in http.get("/health").json()["workers"] if w["healthy"]}


def test_round_robin_spreads_both_roles_evenly(loop: LoopThread) -> None:
    with start_cluster(loop, prefill=2, decode=3) as cluster, cluster.client() as http:
        for _ in range(12):
            assert http.post("/generate", json={"text": "a"}).status_code == 200
        assert served_by(cluster.prefill) == [6, 6]
        assert served_by(cluster.decode) == [4, 4, 4]


def test_random_policy_is_seeded_and_uses_every_worker(loop: LoopThread) -> None:
    picks = []
    for _ in range(2):
        settings = {"prefill_policy": "random", "decode_policy": "random", "policy_seed": 11}
        with start_cluster(loop, prefill=2, decode=2, **settings) as cluster:
            with cluster.client() as http:
                for _ in range(12):
                    assert http.post("/generate", json={"text": "a"}).status_code == 200
            picks.append((served_by(cluster.prefill), served_by(cluster.decode)))
    assert picks[0] == picks[1]
    assert all(count > 0 for count in picks[0][0] + picks[0][1])


def test_least_outstanding_avoids_a_busy_decode_worker(loop: LoopThread) -> None:
    with start_cluster(loop, decode=2, decode_policy="least_outstanding") as cluster:
        busy = cluster.decode[0]
        busy.behaviour.hang = True
        with cluster.client() as http:
            with http.stream("POST", "/generate", json={"text": "long", "stream": True}) as long:
                assert long.status_code == 200
                assert len(busy.received) == 1
                for _ in range(4):
                    assert http.post("/generate", json={"text": "a"}).status_code == 200
                assert served_by(cluster.decode) == [1, 4]
            # The stream's client left: its legs are aborted and released.
            wait_until(lambda: len(busy.aborts) == 1)
            busy.behaviour.hang = False
            for _ in range(2):
                assert http.post("/generate", json={"text": "a"}).status_code == 200
        assert served_by(cluster.decode) == [2, 5]


def test_unhealthy_worker_leaves_the_pool_and_comes_back(loop: LoopThread) -> None:
    settings: dict[str, Any] = {"health_check_interval_s": 0.05, "health_failure_threshold": 2}
    with start_cluster(loop, decode=2, **settings) as cluster:
        sick, well = cluster.decode
        sick.behaviour.healthy = False
        wait_until(lambda: sick.url not in healthy_urls(cluster))
        with cluster.client() as http:
            for _ in range(4):
                assert http.post("/generate", json={"text": "a"}).status_code == 200
            assert served_by(cluster.decode) == [0, 4]
            sick.behaviour.healthy = True
            wait_until(lambda: sick.url in healthy_urls(cluster))
            for _ in range(4):
                assert http.post("/generate", json={"text": "a"}).status_code == 200
            assert served_by(cluster.decode) == [2, 6]
            metrics = http.get("/metrics").text
        assert (
            'pdcluster_router_worker_health_transitions_total{role="decode",to="unhealthy"} 1.0'
            in metrics
        )
        # Two joins at startup, one return.
        assert (
            'pdcluster_router_worker_health_transitions_total{role="decode",to="healthy"} 3.0'
            in metrics
        )
        del well


def test_last_worker_of_a_role_gone_means_503_then_recovery(loop: LoopThread) -> None:
    with start_cluster(loop, health_check_interval_s=0.05, health_failure_threshold=1) as cluster:
        prefill = cluster.prefill[0]
        prefill.behaviour.healthy = False
        wait_until(lambda: prefill.url not in healthy_urls(cluster))
        with cluster.client() as http:
            resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
            assert resp.status_code == 503
            assert resp.json()["error"]["message"] == "no healthy prefill worker is available"
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["missing_roles"] == ["prefill"]
            prefill.behaviour.healthy = True
            wait_until(lambda: prefill.url in healthy_urls(cluster))
            assert http.post("/generate", json={"text": "a"}).status_code == 200
        # The refused request never reached decode.
        assert len(cluster.decode[0].received) == 1


def test_dead_worker_at_startup_stays_out_and_the_rest_serve(loop: LoopThread) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with start_cluster(loop, decode=1, extra_urls={"decode_urls": [dead]}) as cluster:
        with cluster.client() as http:
            workers = {w["url"]: w for w in http.get("/health").json()["workers"]}
            assert not workers[dead]["healthy"] and workers[dead]["last_error"]
            for _ in range(3):
                assert http.post("/generate", json={"text": "a"}).status_code == 200
        assert served_by(cluster.decode) == [3]


def test_worker_with_the_wrong_role_is_never_a_candidate(loop: LoopThread) -> None:
    def misconfigure(cluster: Cluster) -> None:
        cluster.prefill[0].behaviour.mode_override = "decode"

    with start_cluster(loop, prefill=2, prepare=misconfigure) as cluster:
        impostor, real = cluster.prefill
        with cluster.client() as http:
            workers = {w["url"]: w for w in http.get("/health").json()["workers"]}
            assert "listed as prefill" in workers[impostor.url]["last_error"]
            assert not workers[impostor.url]["healthy"]
            for _ in range(3):
                assert http.post("/generate", json={"text": "a"}).status_code == 200
        assert served_by(cluster.prefill) == [0, 3]


def test_rooms_follow_the_dp_rank_of_the_prefill_instance(loop: LoopThread) -> None:
    with start_cluster(loop, prefill_dp=4) as cluster, cluster.client() as http:
        for _ in range(8):
            assert http.post("/generate", json={"text": "a"}).status_code == 200
        rooms = [b["bootstrap_room"] for b in cluster.prefill[0].bodies()]
        assert [room % 4 for room in rooms] == [0, 1, 2, 3, 0, 1, 2, 3]
        assert len(set(rooms)) == 8


def test_colocated_mode_sends_one_leg_without_bootstrap_fields(loop: LoopThread) -> None:
    with start_cluster(loop, prefill=0, decode=0, colocated=2) as cluster:
        client = cluster.openai()
        out = client.completions.create(model="tiny", prompt="a b", max_tokens=2)
        assert out.choices[0].text == "".join(words(2))
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=3
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "".join(words(3))
        bodies = [b for w in cluster.colocated for b in w.bodies()]
        assert len(bodies) == 2
        for body in bodies:
            assert "rid" in body
            assert not any(key.startswith("bootstrap") for key in body)
        assert served_by(cluster.colocated, "/v1/completions") == [1, 0]
        # Batches are the worker's business in colocated mode.
        with cluster.client() as http:
            resp = http.post("/generate", json={"text": ["a", "b"]})
        assert resp.status_code == 200


def test_parallel_requests_all_complete_and_leave_no_legs(loop: LoopThread) -> None:
    with start_cluster(loop, prefill=2, decode=2) as cluster:
        for worker in cluster.workers():
            worker.behaviour.token_delay_s = 0.005

        def one(i: int) -> str:
            with cluster.client() as http:
                resp = http.post(
                    "/generate", json={"text": f"p{i}", "sampling_params": {"max_new_tokens": 3}}
                )
                assert resp.status_code == 200
                return str(resp.json()["text"])

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(one, range(12)))
        assert Counter(texts) == {"".join(words(3)): 12}
        state = cluster.state
        assert cluster.loop.call(lambda: sum(w.outstanding for w in state.pool.all())) == 0


def test_free_port_is_refused() -> None:
    port = free_port()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass


def test_discovery_changes_take_effect_without_restart(loop: LoopThread) -> None:
    """What Kubernetes discovery publishes: new workers are probed, gone ones leave."""
    with start_cluster(loop, decode=2) as cluster:
        first, second = cluster.decode
        prefill = cluster.prefill[0]
        state = cluster.state

        def publish(decode_urls: list[str]) -> None:
            targets = [WorkerTarget(prefill.url, Role.prefill)]
            targets += [WorkerTarget(url, Role.decode) for url in decode_urls]
            cluster.loop.call(state.apply_targets, targets)

        publish([first.url])
        with cluster.client() as http:
            for _ in range(2):
                assert http.post("/generate", json={"text": "a"}).status_code == 200
            assert served_by(cluster.decode) == [2, 0]
            publish([first.url, second.url])
            # A new worker serves only after its probe succeeded.
            wait_until(lambda: second.url in healthy_urls(cluster))
            for _ in range(2):
                assert http.post("/generate", json={"text": "a"}).status_code == 200
            assert served_by(cluster.decode) == [3, 1]


def test_a_request_waits_for_a_new_workers_first_probe_when_none_is_healthy(
    loop: LoopThread,
) -> None:
    """A rollout swaps pods: the old decode leaves as the new one, Ready in
    Kubernetes, is still being probed. The request waits for that probe
    instead of being refused; without a worker on its first probe it is not held."""
    with start_cluster(loop, decode=2) as cluster:
        old, new = cluster.decode
        prefill = cluster.prefill[0]
        state = cluster.state

        def publish(decode_url: str) -> None:
            targets = [
                WorkerTarget(prefill.url, Role.prefill),
                WorkerTarget(decode_url, Role.decode),
            ]
            cluster.loop.call(state.apply_targets, targets)

        publish(old.url)
        new.behaviour.info_delay_s = 0.5
        with cluster.client() as http:
            assert http.post("/generate", json={"text": "a"}).status_code == 200
            publish(new.url)  # the old one is gone, the new one not probed yet
            started = time.monotonic()
            resp = http.post("/generate", json={"text": "a"})
            waited = time.monotonic() - started
            assert resp.status_code == 200, resp.text
            assert served_by(cluster.decode) == [1, 1]
            assert waited >= 0.3  # it did wait for the probe
            # A worker whose first probe failed is not waited for: 503 at once.
            new.behaviour.healthy = False
            cluster.loop.run(state.checker.probe_all())
            cluster.loop.run(state.checker.probe_all())
            started = time.monotonic()
            refused = http.post("/generate", json={"text": "a"})
            assert refused.status_code == 503
            assert time.monotonic() - started < 0.3


def test_a_held_worker_gets_no_request_until_admitted_though_its_probes_pass(
    loop: LoopThread,
) -> None:
    """Local mode's supervisor holds a dead decode out while it restarts it."""
    token = "router-admin-token"
    settings: dict[str, Any] = {"health_check_interval_s": 0.05, "worker_token": token}
    with start_cluster(loop, decode=2, **settings) as cluster, cluster.client() as http:
        held, other = cluster.decode
        auth = {"Authorization": f"Bearer {token}"}
        body = {"url": held.url, "reason": "decode-0 killed by SIGKILL"}
        assert http.post("/admin/hold_worker", json=body).status_code == 401
        assert (
            http.post(
                "/admin/hold_worker", json=body, headers={"Authorization": "Bearer x"}
            ).status_code
            == 403
        )
        missing = http.post("/admin/hold_worker", json={"url": "http://127.0.0.1:1"}, headers=auth)
        assert missing.status_code == 404
        assert http.post("/admin/hold_worker", json={"url": 5}, headers=auth).status_code == 422
        assert {held.url, other.url} <= healthy_urls(cluster), "a refused call changes nothing"

        resp = http.post("/admin/hold_worker", json=body, headers=auth)
        assert resp.status_code == 200 and resp.json()["held"] is True
        time.sleep(0.3)  # several good probes of the held worker
        assert held.url not in healthy_urls(cluster)
        for _ in range(4):
            assert http.post("/generate", json={"text": "a"}).status_code == 200
        assert served_by(cluster.decode) == [0, 4]

        assert http.post("/admin/admit_worker", json=body, headers=auth).status_code == 200
        wait_until(lambda: held.url in healthy_urls(cluster))
        for _ in range(4):
            assert http.post("/generate", json={"text": "a"}).status_code == 200
        assert served_by(cluster.decode)[0] > 0


def test_the_admin_api_is_off_without_a_cluster_token(loop: LoopThread) -> None:
    with start_cluster(loop, decode=1) as cluster, cluster.client() as http:
        url = cluster.decode[0].url
        resp = http.post("/admin/hold_worker", json={"url": url})
        assert resp.status_code == 403 and "no cluster token" in resp.text
        assert url in healthy_urls(cluster)


def test_a_prefill_a_decode_holds_down_gets_no_request_until_the_decode_sees_it_again(
    loop: LoopThread,
) -> None:
    """A prefill pod declared lost and Ready again before the decode saw it answer:
    the decode would fail its rooms (`prefill_pod_lost`), so the router keeps it out."""
    settings: dict[str, Any] = {"health_check_interval_s": 0.05}
    with start_cluster(loop, prefill=2, **settings) as cluster, cluster.client() as http:
        lost, other = cluster.prefill
        decode = cluster.decode[0]
        wait_until(lambda: {lost.url, other.url} <= healthy_urls(cluster))
        decode.behaviour.peers_down = {f"127.0.0.1:{lost.bootstrap_port}": "prefill_pod_lost"}
        wait_until(lambda: lost.url not in healthy_urls(cluster))
        workers = {w["url"]: w for w in http.get("/health").json()["workers"]}
        assert workers[lost.url]["last_error"] == (
            f"decode {decode.url} holds it down (prefill_pod_lost)"
        )
        for _ in range(4):
            assert http.post("/generate", json={"text": "a"}).status_code == 200
        assert served_by(cluster.prefill) == [0, 4]
        # The decode's heartbeat saw it answer: it serves again.
        decode.behaviour.peers_down = {}
        wait_until(lambda: lost.url in healthy_urls(cluster))
        for _ in range(4):
            assert http.post("/generate", json={"text": "a"}).status_code == 200
        assert served_by(cluster.prefill)[0] > 0


def test_the_probe_of_a_prefill_discovery_just_added_reads_the_decodes_peers_down(
    loop: LoopThread,
) -> None:
    """The probe spawned for a new pod (outside a round) asks the decodes itself;
    a report naming the bare host holds every prefill on it."""

    def prepare(cluster: Cluster) -> None:
        bootstrap = cluster.prefill[0].bootstrap_port
        cluster.decode[0].behaviour.peers_down = {"127.0.0.1": f"prefill_pod_lost:{bootstrap}"}

    with start_cluster(loop, prepare=prepare, health_check_interval_s=60.0) as cluster:
        prefill, decode = cluster.prefill[0], cluster.decode[0]
        state = cluster.state
        assert state.checker is not None
        # At startup no decode was healthy yet when the prefill was checked.
        wait_until(lambda: decode.url in healthy_urls(cluster))
        loop.run(state.checker.probe(state.pool.get(prefill.url)))  # type: ignore[arg-type]
        assert prefill.url not in healthy_urls(cluster)
        with cluster.client() as http:
            resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
        assert resp.status_code == 503, resp.text
        assert not prefill.received and not decode.received
