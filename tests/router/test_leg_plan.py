from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.router.bodies import ClientRequest, Endpoint
from pdcluster.runtime.router.errors import NoHealthyWorkerError
from pdcluster.runtime.router.leg_plan import LegPlanner
from pdcluster.runtime.router.policies import make_policy
from pdcluster.runtime.router.rooms import RidMinter, is_valid_rid
from pdcluster.runtime.router.workers import ServerInfo, WorkerPool, WorkerTarget
from pdcluster.runtime.spec import Role


def make_leg_planner(
    *, prefill: int = 2, decode: int = 2, colocated: int = 0, dp: int = 1, healthy: bool = True
) -> LegPlanner:
    pool = WorkerPool()
    targets = [WorkerTarget(f"http://10.0.0.{i + 1}:8000", Role.prefill) for i in range(prefill)]
    targets += [WorkerTarget(f"http://10.0.1.{i + 1}:8000", Role.decode) for i in range(decode)]
    targets += [
        WorkerTarget(f"http://10.0.2.{i + 1}:8000", Role.colocated) for i in range(colocated)
    ]
    pool.sync(targets)
    for worker in pool.all():
        port = 8998 if worker.role is Role.prefill else None
        pool.record_probe_success(worker, ServerInfo(bootstrap_port=port, dp_size=dp))
        worker.healthy = healthy or worker.role is not Role.decode
    rng = random.Random(0)
    return LegPlanner(
        pool=pool,
        disaggregated=colocated == 0,
        prefill_policy=make_policy("round_robin"),
        decode_policy=make_policy("round_robin"),
        colocated_policy=make_policy("round_robin"),
        rids=RidMinter(rng),
        rooms_source=rng,
    )


def request(body: dict[str, object] | None = None) -> ClientRequest:
    body = body or {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    return ClientRequest(endpoint=Endpoint.generate, body=body, stream=False, model=None)


def test_pd_plan_targets_prefill_bootstrap_and_keeps_the_client_body() -> None:
    leg_planner = make_leg_planner()
    client = request()
    plan = leg_planner.plan(client, set())
    assert plan.prefill is not None and plan.prefill.role is Role.prefill
    assert plan.main.role is Role.decode
    assert plan.body == {
        **client.body,
        "rid": plan.rid,
        "bootstrap_host": plan.prefill.host,
        "bootstrap_port": 8998,
        "bootstrap_room": plan.room,
    }
    assert "rid" not in client.body
    assert is_valid_rid(plan.rid) and plan.path == "/generate"


def test_colocated_plan_has_one_leg_and_no_bootstrap() -> None:
    leg_planner = make_leg_planner(prefill=0, decode=0, colocated=2)
    plan = leg_planner.plan(request(), set())
    assert plan.prefill is None and plan.room is None
    assert plan.main.role is Role.colocated
    assert set(plan.body) == {"text", "sampling_params", "rid"}


@settings(deadline=None)
@given(st.integers(1, 8), st.integers(1, 40))
def test_rooms_cycle_over_the_dp_groups_of_each_prefill(dp: int, count: int) -> None:
    leg_planner = make_leg_planner(prefill=1, dp=dp)
    in_use: set[int] = set()
    plans = [leg_planner.plan(request(), in_use) for _ in range(count)]
    rooms = [p.room for p in plans]
    assert [r % dp for r in rooms if r is not None] == [i % dp for i in range(count)]
    assert len({p.rid for p in plans}) == count


def test_room_in_use_is_not_reused() -> None:
    leg_planner = make_leg_planner(prefill=1)
    first = leg_planner.plan(request(), set())
    assert first.room is not None
    replay = make_leg_planner(prefill=1)  # same seed: would mint the same room again
    assert replay.plan(request(), {first.room}).room != first.room


def test_no_healthy_decode_is_503_and_leaves_policies_where_they_were() -> None:
    leg_planner = make_leg_planner(healthy=False)
    with pytest.raises(NoHealthyWorkerError) as err:
        leg_planner.plan(request(), set())
    assert err.value.status == 503 and err.value.role == "decode"
    for worker in leg_planner.pool.of_role(Role.decode):
        worker.healthy = True
    plan = leg_planner.plan(request(), set())
    # Round robin starts at the first prefill: the refused request moved nothing.
    assert plan.prefill is leg_planner.pool.of_role(Role.prefill)[0]
    assert plan.room is not None
