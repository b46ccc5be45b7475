"""The drain machine of local autoscaling (runtime/local/drain.py), pure.

An instance is stopped only after the router confirmed the hold and both
sides reported nothing in flight (or the drain's budget for in-flight
requests ran out after a confirmed hold); every step that does not advance
says why, once.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.local.drain import Drain, DrainError, DrainPhase, Load, Reply

H, W, R, S = DrainPhase.HOLDING, DrainPhase.WAITING, DrainPhase.REMOVING, DrainPhase.STOPPED
IDLE = Load(0, 0)
TIMEOUT = 10.0


def run(*seen: Reply | Load, at: float = 0.0) -> tuple[list[DrainPhase], list[str | None]]:
    drain = Drain("decode-1", 0.0, TIMEOUT)
    phases, lines = [], []
    for obs in seen:
        step = drain.observe(obs, at)
        phases.append(step.phase)
        lines.append(step.line)
    return phases, lines


@pytest.mark.parametrize(
    ("seen", "phases"),
    [
        ((Reply(200), IDLE, Reply(200)), [W, R, S]),
        # The router does not have it: it sends it nothing.
        ((Reply(404), IDLE, Reply(404)), [W, R, S]),
        # A refused, failed or unanswered hold is asked again.
        ((Reply(503), Reply(0, "ConnectError"), Reply(403), Reply(200)), [H, H, H, W]),
        # Busy on either side, or a side that does not say: wait.
        ((Reply(200), Load(1, 0), Load(0, 2), Load(None, 0, "x"), Load(0, None, "y")), [W] * 5),
        # 409 at removal: legs are still in flight at the router.
        ((Reply(200), IDLE, Reply(409), IDLE, Reply(200)), [W, R, W, R, S]),
        # A removal that failed otherwise is asked again.
        ((Reply(200), IDLE, Reply(500), Reply(0, "ReadTimeout"), Reply(200)), [W, R, R, R, S]),
    ],
)
def test_the_phases_a_drain_goes_through(
    seen: tuple[Reply | Load, ...], phases: list[DrainPhase]
) -> None:
    assert run(*seen)[0] == phases


def test_past_the_budget_requests_in_flight_are_cut_but_never_an_unconfirmed_hold() -> None:
    late = TIMEOUT + 1
    phases, lines = run(Reply(200), Load(3, 1), Reply(409), at=late)
    assert phases == [W, R, S]
    assert lines[1] == (
        "Warning DrainTimedOut: decode-1 still busy (3 legs at the router; "
        "1 requests in flight); stopping it anyway"
    )
    assert lines[2] == (
        "Warning DrainTimedOut: the router still has legs on decode-1; stopping it anyway"
    )
    phases, _ = run(*[Reply(0, "ConnectError")] * 5, at=late)
    assert phases == [H] * 5


def test_a_step_that_does_not_advance_says_why_once_per_reason() -> None:
    _, lines = run(
        Reply(503), Reply(503), Reply(0, "ConnectError"), Reply(200), Load(None, 0, "timed out")
    )
    assert lines[0] == (
        "Normal DrainWaiting: the router has not confirmed it sends decode-1 nothing more "
        "(HTTP 503); asking again"
    )
    assert lines[1] is None  # the same reason again
    assert lines[2] is not None and "ConnectError" in lines[2]
    assert lines[3] is None  # advanced: nothing to say
    assert lines[4] == "Normal DrainWaiting: decode-1 is still busy (not known: timed out)"


def test_an_observation_the_phase_does_not_take_is_refused() -> None:
    drain = Drain("decode-1", 0.0, TIMEOUT)
    with pytest.raises(DrainError, match="HOLDING takes no Load"):
        drain.observe(IDLE, 0.0)
    assert drain.phase is H
    drain.observe(Reply(200), 0.0)
    with pytest.raises(DrainError, match="WAITING takes no Reply"):
        drain.observe(Reply(200), 0.0)
    drain.observe(IDLE, 0.0)
    drain.observe(Reply(200), 0.0)
    with pytest.raises(DrainError, match="STOPPED takes no Reply"):
        drain.observe(Reply(200), 0.0)
    with pytest.raises(DrainError, match="timeout_s"):
        Drain("x", 0.0, -1.0)


REPLIES = st.builds(Reply, st.sampled_from([0, 200, 404, 409, 403, 500, 503]))
COUNTS = st.none() | st.integers(0, 3)
LOADS = st.builds(Load, COUNTS, COUNTS)


@given(
    steps=st.lists(st.tuples(REPLIES, LOADS, st.floats(0, 2 * TIMEOUT)), max_size=30),
)
def test_a_drain_stops_only_behind_a_confirmed_hold_and_an_idle_read_or_the_budget(
    steps: list[tuple[Reply, Load, float]],
) -> None:
    drain = Drain("decode-1", 0.0, TIMEOUT)
    confirmed = False
    idle_since_409 = False
    now = 0.0
    for reply, load, dt in steps:
        now += dt
        before = drain.phase
        if before is S:
            break
        seen: Reply | Load = load if before is W else reply
        step = drain.observe(seen, now)
        if before is H and step.phase is W:
            confirmed = True
            assert reply.status in (200, 404)
        if before is W and step.phase is R:
            idle_since_409 = load == IDLE
            assert idle_since_409 or now >= TIMEOUT
        if step.phase is S:
            assert confirmed
            assert idle_since_409 or now >= TIMEOUT
            assert reply.status in (200, 404) or (reply.status == 409 and now >= TIMEOUT)
        if before is H:
            assert step.phase in (H, W)  # the budget never ends an unconfirmed hold
