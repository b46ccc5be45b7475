"""Local mode's supervisor decides restarts like the operator: back-off, budget, gang."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.local.supervision import (
    BUDGET_WINDOW_S,
    TRANSITIONS,
    Admit,
    Event,
    GiveUp,
    InstanceKey,
    Phase,
    ReportLost,
    Spawn,
    SupervisionError,
    Supervisor,
    TearDown,
    backoff_delay,
    describe_exit,
    next_phase,
)
from pdcluster.runtime.spec import RestartPolicySpec, Role

P0, P1 = InstanceKey(Role.prefill, 0), InstanceKey(Role.prefill, 1)
D0 = InstanceKey(Role.decode, 0)
KILLED = -signal.SIGKILL


def policy(budget: int = 10, base: float = 1.0, cap: float = 60.0) -> RestartPolicySpec:
    return RestartPolicySpec(backoff_seconds=base, max_backoff_seconds=cap, budget=budget)


def supervisor(budget: int = 10, base: float = 1.0, cap: float = 60.0) -> Supervisor:
    p = policy(budget, base, cap)
    return Supervisor([P0, P1, D0], {Role.prefill: p, Role.decode: p})


def lose(sup: Supervisor, key: InstanceKey, now: float, rc: int = KILLED) -> list[object]:
    return list(sup.on_exit(str(key), key, sup.generation(key), rc, now))


# ------------------------------------------------------------------ the table

EXPECTED = {
    (Phase.RUNNING, Event.EXITED): Phase.BACKOFF,
    (Phase.BACKOFF, Event.EXITED): Phase.BACKOFF,
    (Phase.BACKOFF, Event.DUE): Phase.STARTING,
    (Phase.BACKOFF, Event.READY): Phase.BACKOFF,
    (Phase.STARTING, Event.EXITED): Phase.BACKOFF,
    (Phase.STARTING, Event.READY): Phase.RUNNING,
}


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("event", list(Event))
def test_every_phase_event_pair_reaches_its_documented_phase_or_raises(
    phase: Phase, event: Event
) -> None:
    if (phase, event) in EXPECTED:
        assert next_phase(phase, event) is EXPECTED[(phase, event)]
    else:
        with pytest.raises(SupervisionError, match=f"from {phase.name} on {event.name}"):
            next_phase(phase, event)
    assert {(p, e) for p, row in TRANSITIONS.items() for e in row} == set(EXPECTED)


@pytest.mark.parametrize(
    ("rc", "text"),
    [(0, "exit code 0"), (3, "exit code 3"), (KILLED, "killed by SIGKILL"), (-250, "signal 250")],
)
def test_exit_reasons_read_as_words(rc: int, text: str) -> None:
    assert text in describe_exit(rc)


@pytest.mark.parametrize(
    ("n", "delay"), [(0, 0.0), (1, 2.0), (2, 4.0), (3, 8.0), (4, 10.0), (500, 10.0)]
)
def test_backoff_doubles_per_consecutive_restart_up_to_the_cap(n: int, delay: float) -> None:
    assert backoff_delay(policy(base=2.0, cap=10.0), n) == delay


# ------------------------------------------------------------------ one instance's life


def test_a_lost_instance_is_torn_down_reported_and_started_again_after_its_backoff() -> None:
    sup = supervisor(base=1.0)
    acts = lose(sup, P1, now=100.0)
    assert acts == [TearDown(P1, 0), ReportLost(P1, "prefill-1 killed by SIGKILL")]
    view = sup.view(P1)
    assert (view.phase, view.restarts, view.last_exit) == (
        Phase.BACKOFF,
        1,
        "prefill-1: killed by SIGKILL",
    )
    assert sup.next_wakeup() == 101.0
    assert sup.tick(100.9) == []
    assert sup.tick(101.0) == [Spawn(P1, 1)]
    assert sup.view(P1).phase is Phase.STARTING and sup.starting() == [P1]
    assert sup.on_ready(P1, 1) == [Admit(P1)]
    assert sup.view(P1).phase is Phase.RUNNING and sup.starting() == []
    # The others were never touched.
    assert sup.view(P0).restarts == 0 and sup.view(D0).phase is Phase.RUNNING


def test_the_gangs_other_exits_and_a_stale_start_change_nothing() -> None:
    sup = supervisor()
    lose(sup, P0, now=0.0)
    # Another process of the same (torn down) start ends: no second restart.
    assert sup.on_exit("prefill-0-pod-1", P0, 0, -signal.SIGTERM, 0.1) == []
    assert sup.view(P0).restarts == 1
    # Its readiness, polled just before the loss, arrives late: the loss stands.
    assert sup.on_ready(P0, 0) == [] and sup.view(P0).phase is Phase.BACKOFF
    assert sup.tick(1.0) == [Spawn(P0, 1)]
    # A late exit or readiness of the old start (generation 0) is dropped.
    assert sup.on_exit("prefill-0", P0, 0, KILLED, 1.1) == []
    assert sup.on_ready(P0, 0) == []
    assert sup.view(P0).phase is Phase.STARTING


def test_dying_while_starting_restarts_again_with_a_longer_backoff() -> None:
    sup = supervisor(base=1.0, cap=60.0)
    lose(sup, P0, now=0.0)
    assert sup.tick(1.0) == [Spawn(P0, 1)]
    assert lose(sup, P0, now=2.0, rc=1) == [
        TearDown(P0, 1),
        ReportLost(P0, "prefill-0 exit code 1"),
    ]
    assert sup.next_wakeup() == 4.0  # 2 s: the second restart in a row
    assert sup.tick(4.0) == [Spawn(P0, 2)]
    sup.on_ready(P0, 2)
    # Ready resets the count: the next loss waits the base delay again.
    lose(sup, P0, now=10.0)
    assert sup.next_wakeup() == 11.0


def test_ready_of_a_running_instance_is_a_bug_that_raises() -> None:
    with pytest.raises(SupervisionError, match="from RUNNING on READY"):
        supervisor().on_ready(P0, 0)


def test_an_unknown_instance_raises() -> None:
    with pytest.raises(SupervisionError, match="unknown instance decode-7"):
        supervisor().on_exit("decode-7", InstanceKey(Role.decode, 7), 0, 1, 0.0)


def test_a_role_without_a_policy_is_refused() -> None:
    with pytest.raises(SupervisionError, match="no restart policy for role decode"):
        Supervisor([P0, D0], {Role.prefill: policy()})


# ------------------------------------------------------------------ giving up


def test_budget_zero_gives_up_at_the_first_loss_with_the_reason() -> None:
    sup = supervisor(budget=0)
    (act,) = lose(sup, P1, now=5.0)
    assert isinstance(act, GiveUp)
    assert "prefill-1 exited (killed by SIGKILL)" in act.reason
    assert "prefill restart budget is spent (0 per hour)" in act.reason
    assert sup.given_up == act.reason
    # Nothing else is decided afterwards.
    assert lose(sup, D0, now=6.0) == [] and sup.tick(1e9) == []


def test_the_budget_is_per_role_and_refills_when_its_window_closes() -> None:
    sup = supervisor(budget=1, base=0.0)
    assert isinstance(lose(sup, P0, now=0.0)[0], TearDown)
    sup.tick(0.0)
    sup.on_ready(P0, 1)
    assert sup.restarts_left(Role.prefill, 1.0) == 0
    # Decode has its own budget.
    assert isinstance(lose(sup, D0, now=1.0)[0], TearDown)
    sup.tick(1.0)
    sup.on_ready(D0, 1)
    # The window opened at 0 s closes at 3600 s.
    assert sup.restarts_left(Role.prefill, BUDGET_WINDOW_S) == 1
    assert isinstance(lose(sup, P1, now=BUDGET_WINDOW_S)[0], TearDown)
    sup.tick(BUDGET_WINDOW_S)
    sup.on_ready(P1, 1)
    (act,) = lose(sup, P0, now=BUDGET_WINDOW_S + 1)
    assert isinstance(act, GiveUp) and "(1 per hour)" in act.reason


def test_the_router_dying_gives_up_at_once() -> None:
    (act,) = supervisor().on_exit("router", None, 0, 1, 0.0)
    assert act == GiveUp("router exited (exit code 1); the cluster cannot serve without it")


# ------------------------------------------------------------------ properties

KEYS = [P0, P1, D0]
# One step: (what, instance index, seconds since the previous step).
steps = st.lists(
    st.tuples(
        st.sampled_from(["exit", "exit_old", "ready", "tick"]),
        st.integers(0, len(KEYS) - 1),
        st.floats(0.0, 30.0, allow_nan=False),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    steps=steps,
    budget=st.integers(0, 6),
    base=st.floats(0.0, 5.0, allow_nan=False),
    cap=st.floats(0.0, 40.0, allow_nan=False),
)
def test_random_lives_respect_budget_backoff_and_one_pending_restart(
    steps: list[tuple[str, int, float]], budget: int, base: float, cap: float
) -> None:
    sup = supervisor(budget=budget, base=base, cap=cap)
    p = policy(budget, base, cap)
    now = 0.0
    # Per instance: the loss time and expected delay of the pending restart.
    pending: dict[InstanceKey, tuple[float, float]] = {}
    consecutive = dict.fromkeys(KEYS, 0)
    last_delay = dict.fromkeys(KEYS, 0.0)
    restarts = dict.fromkeys([Role.prefill, Role.decode], 0)
    gave_up = False
    for what, i, dt in steps:
        now += dt  # 80 steps of at most 30 s stay inside one budget window
        key = KEYS[i]
        gen = sup.generation(key)
        if what == "exit":
            acts = list(sup.on_exit(str(key), key, gen, KILLED, now))
        elif what == "exit_old":
            acts = list(sup.on_exit(str(key), key, gen - 1, KILLED, now))
            assert acts == [], "an exit of an older start decided something"
        elif what == "ready":
            if sup.view(key).phase is Phase.RUNNING:
                continue  # the launcher never reports a running instance ready
            acts = list(sup.on_ready(key, gen))
        else:
            acts = list(sup.tick(now))
        if gave_up:
            assert acts == [], "nothing is decided after giving up"
            continue
        for act in acts:
            if isinstance(act, TearDown):
                assert act.key not in pending, "a restart while one is pending"
                consecutive[act.key] += 1
                restarts[act.key.role] += 1
                delay = backoff_delay(p, consecutive[act.key])
                if consecutive[act.key] > 1:
                    assert delay >= last_delay[act.key], "back-off shrank without a ready start"
                last_delay[act.key] = delay
                pending[act.key] = (now, delay)
                assert sup.view(act.key).start_at == now + delay
            elif isinstance(act, Spawn):
                assert act.key in pending, "a start that answers no loss"
                lost_at, delay = pending.pop(act.key)
                assert now >= lost_at + delay, "started before its back-off passed"
                assert act.generation == sup.generation(act.key)
            elif isinstance(act, Admit):
                consecutive[act.key] = 0
            elif isinstance(act, GiveUp):
                gave_up = True
                assert "budget is spent" in act.reason
                role = next(r for r in restarts if r.value in act.reason)
                assert restarts[role] == budget
        for role, count in restarts.items():
            assert count <= budget, f"{count} {role.value} restarts with a budget of {budget}"
