"""The pool's add and remove (pure): what local-mode autoscaling calls."""

from __future__ import annotations

import pytest

from pdcluster.runtime.router.workers import ServerInfo, WorkerPool
from pdcluster.runtime.spec import Role

URL = "http://127.0.0.1:9001"


def test_an_added_worker_starts_unhealthy_and_adding_it_again_returns_it() -> None:
    pool = WorkerPool()
    worker = pool.add(URL + "/", Role.prefill)
    assert worker.url == URL and not worker.healthy
    assert pool.add(URL, Role.prefill) is worker and len(pool) == 1
    assert pool.record_probe_success(worker, ServerInfo(bootstrap_port=9100, dp_size=1))
    assert pool.healthy(Role.prefill) == [worker]


def test_adding_a_url_with_another_role_or_a_bad_url_changes_nothing() -> None:
    pool = WorkerPool()
    worker = pool.add(URL, Role.prefill)
    with pytest.raises(ValueError, match="in the pool as prefill"):
        pool.add(URL, Role.decode)
    with pytest.raises(ValueError, match="must name a port"):
        pool.add("http://127.0.0.1", Role.decode)
    assert pool.all() == [worker] and worker.role is Role.prefill


def test_a_worker_with_legs_in_flight_is_not_removed() -> None:
    pool = WorkerPool()
    worker = pool.add(URL, Role.decode)
    pool.acquire(worker)
    with pytest.raises(ValueError, match="1 leg\\(s\\) in flight"):
        pool.remove(worker)
    assert pool.get(URL) is worker
    pool.release(worker)
    pool.remove(worker)
    assert pool.get(URL) is None
    with pytest.raises(ValueError, match="not in the pool"):
        pool.remove(worker)


def test_a_removed_url_added_again_is_a_new_worker() -> None:
    """A late release of a leg on the old object never touches the new one."""
    pool = WorkerPool()
    old = pool.add(URL, Role.decode)
    pool.remove(old)
    new = pool.add(URL, Role.decode)
    assert new is not old and new.outstanding == 0
