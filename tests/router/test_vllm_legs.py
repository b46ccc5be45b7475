"""vLLM's disaggregated flow as the router plans it: leg bodies, the per-engine
leg flow, prefill re-picking and the prefill watch (pure parts; the flow
against real vLLM processes is tests/vllm/test_vllm_pd.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.router.bodies import ClientRequest, Endpoint, check_request
from pdcluster.runtime.router.config import RouterConfig
from pdcluster.runtime.router.errors import RouterError
from pdcluster.runtime.router.leg_plan import LegFlow, LegPlanner, leg_flow_of
from pdcluster.runtime.router.policies import make_policy
from pdcluster.runtime.router.prefill_watch import PrefillWatch
from pdcluster.runtime.router.rooms import RidMinter
from pdcluster.runtime.router.vllm_legs import (
    PREFILL_KV_PARAMS,
    KVParamsError,
    build_decode_body,
    build_prefill_body,
    read_kv_params,
)
from pdcluster.runtime.router.workers import ServerInfo, Worker, WorkerPool, WorkerTarget
from pdcluster.runtime.spec import EngineKind, Role

# What vLLM 0.32's NixlConnector prefill answered in this repository's runs.
ANSWER: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "6ccece01-0cc1-44fc-8aea-da85d1d91175",
    "remote_request_id": "cmpl-a0d86828ba751013-0-98895725",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 193,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
}


def test_the_prefill_leg_computes_one_token_unstreamed_and_keeps_the_kv() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 8,
        "temperature": 0,
    }
    leg = build_prefill_body(body, Endpoint.completions)
    assert leg == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "stream": False,
        "temperature": 0,
        "kv_transfer_params": PREFILL_KV_PARAMS,
    }
    assert body["max_tokens"] == 64, "the client's body is left as it was"
    leg["kv_transfer_params"]["remote_host"] = "x"
    assert PREFILL_KV_PARAMS["remote_host"] is None, "each leg gets its own copy"


def test_a_chat_prefill_caps_max_completion_tokens_too() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert "max_completion_tokens" not in build_prefill_body(body, Endpoint.chat)
    leg = build_prefill_body({**body, "max_completion_tokens": 9}, Endpoint.chat)
    assert leg["max_completion_tokens"] == 1 and leg["max_tokens"] == 1


def test_the_decode_leg_is_the_clients_body_with_the_prefills_answer() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 64, "stream": True}
    params = read_kv_params({"choices": [], "kv_transfer_params": ANSWER})
    assert build_decode_body(body, params) == {**body, "kv_transfer_params": ANSWER}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([], "not a JSON object"),
        ({"choices": []}, "answered no kv_transfer_params"),
        ({"kv_transfer_params": None}, "answered no kv_transfer_params"),
        ({"kv_transfer_params": {**ANSWER, "do_remote_prefill": False}}, "do not offer its KV"),
        ({"kv_transfer_params": {**ANSWER, "remote_host": None}}, "lack remote_host"),
        (
            {
                "kv_transfer_params": {
                    k: v for k, v in ANSWER.items() if not k.startswith("remote_")
                }
            },
            "lack remote_engine_id, remote_block_ids, remote_host, remote_port",
        ),
    ],
)
def test_a_prefill_answer_without_usable_kv_params_is_refused(payload: Any, message: str) -> None:
    with pytest.raises(KVParamsError, match=message):
        read_kv_params(payload)


def test_clients_cannot_send_kv_transfer_params() -> None:
    body = {"model": "m", "prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}}
    with pytest.raises(RouterError) as err:
        check_request(Endpoint.completions, body, disaggregated=True)
    assert err.value.status == 400 and err.value.param == "kv_transfer_params"


def planner(
    engine: EngineKind, prefills: int = 3, revisions: tuple[str, ...] = ("",)
) -> LegPlanner:
    pool = WorkerPool()
    targets = [
        WorkerTarget(f"http://10.0.0.{i + 1}:8000", Role.prefill, revisions[i % len(revisions)])
        for i in range(prefills)
    ]
    targets.append(WorkerTarget("http://10.0.1.1:8000", Role.decode, revisions[0]))
    pool.sync(targets)
    for worker in pool.all():
        # vLLM workers report no bootstrap port (the health checker synthesizes this).
        pool.record_probe_success(worker, ServerInfo(bootstrap_port=None, dp_size=1))
    rng = random.Random(0)
    return LegPlanner(
        pool=pool,
        disaggregated=True,
        prefill_policy=make_policy("round_robin"),
        decode_policy=make_policy("round_robin"),
        colocated_policy=make_policy("round_robin"),
        rids=RidMinter(rng),
        rooms_source=rng,
        engine=engine,
    )


def test_each_engine_has_its_leg_flow() -> None:
    assert leg_flow_of(EngineKind.builtin) is LegFlow.bootstrap
    assert leg_flow_of(EngineKind.vllm) is LegFlow.kv_params


def test_a_vllm_plan_has_no_room_and_leaves_the_body_to_the_relay() -> None:
    body = {"model": "m", "prompt": "hi", "data_parallel_rank": 3}
    request = ClientRequest(Endpoint.completions, body, stream=False, model="m")
    plan = planner(EngineKind.vllm).plan(request, set())
    assert plan.flow is LegFlow.kv_params
    assert plan.room is None and plan.prefill is not None
    assert plan.request is request
    # No `rid` field (vLLM names a request by X-Request-Id); the router's fields stripped.
    assert plan.body == {"model": "m", "prompt": "hi"}


def test_a_builtin_plan_without_a_bootstrap_port_is_refused() -> None:
    request = ClientRequest(Endpoint.completions, {"model": "m", "prompt": "hi"}, False, "m")
    with pytest.raises(RouterError, match="no bootstrap port"):
        planner(EngineKind.builtin).plan(request, set())


@given(lost=st.lists(st.integers(0, 4), unique=True))
def test_repick_offers_each_healthy_prefill_of_the_revision_once(lost: list[int]) -> None:
    legs = planner(EngineKind.vllm, prefills=5, revisions=("a", "b"))
    pool = legs.pool
    decode = pool.of_role(Role.decode)[0]
    prefills = pool.of_role(Role.prefill)
    for i in lost:
        pool.mark_unreachable(prefills[i], "gone")
    tried: list[Worker] = []
    while (nxt := legs.repick_prefill(decode, tried)) is not None:
        assert nxt.healthy and nxt.revision == decode.revision and nxt not in tried
        tried.append(nxt)
    expected = {p for i, p in enumerate(prefills) if i not in lost and p.revision == "a"}
    assert set(tried) == expected


def test_the_prefill_watch_tells_each_watcher_of_a_lost_prefill_once() -> None:
    watch = PrefillWatch()
    a, b = Worker("http://a:1", Role.prefill), Worker("http://b:1", Role.prefill)
    told: list[tuple[str, str, str]] = []

    def watcher(name: str) -> Any:
        return lambda worker, reason: told.append((name, worker.url, reason))

    one, two, three = watcher("one"), watcher("two"), watcher("three")
    watch.watch(a, one)
    watch.watch(a, two)
    watch.watch(b, three)
    watch.unwatch(a, two)
    watch.unwatch(b, two)  # never watched b: nothing happens
    assert watch.watching(a) == 1
    assert watch.lost(a, "exit -9") == 1
    assert watch.lost(a, "exit -9") == 0
    assert told == [("one", "http://a:1", "exit -9")]
    assert watch.watching(b) == 1


def test_a_vllm_router_refuses_cache_aware_and_aborts_by_closing_legs() -> None:
    urls = {"prefill_urls": ("http://a:1",), "decode_urls": ("http://b:1",)}
    vllm = RouterConfig(engine=EngineKind.vllm, **urls)
    assert not vllm.reads_server_info and not vllm.aborts_by_rid
    assert RouterConfig(**urls).aborts_by_rid
    with pytest.raises(ValueError, match="cache_aware needs page keys"):
        RouterConfig(engine=EngineKind.vllm, prefill_policy="cache_aware", **urls)
