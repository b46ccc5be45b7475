from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.router.errors import NoHealthyWorkerError
from pdcluster.runtime.router.policies import (
    LeastOutstanding,
    Policy,
    RandomChoice,
    RoundRobin,
    make_policy,
)
from pdcluster.runtime.router.workers import Worker
from pdcluster.runtime.spec import Role


def make_workers(health: list[bool], outstanding: list[int] | None = None) -> list[Worker]:
    loads = outstanding or [0] * len(health)
    return [
        Worker(url=f"http://127.0.0.1:{9000 + i}", role=Role.decode, healthy=h, outstanding=o)
        for i, (h, o) in enumerate(zip(health, loads, strict=True))
    ]


def test_round_robin_visits_each_healthy_worker_once_per_cycle() -> None:
    workers = make_workers([True, False, True, True])
    policy = RoundRobin()
    picks = [policy.select(workers, "decode").url for _ in range(9)]
    healthy = [w.url for w in workers if w.healthy]
    assert picks == healthy * 3


def test_least_outstanding_picks_the_least_loaded_and_rotates_ties() -> None:
    workers = make_workers([True, True, True], [3, 1, 1])
    policy = LeastOutstanding()
    picks = [policy.select(workers, "decode") for _ in range(4)]
    assert [p.url for p in picks] == [workers[1].url, workers[2].url] * 2


def test_least_outstanding_follows_load_as_it_changes() -> None:
    workers = make_workers([True, True])
    policy = LeastOutstanding()
    for _ in range(10):
        policy.select(workers, "decode").outstanding += 1
    assert [w.outstanding for w in workers] == [5, 5]


def test_least_outstanding_ignores_an_unhealthy_idle_worker() -> None:
    workers = make_workers([False, True], [0, 7])
    assert LeastOutstanding().select(workers, "decode") is workers[1]


def test_random_is_reproducible_from_its_seed_and_roughly_uniform() -> None:
    workers = make_workers([True] * 4)
    a, b = RandomChoice(seed=5), RandomChoice(seed=5)
    picks_a = [a.select(workers, "prefill").url for _ in range(4000)]
    picks_b = [b.select(workers, "prefill").url for _ in range(4000)]
    assert picks_a == picks_b
    counts = Counter(picks_a)
    assert set(counts) == {w.url for w in workers}
    assert all(850 < c < 1150 for c in counts.values())


@pytest.mark.parametrize("name", ["round_robin", "least_outstanding", "random"])
@pytest.mark.parametrize("health", [[], [False, False]], ids=["empty", "unhealthy"])
def test_no_healthy_worker_is_a_503_and_leaves_state_intact(name: str, health: list[bool]) -> None:
    policy: Policy = make_policy(name, seed=1)
    workers = make_workers(health)
    with pytest.raises(NoHealthyWorkerError) as err:
        policy.select(workers, "prefill")
    assert err.value.status == 503
    assert "prefill" in err.value.message
    # State intact: the next selection over healthy workers starts as usual.
    healthy = make_workers([True, True])
    if isinstance(policy, RoundRobin | LeastOutstanding):
        assert policy.select(healthy, "prefill") is healthy[0]


@settings(deadline=None)  # CPU-bound; a loaded CI machine must not flake
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 20)), min_size=1, max_size=12),
    st.sampled_from(["round_robin", "least_outstanding", "random"]),
    st.integers(1, 30),
)
def test_every_pick_is_a_healthy_worker(
    spec: list[tuple[bool, int]], name: str, rounds: int
) -> None:
    workers = make_workers([h for h, _ in spec], [o for _, o in spec])
    policy = make_policy(name, seed=0)
    if not any(w.healthy for w in workers):
        with pytest.raises(NoHealthyWorkerError):
            policy.select(workers, "decode")
        return
    for _ in range(rounds):
        chosen = policy.select(workers, "decode")
        assert chosen.healthy
        if name == "least_outstanding":
            assert chosen.outstanding == min(w.outstanding for w in workers if w.healthy)


def test_make_policy_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="round_robin, least_outstanding, random"):
        make_policy("fastest")
