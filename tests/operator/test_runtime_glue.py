"""The work queue, kopf registration, the operator's entry point and settings."""

from __future__ import annotations

import asyncio

import kopf
import pytest

from pdcluster.operator.__main__ import build_kopf_args
from pdcluster.operator.reconcile.workqueue import MAX_BACKOFF_EXPONENT, WorkQueue, retry_delay
from pdcluster.operator.settings import OperatorSettings


async def test_burst_of_triggers_becomes_one_reconcile() -> None:
    runs: list[str] = []

    async def handler(key: str) -> float | None:
        runs.append(key)
        return None

    queue: WorkQueue[str] = WorkQueue(handler, num_workers=2)
    for _ in range(50):
        queue.add("a")
    queue.add("b")
    queue.start()
    await queue.wait_idle(5)
    await queue.stop()
    assert sorted(runs) == ["a", "b"]


async def test_key_never_runs_twice_at_once_and_a_trigger_during_a_run_is_kept() -> None:
    active, overlaps, runs = set(), 0, 0
    gate = asyncio.Event()

    async def handler(key: str) -> float | None:
        nonlocal overlaps, runs
        overlaps += key in active
        active.add(key)
        runs += 1
        if runs == 1:
            await gate.wait()
        active.discard(key)
        return None

    queue: WorkQueue[str] = WorkQueue(handler, num_workers=4)
    queue.start()
    queue.add("a")
    await asyncio.sleep(0.05)
    queue.add("a")  # arrives while the first run is blocked
    queue.add("a")
    await asyncio.sleep(0.05)
    gate.set()
    await queue.wait_idle(5)
    await queue.stop()
    assert overlaps == 0 and runs == 2


async def test_requested_delay_and_retry_back_off() -> None:
    clock = [0.0]
    calls: list[tuple[str, float]] = []

    async def handler(key: str) -> float | None:
        calls.append((key, clock[0]))
        if key == "boom":
            raise RuntimeError("transient")
        return 10.0 if len(calls) < 3 else None

    queue: WorkQueue[str] = WorkQueue(
        handler, retry_delay_s=2, max_retry_delay_s=5, clock=lambda: clock[0]
    )
    queue.add("k")
    queue.start()
    await queue.wait_idle(5)
    assert calls == [("k", 0.0)] and queue.is_pending("k")
    clock[0] = 10.0
    queue.add("other", 100)  # a later due time elsewhere does not block "k"
    queue._wake.set()
    await queue.wait_idle(5)
    assert calls[-1] == ("k", 10.0)
    queue.add("boom")
    await queue.wait_idle(5)
    queue.forget("other")
    for expected_delay in (2.0, 4.0, 5.0):
        clock[0] += expected_delay
        queue._wake.set()
        await queue.wait_idle(5)
    boom_times = [t for k, t in calls if k == "boom"]
    assert [b - a for a, b in zip(boom_times, boom_times[1:], strict=False)] == [2.0, 4.0, 5.0]
    queue.forget("boom")
    assert not queue.is_pending("boom")
    await queue.stop()


async def test_a_key_failing_forever_keeps_retrying_and_never_stops_the_queue() -> None:
    # Past ~1,000 failures an uncapped 2**n back-off overflows a float; the
    # exception used to end the worker task, and with it the queue.
    clock = [0.0]
    runs: list[str] = []

    async def handler(key: str) -> float | None:
        runs.append(key)
        if key == "boom":
            raise RuntimeError("always")
        return None

    queue: WorkQueue[str] = WorkQueue(
        handler, num_workers=1, retry_delay_s=1.0, max_retry_delay_s=60.0, clock=lambda: clock[0]
    )
    queue.start()
    queue.add("boom")
    for _ in range(1100):
        await queue.wait_idle(5)
        clock[0] += 60.0
        queue._wake.set()
    await queue.wait_idle(5)
    assert runs.count("boom") >= 1100 and queue.is_pending("boom")
    queue.add("ok")
    await queue.wait_idle(5)
    assert runs[-1] == "ok"
    await queue.stop()


def test_retry_delay_doubles_and_is_capped_for_any_failure_count() -> None:
    assert [retry_delay(n, 1.0, 60.0) for n in (1, 2, 3, 7, 10_000)] == [1, 2, 4, 60, 60]
    assert retry_delay(10**9, 0.5, 1e300) == 0.5 * 2**MAX_BACKOFF_EXPONENT


def test_handlers_register_every_trigger() -> None:
    from pdcluster.operator import handlers

    registry = kopf.get_default_registry()
    changing = registry._changing.get_all_handlers()  # noqa: SLF001 - kopf exposes no public list
    by_fn = {h.fn.__name__: h for h in changing}
    assert {"on_cluster", "on_cluster_deleted"} <= set(by_fn)
    assert by_fn["on_cluster_deleted"].requires_finalizer is False  # deletion never waits on us
    watching = registry._watching.get_all_handlers()  # noqa: SLF001
    watched = {(h.fn.__name__, h.selector.group, h.selector.any_name) for h in watching}
    assert watched >= {
        ("on_child_pod", "", "pods"),
        ("on_child", "", "services"),
        ("on_child", "", "configmaps"),
        ("on_child", "apps", "deployments"),
    }
    assert handlers.CHILD_LABELS == {"pdcluster.io/cluster": kopf.PRESENT}


def test_entry_point_watches_all_namespaces_unless_told_otherwise() -> None:
    base = ["run", "--standalone", "-m", "pdcluster.operator.handlers"]
    assert build_kopf_args([]) == [*base, "--all-namespaces"]
    assert build_kopf_args(["-n", "team-a"]) == [*base, "-n", "team-a"]
    assert build_kopf_args(["--namespace=team-*"]) == [*base, "--namespace=team-*"]


def test_settings_from_environment() -> None:
    s = OperatorSettings.from_env(
        {
            "PDCLUSTER_OPERATOR_METRICS_PORT": "0",
            "PDCLUSTER_OPERATOR_APPLY_CRDS": "false",
            "PDCLUSTER_OPERATOR_RESYNC_SECONDS": "15",
            "PDCLUSTER_OPERATOR_NOT_READY_GRACE_SECONDS": "0",
            "PDCLUSTER_OPERATOR_FAILURE_POLL_SECONDS": "2.5",
            "PDCLUSTER_OPERATOR_ADMIN_TIMEOUT_SECONDS": "0.5",
            "PDCLUSTER_OPERATOR_METRICS_HOST": "127.0.0.1",
            "PDCLUSTER_OPERATOR_IMAGE_ALLOWLIST": "registry.example/team, pdcluster,",
            "PDCLUSTER_OPERATOR_NAMESPACE": "pdcluster-system",
        }
    )
    assert s.image_allowlist == ("registry.example/team", "pdcluster")
    assert s.operator_namespace == "pdcluster-system"
    assert (s.metrics_port, s.apply_crds, s.resync_interval_s) == (0, False, 15.0)
    assert (s.not_ready_grace_s, s.failure_poll_interval_s, s.admin_timeout_s) == (0, 2.5, 0.5)
    assert s.metrics_host == "127.0.0.1"
    assert OperatorSettings.from_env({}) == OperatorSettings()


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"PDCLUSTER_OPERATOR_METRICS_PORT": "http"}, "is not a number"),
        ({"PDCLUSTER_OPERATOR_METRICS_PORT": "70000"}, "metrics port"),
        ({"PDCLUSTER_OPERATOR_APPLY_CRDS": "maybe"}, "is not true/false"),
        ({"PDCLUSTER_OPERATOR_RESYNC_SECONDS": "0"}, "resync_interval_s must be > 0"),
        ({"PDCLUSTER_OPERATOR_WORKERS": "0"}, "num_workers"),
        ({"PDCLUSTER_OPERATOR_FAILURE_POLL_SECONDS": "nan"}, "not a finite number"),
        ({"PDCLUSTER_OPERATOR_NOT_READY_GRACE_SECONDS": "-1"}, "not_ready_grace_s"),
        ({"PDCLUSTER_OPERATOR_ADMIN_TIMEOUT_SECONDS": "0"}, "admin_timeout_s must be > 0"),
    ],
)
def test_bad_settings_are_refused_with_the_variable_named(env, words) -> None:
    with pytest.raises(ValueError, match=words):
        OperatorSettings.from_env(env)


def test_an_allowlist_entry_with_spaces_is_refused() -> None:
    with pytest.raises(ValueError, match="allowlist entry"):
        OperatorSettings(image_allowlist=("registry example/x",))
