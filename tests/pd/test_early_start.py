"""The early-start budget: unpaired prompts compute, within a bound that cannot starve paired ones.

The pure budget (`pd/early_start.py`) exhaustively and as a state machine,
then the prefill coordinator on a real engine: a room within the budget is
in the engine before it is paired, one past it only once every rank
reported `paired`, and leaving (pairing, failing) gives the budget back.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.engine.engine import LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.pd.early_start import EarlyStartBudget, early_start_limit
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd_worker.coordinator import Leg, PrefillCoordinator
from pdcluster.runtime.pd_worker.group import GroupReport
from pdcluster.runtime.serving.engine_service import EngineService


@pytest.mark.parametrize(
    ("pool", "max_prompt", "limit"),
    [
        (8192, 4096, 4096),  # a 2,000-token prompt starts unpaired too
        (8192, 8000, 192),  # what the longest prompt leaves free
        (4096, 4096, 0),  # nothing left beside the longest prompt: never unpaired
        (1024, 4096, 0),  # a pool smaller than the longest prompt
        (8192, 1, 8191),
    ],
)
def test_the_limit_leaves_room_for_the_longest_prompt(
    pool: int, max_prompt: int, limit: int
) -> None:
    assert early_start_limit(pool, max_prompt) == limit


def test_prompts_start_until_the_budget_is_spent_and_leaving_gives_it_back() -> None:
    budget = EarlyStartBudget(100)
    assert budget.try_start(1, 60)
    assert not budget.try_start(2, 41)  # 101 > 100: starts once paired
    assert budget.try_start(3, 40)  # exactly 100
    assert budget.unpaired_tokens == 100 and budget.holds(1) and not budget.holds(2)
    budget.leave(1)
    budget.leave(1)  # paired, then forgotten: counted back once
    assert budget.unpaired_tokens == 40
    assert budget.try_start(2, 41)
    assert budget.unpaired_tokens == 81


def test_a_zero_budget_starts_nothing_unpaired() -> None:
    budget = EarlyStartBudget(0)
    assert not budget.try_start(1, 1)
    assert budget.unpaired_tokens == 0


def test_bad_calls_are_refused_and_change_nothing() -> None:
    with pytest.raises(ValueError, match="limit >= 0"):
        EarlyStartBudget(-1)
    budget = EarlyStartBudget(10)
    assert budget.try_start(1, 5)
    with pytest.raises(ValueError, match="already started unpaired"):
        budget.try_start(1, 1)
    with pytest.raises(ValueError, match="at least one token"):
        budget.try_start(2, 0)
    assert budget.unpaired_tokens == 5 and not budget.holds(2)


@given(
    st.integers(0, 64),
    st.lists(
        st.tuples(st.sampled_from(["start", "leave"]), st.integers(0, 7), st.integers(1, 40)),
        max_size=60,
    ),
)
def test_random_starts_and_leaves_never_exceed_the_limit(
    limit: int, ops: list[tuple[str, int, int]]
) -> None:
    budget = EarlyStartBudget(limit)
    model: dict[int, int] = {}
    for op, room, tokens in ops:
        if op == "leave":
            budget.leave(room)
            model.pop(room, None)
        elif room not in model:
            fits = sum(model.values()) + tokens <= limit
            assert budget.try_start(room, tokens) is fits
            if fits:
                model[room] = tokens
        assert budget.unpaired_tokens == sum(model.values()) <= limit
        assert all(budget.holds(r) for r in model)


# ------------------------------------------------------------ the coordinator

PAGE = 16


def _coordinator(limit: int, group_size: int = 2) -> tuple[PrefillCoordinator, LLMEngine]:
    engine = LLMEngine(EngineConfig(num_pages=64, page_size=PAGE, chunk_size=64))
    ctx = SimpleNamespace(room_settings=RoomSettings(), stats={}, page_size=PAGE)
    agent: Any = SimpleNamespace(
        ctx=ctx, broadcast=lambda msg, here_now=False: None, post=lambda fn: None
    )
    service = EngineService(engine, ByteTokenizer())
    coord = PrefillCoordinator(
        agent, service, group_size, WorkerMetrics("prefill"), early_start=EarlyStartBudget(limit)
    )
    return coord, engine


def _open(coord: PrefillCoordinator, room: int, tokens: int) -> str:
    rid = f"rid-{room}"
    coord.open(Leg(room, rid, list(range(1, tokens + 1)), SamplingParams(max_tokens=1)))
    return rid


def _report(coord: PrefillCoordinator, room: int, kind: Any, ranks: range) -> None:
    for rank in ranks:
        coord._queue_report(GroupReport(room, rank, kind))
    coord.tick()


def _in_engine(engine: LLMEngine, rid: str) -> bool:
    return engine.scheduler.get(rid) is not None


def test_the_coordinator_computes_within_the_budget_before_pairing_and_past_it_after() -> None:
    coord, engine = _coordinator(limit=48)
    small, large = _open(coord, 1, 32), _open(coord, 2, 40)
    _report(coord, 1, "start", range(2))
    _report(coord, 2, "start", range(2))
    assert _in_engine(engine, small)  # 32 ≤ 48: computes while decode reserves
    assert not _in_engine(engine, large)  # 32 + 40 > 48: waits for its pairing
    _report(coord, 2, "paired", range(1))
    assert not _in_engine(engine, large)  # one rank of two is paired: not yet
    _report(coord, 2, "paired", range(1, 2))
    assert _in_engine(engine, large)
    assert coord.early_start is not None
    assert coord.early_start.unpaired_tokens == 32
    _report(coord, 1, "paired", range(2))
    assert coord.early_start.unpaired_tokens == 0


def test_a_room_paired_before_every_rank_opened_it_starts_outside_the_budget() -> None:
    coord, engine = _coordinator(limit=0)
    rid = _open(coord, 7, 20)
    _report(coord, 7, "paired", range(2))
    assert not _in_engine(engine, rid)  # no rank reported start yet
    _report(coord, 7, "start", range(2))
    assert _in_engine(engine, rid)
    assert coord.early_start is not None and coord.early_start.unpaired_tokens == 0


def test_a_failed_unpaired_room_gives_its_budget_back_and_a_deferred_one_never_starts() -> None:
    coord, engine = _coordinator(limit=40)
    first, second = _open(coord, 1, 40), _open(coord, 2, 10)
    _report(coord, 1, "start", range(2))
    _report(coord, 2, "start", range(2))
    assert _in_engine(engine, first) and not _in_engine(engine, second)
    _report(coord, 2, "failed", range(1))
    _report(coord, 2, "released", range(2))
    _report(coord, 2, "paired", range(2))  # late: the room is gone
    assert not _in_engine(engine, second)
    _report(coord, 1, "failed", range(1))
    _report(coord, 1, "released", range(2))
    assert coord.early_start is not None and coord.early_start.unpaired_tokens == 0
    assert not _in_engine(engine, first)
