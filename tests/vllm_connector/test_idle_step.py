"""A step that computes nothing waits for a load to end instead of spinning vLLM's loop."""

from __future__ import annotations

import threading
import time

import pytest

from pdcluster.runtime.pd_worker.group import GroupOpen, GroupReport
from pdcluster.runtime.vllm_connector import worker as worker_module
from pdcluster.runtime.vllm_connector.commands import StepCommands
from pdcluster.runtime.vllm_connector.settings import load_settings
from pdcluster.runtime.vllm_connector.worker import ConnectorWorker
from tests.vllm_connector.test_params import facts as engine_facts


class _Agent:
    """Stands in for the rank agent: takes the step's commands and does nothing."""

    def run_or_post(self, fn) -> None:
        fn()

    def on_group(self, cmd, now: float) -> None:
        pass


def decode_worker() -> ConnectorWorker:
    facts = engine_facts(tp_size=1, tp_rank=0)
    settings = load_settings({"sidePort": 8998}, {})
    w = ConnectorWorker(settings, facts, "token", "decode-tp0")
    w.agent = _Agent()  # type: ignore[assignment]
    return w


def open_room(w: ConnectorWorker, step: int, idle: bool) -> None:
    cmd = GroupOpen(room=7, rid="r7", num_tokens=32)
    w.apply(step, StepCommands(commands=(("v1", cmd),)), idle=idle)


def finished_in_thread(w: ConnectorWorker) -> tuple[threading.Thread, threading.Event, list]:
    """`w.finished` on a thread of its own: (the thread, set when it returned, its result)."""
    returned = threading.Event()
    result: list = []

    def call() -> None:
        result.append(w.finished(set()))
        returned.set()

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    return caller, returned, result


@pytest.fixture
def long_idle_wait(monkeypatch):
    # Far longer than the tests wait: returning before it proves nothing timed out.
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 30.0)


def test_an_idle_step_returns_as_soon_as_a_load_ends(long_idle_wait):
    w = decode_worker()
    open_room(w, 1, idle=True)
    w.rooms.pages(7)
    caller, returned, result = finished_in_thread(w)
    assert not returned.wait(0.2)  # nothing ended yet: the step waits
    w._on_report(GroupReport(7, 0, "complete", None))
    assert returned.wait(10.0)  # woken by the report, not by the 30 s timeout
    caller.join()
    assert result[0].recving == {"v1"}


def test_an_idle_step_with_nothing_ending_returns_after_the_wait(monkeypatch):
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 0.2)
    w = decode_worker()
    open_room(w, 1, idle=True)
    w.rooms.pages(7)
    started = time.monotonic()
    done = w.finished(set())
    assert time.monotonic() - started >= 0.2  # a lower bound: the wait ran out
    assert not done.recving


def test_a_step_that_computes_does_not_wait(long_idle_wait):
    w = decode_worker()
    open_room(w, 1, idle=False)
    w.rooms.pages(7)
    caller, returned, result = finished_in_thread(w)
    assert returned.wait(10.0)  # at once, with nothing finished
    caller.join()
    assert not result[0].recving
