"""vLLM with our connector as the router drives it: a room on both legs, sent at once,
aimed at the prefill's side port (the flow against real engines is tests/vllm_connector)."""

from __future__ import annotations

import random

import httpx
import pytest

from pdcluster.runtime.router.bodies import ClientRequest, Endpoint
from pdcluster.runtime.router.cli import parse_invocation
from pdcluster.runtime.router.config import RouterConfig
from pdcluster.runtime.router.discovery import KubernetesDiscoverySettings, decide_pod
from pdcluster.runtime.router.health import HealthChecker
from pdcluster.runtime.router.leg_plan import LegFlow, LegPlanner, leg_flow_of
from pdcluster.runtime.router.policies import make_policy
from pdcluster.runtime.router.rooms import RidMinter
from pdcluster.runtime.router.workers import WorkerPool, WorkerTarget
from pdcluster.runtime.spec import EngineKind, Role, VllmKVConnector, parse_spec
from pdcluster.runtime.vllm_connector.params import parse_room_params

OURS = VllmKVConnector.pdcluster


def test_our_connector_pairs_legs_by_a_room() -> None:
    assert leg_flow_of(EngineKind.vllm, OURS) is LegFlow.room_params
    assert leg_flow_of(EngineKind.vllm, VllmKVConnector.nixl) is LegFlow.kv_params
    assert leg_flow_of(EngineKind.builtin, OURS) is LegFlow.bootstrap


def pool_of(side_port: int | None = 9100) -> WorkerPool:
    pool = WorkerPool()
    pool.sync(
        [
            WorkerTarget("http://10.0.0.1:8000", Role.prefill, side_port=side_port),
            WorkerTarget("http://10.0.1.1:8000", Role.decode, side_port=9200),
        ]
    )
    return pool


async def probe_all(pool: WorkerPool, peers_down: dict[str, str] | None = None) -> HealthChecker:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":  # only a decode's side port is asked
            assert (request.url.host, request.url.port) == ("10.0.1.1", 9200)
            return httpx.Response(200, json={"peers_down": peers_down or {}})
        return httpx.Response(200, json={"status": "ok"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    checker = HealthChecker(
        pool, client, interval_s=1, timeout_s=1, reads_server_info=False, reads_side_ports=True
    )
    await checker.probe_all()
    await checker.probe_all()  # a decode's verdicts count once it is healthy itself
    await client.aclose()
    return checker


def planner(pool: WorkerPool) -> LegPlanner:
    rng = random.Random(0)
    return LegPlanner(
        pool=pool,
        disaggregated=True,
        prefill_policy=make_policy("round_robin"),
        decode_policy=make_policy("round_robin"),
        colocated_policy=make_policy("round_robin"),
        rids=RidMinter(rng),
        rooms_source=rng,
        engine=EngineKind.vllm,
        connector=OURS,
    )


async def test_both_legs_name_one_room_at_the_prefills_side_port() -> None:
    pool = pool_of()
    await probe_all(pool)
    body = {"model": "m", "prompt": "hi", "max_tokens": 64, "stream": True, "min_tokens": 2}
    plan = planner(pool).plan(ClientRequest(Endpoint.completions, body, True, "m"), set())
    assert plan.flow is LegFlow.room_params and plan.room is not None
    assert plan.prefill is not None and plan.prefill.url == "http://10.0.0.1:8000"
    prefill, decode = plan.prefill_body, plan.body
    assert prefill is not None
    # The decode leg is the client's; the prefill leg computes one token, unstreamed.
    assert decode["max_tokens"] == 64 and decode["stream"] is True
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False and "min_tokens" not in prefill
    # Both carry the room where our connector reads it.
    for leg in (prefill, decode):
        room = parse_room_params(leg["kv_transfer_params"])
        assert room is not None and room.room == plan.room
        assert room.bootstrap == "10.0.0.1:9100" and room.rid == plan.rid
    assert plan.prefill_content != plan.content


async def test_a_prefill_without_a_side_port_never_joins_the_pool() -> None:
    pool = pool_of(side_port=None)
    await probe_all(pool)
    (prefill,) = pool.of_role(Role.prefill)
    assert not prefill.healthy and "side port" in prefill.last_error


async def test_a_prefill_a_decode_holds_down_leaves_the_pool() -> None:
    pool = pool_of()
    await probe_all(pool, {"10.0.0.1:9100": "prefill_pod_lost"})
    (prefill,) = pool.of_role(Role.prefill)
    assert not prefill.healthy


def test_side_ports_come_from_the_cli_or_the_pods_annotation() -> None:
    inv = parse_invocation(
        [
            "--model-name",
            "m",
            "--prefill",
            "http://127.0.0.1:8100",
            "--decode",
            "http://127.0.0.1:8200",
            "--side-port",
            "http://127.0.0.1:8100=9100",
        ],
        env={},
    )
    assert inv.config.side_ports == {"http://127.0.0.1:8100": 9100}
    with pytest.raises(ValueError, match="URL=PORT"):
        parse_invocation(["--model-name", "m", "--side-port", "nope"], env={})
    pod = {
        "metadata": {
            "name": "p",
            "labels": {"pdcluster.io/role": "prefill"},
            "annotations": {
                "pdcluster.io/http-port": "8000",
                "pdcluster.io/bootstrap-port": "8998",
            },
        },
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.5",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    decision = decide_pod(pod, KubernetesDiscoverySettings(namespace="ns"))
    assert decision.target is not None and decision.target.side_port == 8998


def test_the_router_reads_the_connector_from_the_manifest() -> None:
    spec = parse_spec(
        {
            "engine": {"kind": "vllm", "vllm": {"kvConnector": "PDClusterConnector"}},
            "model": {"name": "m", "path": "/models/m"},
            "transfer": {"backend": "tcp"},
            "prefill": {},
            "decode": {},
        }
    )
    config = RouterConfig.from_spec(
        spec, prefill_urls=["http://a:1"], decode_urls=["http://b:1"], side_ports={"http://a:1": 9}
    )
    assert config.uses_side_ports and config.kv_connector is OURS
    with pytest.raises(ValueError, match="side port"):
        RouterConfig.from_spec(
            spec, prefill_urls=["http://a:1"], decode_urls=["http://b:1"], side_ports={"x": 0}
        )
