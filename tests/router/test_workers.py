from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.router.workers import (
    ServerInfo,
    Worker,
    WorkerPool,
    WorkerTarget,
    bootstrap_address,
    held_down_by,
    normalize_url,
    parse_peers_down,
    parse_server_info,
)
from pdcluster.runtime.spec import Role

P, D = Role.prefill, Role.decode


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
        ("http://127.0.0.1:30000/", "http://127.0.0.1:30000"),
        (" https://Worker-0:8000 ", "https://worker-0:8000"),
        ("http://[::1]:8000", "http://[::1]:8000"),
    ],
)
def test_normalize_url(raw: str, expected: str) -> None:
    assert normalize_url(raw) == expected


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("", "non-empty"),
        ("127.0.0.1:8000", "http://"),
        ("ftp://127.0.0.1:21", "http://"),
        ("http://127.0.0.1", "port"),
        ("http://127.0.0.1:99999", "invalid port"),
        ("http://127.0.0.1:80/v1", "without path"),
        ("http://:80", "no host"),
    ],
)
def test_normalize_url_rejects_bad_urls_with_a_reason(raw: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        normalize_url(raw)


@pytest.mark.parametrize(
    ("info", "role", "expected"),
    [
        ({"disaggregation_mode": "prefill", "bootstrap_port": 8998, "dp_size": 2}, P, (8998, 2)),
        ({"disaggregation_mode": "decode", "dp_size": 1}, D, (None, 1)),
        ({"disaggregation_mode": "decode", "bootstrap_port": 5}, D, (None, 1)),
        ({"disaggregation_mode": "null"}, Role.colocated, (None, 1)),
        ({}, Role.colocated, (None, 1)),
    ],
)
def test_parse_server_info(info: dict[str, Any], role: Role, expected: tuple[Any, int]) -> None:
    parsed = parse_server_info(info, role)
    assert (parsed.bootstrap_port, parsed.dp_size) == expected


@pytest.mark.parametrize(
    ("info", "role", "problem"),
    [
        ([], P, "JSON object"),
        ({"disaggregation_mode": "decode", "bootstrap_port": 1}, P, "listed as prefill"),
        ({"disaggregation_mode": "prefill"}, P, "bootstrap_port"),
        ({"disaggregation_mode": "prefill", "bootstrap_port": 0}, P, "bootstrap_port"),
        ({"disaggregation_mode": "prefill", "bootstrap_port": "8998"}, P, "bootstrap_port"),
        ({"disaggregation_mode": "decode", "dp_size": 0}, D, "dp_size"),
        ({"disaggregation_mode": "decode", "dp_size": True}, D, "dp_size"),
        ({"disaggregation_mode": "prefill", "bootstrap_port": 1}, Role.colocated, "null"),
    ],
)
def test_parse_server_info_rejects_mismatches(info: Any, role: Role, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_server_info(info, role)


def test_sync_adds_removes_and_keeps_state_of_workers_that_stay() -> None:
    pool = WorkerPool()
    a, b, c = (f"http://127.0.0.1:{p}" for p in (1001, 1002, 1003))
    change = pool.sync([WorkerTarget(a, P), WorkerTarget(b, D)])
    assert {w.url for w in change.added} == {a, b} and not change.removed
    worker_a = pool.get(a)
    assert worker_a is not None and not worker_a.healthy  # unprobed workers are no candidates
    pool.record_probe_success(worker_a, ServerInfo(bootstrap_port=7, dp_size=1))
    change = pool.sync([WorkerTarget(a + "/", P), WorkerTarget(c, D)])
    assert [w.url for w in change.added] == [c]
    assert [w.url for w in change.removed] == [b]
    assert pool.get(a) is worker_a and worker_a.healthy


def test_sync_replaces_a_worker_whose_role_changed() -> None:
    pool = WorkerPool()
    url = "http://127.0.0.1:1001"
    pool.sync([WorkerTarget(url, P)])
    old = pool.get(url)
    change = pool.sync([WorkerTarget(url, D)])
    assert change.removed == (old,)
    new = pool.get(url)
    assert new is not None and new.role is D and new is not old


def test_sync_rejects_one_url_with_two_roles_and_keeps_the_pool() -> None:
    pool = WorkerPool()
    url = "http://127.0.0.1:1001"
    pool.sync([WorkerTarget(url, P)])
    before = pool.all()
    with pytest.raises(ValueError, match="both prefill and decode"):
        pool.sync([WorkerTarget(url, P), WorkerTarget(url, D)])
    assert pool.all() == before


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_worker_leaves_after_threshold_failures_and_one_success_brings_it_back(
    threshold: int,
) -> None:
    pool = WorkerPool(failure_threshold=threshold)
    pool.sync([WorkerTarget("http://127.0.0.1:1001", P)])
    worker = pool.all()[0]
    info = ServerInfo(bootstrap_port=8998, dp_size=2)
    assert pool.record_probe_success(worker, info) is True
    assert worker.healthy and worker.bootstrap_port == 8998 and worker.dp_size == 2
    for _ in range(threshold - 1):
        assert pool.record_probe_failure(worker, "refused") is False
        assert worker.healthy
    assert pool.record_probe_failure(worker, "refused") is True
    assert not worker.healthy and worker.last_error == "refused"
    assert pool.healthy(P) == []
    # Coming back needs fresh server info (the port may have changed).
    assert not worker.has_info
    assert pool.record_probe_success(worker, None) is False
    assert pool.record_probe_success(worker, ServerInfo(9000, 1)) is True
    assert worker.healthy and worker.bootstrap_port == 9000
    assert pool.healthy(P) == [worker]


def test_success_resets_the_failure_count() -> None:
    pool = WorkerPool(failure_threshold=2)
    pool.sync([WorkerTarget("http://127.0.0.1:1001", D)])
    worker = pool.all()[0]
    pool.record_probe_success(worker, ServerInfo(None, 1))
    pool.record_probe_failure(worker, "x")
    pool.record_probe_success(worker, None)
    pool.record_probe_failure(worker, "x")
    assert worker.healthy


def test_unreachable_leg_drops_a_worker_at_once() -> None:
    pool = WorkerPool(failure_threshold=5)
    pool.sync([WorkerTarget("http://127.0.0.1:1001", D)])
    worker = pool.all()[0]
    pool.record_probe_success(worker, ServerInfo(None, 1))
    assert pool.mark_unreachable(worker, "connection refused") is True
    assert not worker.healthy
    assert pool.mark_unreachable(worker, "connection refused") is False


def test_outstanding_never_goes_negative() -> None:
    worker = Worker(url="http://127.0.0.1:1", role=D)
    WorkerPool.acquire(worker)
    WorkerPool.release(worker)
    with pytest.raises(RuntimeError, match="release without acquire"):
        WorkerPool.release(worker)
    assert worker.outstanding == 0


@given(st.integers(1, 16), st.integers(0, 200))
def test_dp_ranks_rotate_over_every_group(dp: int, draws: int) -> None:
    worker = Worker(url="http://127.0.0.1:1", role=P, dp_size=dp)
    ranks = [worker.take_dp_rank() for _ in range(draws)]
    assert ranks == [i % dp for i in range(draws)]


def test_worker_pool_rejects_a_zero_threshold() -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        WorkerPool(failure_threshold=0)


PREFILL = Worker(url="http://10.0.0.5:8000", role=P, bootstrap_port=8998, has_info=True)


@pytest.mark.parametrize(
    ("peers_down", "expected"),
    [
        ({}, None),
        ({"http://d:8000": {}}, None),
        ({"http://d:8000": {"10.0.0.6:8998": "prefill_pod_lost"}}, None),  # another pod
        ({"http://d:8000": {"10.0.0.5:9000": "prefill_pod_lost"}}, None),  # another instance
        (
            {"http://d:8000": {"10.0.0.5:8998": "prefill_pod_lost"}},
            "decode http://d:8000 holds it down (prefill_pod_lost)",
        ),
        (
            {"http://d:8000": {"10.0.0.5": "prefill_pod_removed"}},
            "decode http://d:8000 holds it down (prefill_pod_removed)",
        ),
        # The decode's heartbeat verdict: it probes the prefill for a new room itself.
        ({"http://d:8000": {"10.0.0.5:8998": "prefill_unreachable"}}, None),
        (
            {"http://b:8000": {"10.0.0.5:8998": "b"}, "http://a:8000": {"10.0.0.5:8998": "a"}},
            "decode http://a:8000 holds it down (a)",
        ),
    ],
)
def test_a_prefill_is_held_down_by_a_decode_naming_its_address_or_host(
    peers_down: dict[str, dict[str, str]], expected: str | None
) -> None:
    assert held_down_by(PREFILL, peers_down) == expected


def test_only_a_prefill_with_a_bootstrap_port_has_an_address_decodes_know() -> None:
    assert bootstrap_address(PREFILL) == "10.0.0.5:8998"
    assert bootstrap_address(Worker(url="http://[::1]:8000", role=P, bootstrap_port=1)) == "[::1]:1"
    assert bootstrap_address(Worker(url="http://10.0.0.5:8000", role=P)) is None
    decode = Worker(url="http://10.0.0.5:8000", role=D, bootstrap_port=8998)
    assert bootstrap_address(decode) is None
    assert held_down_by(decode, {"http://d:8000": {"10.0.0.5:8998": "x"}}) is None


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        (
            {"peers_down": {"10.0.0.5:8998": "prefill_pod_lost"}},
            {"10.0.0.5:8998": "prefill_pod_lost"},
        ),
        ({}, {}),
        ({"peers_down": None}, {}),
        ({"peers_down": ["10.0.0.5:8998"]}, {}),
        ([], {}),
        ("peers", {}),
    ],
)
def test_peers_down_reads_only_a_mapping(info: Any, expected: dict[str, str]) -> None:
    assert parse_peers_down(info) == expected


def test_a_held_down_prefill_leaves_the_pool_once_and_comes_back_on_a_good_probe() -> None:
    pool = WorkerPool(failure_threshold=3)
    pool.sync([WorkerTarget(url=PREFILL.url, role=P)])
    worker = pool.get(PREFILL.url)
    assert worker is not None
    assert pool.record_probe_success(worker, ServerInfo(bootstrap_port=8998, dp_size=1))
    assert pool.record_peer_down(worker, "held") is True
    assert pool.record_peer_down(worker, "held") is False
    assert not worker.healthy and worker.has_info and worker.last_error == "held"
    assert pool.healthy(P) == []
    assert pool.record_probe_success(worker, None) is True
