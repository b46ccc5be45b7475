"""`RankAgent.run_or_post`: a step on a request's path runs on the caller's
thread when the agent is idle, and is queued, never waited for, when it is not;
either way the steps run one at a time in the order they were handed over.

A real decode rank agent (`DecodeRig`: its loop thread, endpoint and table).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

import pytest

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd_worker.group import GroupOpen, GroupPages
from tests.faults.decode_rig import PREFILL_PEER, DecodeRig


@pytest.fixture
def rig() -> Iterator[DecodeRig]:
    rig = DecodeRig()
    try:
        yield rig
    finally:
        rig.close()


def _states(rig: DecodeRig) -> dict[int, str]:
    return {int(v["room"]): str(v["state"]) for v in rig.agent.room_views(time.monotonic())}


def test_an_idle_agent_runs_the_step_on_the_callers_thread_under_its_lock(rig: DecodeRig) -> None:
    seen: list[tuple[int, bool]] = []

    def step() -> None:
        # An RLock held by this thread can be taken again without blocking;
        # held by another thread it cannot.
        seen.append((threading.get_ident(), rig.agent.lock.acquire(blocking=False)))
        rig.agent.lock.release()

    rig.agent.run_or_post(step)
    assert seen == [(threading.get_ident(), True)]  # done before run_or_post returned


def test_a_busy_agent_gets_the_step_queued_and_the_caller_does_not_wait(rig: DecodeRig) -> None:
    holding, release = threading.Event(), threading.Event()

    def busy() -> None:
        holding.set()
        release.wait(10)

    rig.agent.post(busy)  # the agent thread holds its lock until `release`
    assert holding.wait(5)
    ran_on: list[int] = []
    ran = threading.Event()

    def step() -> None:
        ran_on.append(threading.get_ident())
        ran.set()

    started = time.monotonic()
    rig.agent.run_or_post(step)
    returned_after = time.monotonic() - started
    assert not ran.is_set()  # queued behind the agent's own step
    release.set()
    assert ran.wait(5)
    assert ran_on == [rig.agent._thread.ident]
    assert returned_after < 1.0  # it did not wait for `busy` (held for up to 10 s)


def test_a_failing_step_is_logged_not_raised_and_the_agent_goes_on(
    rig: DecodeRig, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise RuntimeError("step broke")

    with caplog.at_level(logging.ERROR, logger="pdcluster"):
        rig.agent.run_or_post(broken)  # does not raise
    assert "step broke" in caplog.text
    assert rig.agent.lock.acquire(blocking=False)  # released after the error
    rig.agent.lock.release()
    meta = rig.open_room(7, "rid-7", [0, 1], num_tokens=8)
    assert meta.room == 7


def test_a_room_broadcast_here_now_is_open_when_broadcast_returns(rig: DecodeRig) -> None:
    rig.agent.broadcast(
        GroupOpen(room=11, rid="rid-11", num_tokens=8, peer=PREFILL_PEER), here_now=True
    )
    assert 11 in _states(rig)  # no wait: applied on this thread
    rig.agent.broadcast(GroupPages(room=11, pages=[2, 3]), here_now=True)
    meta = rig.wait_message(pdmsg.TransferMeta, 11)
    assert meta.dst_pages == [2, 3]


def test_a_room_broadcast_while_the_agent_is_busy_opens_once_it_is_free(rig: DecodeRig) -> None:
    holding, release = threading.Event(), threading.Event()
    rig.agent.post(lambda: (holding.set(), release.wait(10)))
    assert holding.wait(5)
    rig.agent.broadcast(
        GroupOpen(room=12, rid="rid-12", num_tokens=8, peer=PREFILL_PEER), here_now=True
    )
    release.set()
    deadline = time.monotonic() + 5
    while 12 not in _states(rig):
        assert time.monotonic() < deadline, "the queued open never ran"
        time.sleep(0.01)


class _GatedInbox(queue.Queue):  # type: ignore[type-arg]
    """An inbox whose blocking `get` (the agent thread's wait between steps,
    outside the lock) returns only once `gate` is set."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        if block:
            self.gate.wait(10)
        return super().get(block, timeout)


def test_a_step_handed_over_behind_a_queued_one_waits_its_turn(rig: DecodeRig) -> None:
    """The lock is free but a posted step has not run yet: the new step is queued behind it."""
    gate = threading.Event()
    rig.agent.inbox = _GatedInbox(gate)
    time.sleep(0.2)  # the agent thread's wait on the old inbox times out (one tick)
    order: list[str] = []
    rig.agent.post(lambda: order.append("posted"))
    assert rig.agent.lock.acquire(blocking=False)  # free: the agent waits at the gate
    rig.agent.lock.release()
    caller = threading.Thread(target=rig.agent.run_or_post, args=(lambda: order.append("next"),))
    caller.start()
    caller.join(5)
    assert not caller.is_alive()  # the caller did not wait
    assert order == []  # nothing ran ahead of the queued step
    gate.set()
    deadline = time.monotonic() + 5
    while len(order) < 2:
        assert time.monotonic() < deadline, f"queued steps never ran: {order}"
        time.sleep(0.01)
    assert order == ["posted", "next"]


def test_a_step_handed_over_from_inside_a_step_runs_after_it_not_nested(rig: DecodeRig) -> None:
    order: list[str] = []
    done = threading.Event()

    def inner() -> None:
        order.append("inner")
        done.set()

    def outer() -> None:
        order.append("outer starts")
        rig.agent.run_or_post(inner)
        order.append("outer ends")

    rig.agent.run_or_post(outer)
    assert done.wait(5)
    assert order == ["outer starts", "outer ends", "inner"]


def test_a_peer_message_to_an_idle_agent_is_handled_on_the_endpoint_thread(
    rig: DecodeRig,
) -> None:
    """Decode's Success goes from the socket to the room table with no hand-off."""
    handled_on: list[tuple[str, str]] = []
    on_message = rig.agent.on_message

    def recording(msg: object, now: float, sender: str | None = None) -> None:
        handled_on.append((type(msg).__name__, threading.current_thread().name))
        on_message(msg, now, sender)

    rig.agent.on_message = recording  # type: ignore[method-assign]
    meta = rig.open_room(21, "rid-21", [4, 5], num_tokens=8)
    rig.send_frame(meta, 0, 8, 1.5)
    rig.send_status(meta, KVPoll.Success, first_token=42)
    _, report = rig.wait_report(21, "complete")
    assert report.first_token == 42
    statuses = [thread for name, thread in handled_on if name == "Status"]
    assert statuses and all(t.startswith("endpoint") for t in statuses), handled_on
    assert bool((rig.pool.buffer[:, :, 4:6] == 1.5).all())
