"""A step that computes nothing waits for a load to end instead of spinning vLLM's loop."""

from __future__ import annotations

import threading

import pytest

from pdcluster.runtime.pd_worker.group import GroupOpen, GroupReport
from pdcluster.runtime.spec import Role
from pdcluster.runtime.vllm_connector import worker as worker_module
from pdcluster.runtime.vllm_connector.commands import StepCommands
from pdcluster.runtime.vllm_connector.rank import EngineFacts
from pdcluster.runtime.vllm_connector.settings import load_settings
from pdcluster.runtime.vllm_connector.worker import ConnectorWorker


class _Agent:
    """Stands in for the rank agent: takes the step's commands and does nothing."""

    def run_or_post(self, fn) -> None:
        fn()

    def on_group(self, cmd, now: float) -> None:
        pass


def decode_worker() -> ConnectorWorker:
    facts = EngineFacts(
        role=Role.decode,
        tp_size=1,
        tp_rank=0,
        num_layers=2,
        num_kv_heads=2,
        head_size=8,
        block_size=16,
        kv_dtype="float32",
        model_fingerprint="m",
    )
    settings = load_settings({"sidePort": 8998}, {})
    w = ConnectorWorker(settings, facts, "token", "decode-tp0")
    w.agent = _Agent()  # type: ignore[assignment]
    return w


def open_room(w: ConnectorWorker, step: int, idle: bool) -> None:
    cmd = GroupOpen(room=7, rid="r7", num_tokens=32)
    w.apply(step, StepCommands(commands=(("v1", cmd),)), idle=idle)


@pytest.fixture
def long_idle_wait(monkeypatch):
    # Long enough that returning before it proves the report woke the wait.
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 30.0)


def test_an_idle_step_returns_as_soon_as_a_load_ends(long_idle_wait):
    w = decode_worker()
    open_room(w, 1, idle=True)
    w.rooms.pages(7)
    reporter = threading.Timer(0.05, w._on_report, args=(GroupReport(7, 0, "complete", None),))
    reporter.start()
    done = w.finished(set())
    reporter.join()
    assert done.recving == {"v1"}


def test_a_step_that_computes_does_not_wait(long_idle_wait):
    w = decode_worker()
    open_room(w, 1, idle=False)
    w.rooms.pages(7)
    finished = threading.Event()
    caller = threading.Thread(target=lambda: (w.finished(set()), finished.set()))
    caller.start()
    # The call returns with nothing finished, without waiting for a report.
    assert finished.wait(10.0)
    caller.join()
