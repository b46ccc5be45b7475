"""A local-mode process notices that its launcher is gone (`local/parent_watch.py`)."""

from __future__ import annotations

import threading
import time

import pytest

from pdcluster.runtime.local.parent_watch import PARENT_PID_ENV, watch_parent


def test_nothing_is_watched_without_the_variable() -> None:
    env = {"OTHER": "1"}
    assert watch_parent(env, on_gone=lambda: pytest.fail("no parent to lose")) is None
    assert env == {"OTHER": "1"}


@pytest.mark.parametrize("value", ["", "launcher", "-4", "1", "0"])
def test_a_value_that_names_no_launcher_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=PARENT_PID_ENV):
        watch_parent({PARENT_PID_ENV: value})


def test_the_variable_is_not_passed_on_and_the_watch_fires_once_when_reparented() -> None:
    env = {PARENT_PID_ENV: "4242", "KEEP": "x"}
    parents = iter([4242, 4242, 4242, 1])
    gone = threading.Event()
    calls: list[float] = []

    def on_gone() -> None:
        calls.append(time.monotonic())
        gone.set()

    watch = watch_parent(env, interval_s=0.01, getppid=lambda: next(parents), on_gone=on_gone)
    assert env == {"KEEP": "x"}, "children of this process must not inherit the launcher's pid"
    assert watch is not None and watch.parent == 4242
    assert gone.wait(5)
    watch.thread.join(5)
    assert not watch.thread.is_alive() and len(calls) == 1


def test_the_watch_stays_quiet_while_the_launcher_lives() -> None:
    checks = threading.Semaphore(0)

    def same_parent() -> int:
        checks.release()
        return 4242

    fired = threading.Event()
    watch = watch_parent(
        {PARENT_PID_ENV: "4242"}, interval_s=0.005, getppid=same_parent, on_gone=fired.set
    )
    assert watch is not None
    try:
        for _ in range(20):  # twenty checks of a live parent
            assert checks.acquire(timeout=5)
        assert not fired.is_set() and watch.thread.is_alive()
    finally:
        watch.stop()
    assert not watch.thread.is_alive()
