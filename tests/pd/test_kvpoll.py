"""The KVPoll rule: table complete, Failed sticky, monotone, first reason kept."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd.kvpoll import (
    CREATABLE,
    TRANSITIONS,
    Effect,
    IllegalTransition,
    KVPoll,
    Poll,
    consensus,
)

F, B, W, T, S = (
    KVPoll.Failed,
    KVPoll.Bootstrapping,
    KVPoll.WaitingForInput,
    KVPoll.Transferring,
    KVPoll.Success,
)


def test_numeric_values_are_the_wire_contract() -> None:
    assert [int(s) for s in (F, B, W, T, S)] == [0, 1, 2, 3, 4]


def test_table_covers_every_pair_exactly_once() -> None:
    assert set(TRANSITIONS) == {(a, b) for a in KVPoll for b in KVPoll}


def _prose_rule(old: KVPoll, new: KVPoll) -> Effect:
    """The module docstring's rule, restated: concluded keeps, Failed fails, else max."""
    if old in (F, S):
        return Effect.KEEP
    if new is F:
        return Effect.FAIL
    return Effect.ADVANCE if new > old else Effect.KEEP


@pytest.mark.parametrize("old", list(KVPoll))
@pytest.mark.parametrize("new", list(KVPoll))
def test_written_table_matches_the_prose_rule(old: KVPoll, new: KVPoll) -> None:
    assert TRANSITIONS[(old, new)] is _prose_rule(old, new)


@pytest.mark.parametrize(
    ("old", "new", "effect"),
    [
        (B, W, Effect.ADVANCE),
        (B, T, Effect.ADVANCE),
        (W, S, Effect.ADVANCE),
        (T, W, Effect.KEEP),  # late, reordered update
        (T, T, Effect.KEEP),
        (B, F, Effect.FAIL),
        (T, F, Effect.FAIL),
        (F, S, Effect.KEEP),  # Failed is sticky
        (F, B, Effect.KEEP),
        (S, F, Effect.KEEP),  # a concluded poll stays concluded
        (S, B, Effect.KEEP),
    ],
)
def test_rule_examples(old: KVPoll, new: KVPoll, effect: Effect) -> None:
    assert TRANSITIONS[(old, new)] is effect


@pytest.mark.parametrize("state", list(KVPoll))
def test_only_bootstrapping_or_waiting_create_entries(state: KVPoll) -> None:
    if state in (B, W):
        assert Poll.create(state).state is state
    else:
        with pytest.raises(IllegalTransition, match="cannot be created"):
            Poll.create(state)
    assert CREATABLE == {B, W}


@pytest.mark.parametrize("bad", [5, -1, "Success", None, True, 2.0])
def test_values_outside_the_enum_raise(bad: object) -> None:
    with pytest.raises(IllegalTransition):
        Poll(B).update(bad)  # type: ignore[arg-type]


updates = st.lists(
    st.tuples(st.sampled_from(list(KVPoll)), st.sampled_from(["r1", "r2", None])), max_size=30
)


@given(st.sampled_from([B, W]), updates)
def test_any_update_sequence_obeys_the_invariants(start: KVPoll, seq: list) -> None:
    poll = Poll.create(start)
    first_failure: str | None = None
    for new, reason in seq:
        before = poll
        poll = poll.update(new, reason)
        if before.state is F:
            assert poll == before  # sticky, first reason kept
        elif before.state is S:
            assert poll == before  # concluded stays concluded
        elif new is F:
            assert poll.state is F
            first_failure = poll.reason
            assert poll.reason == (reason or "failed")
        else:
            assert poll.state == max(before.state, new)
    if first_failure is not None:
        assert poll.state is F and poll.reason == first_failure
    # Without a Failed update, progress is the maximum seen.
    if all(new is not F for new, _ in seq):
        assert poll.state == max([start, *(n for n, _ in seq)])


@given(st.lists(st.sampled_from(list(KVPoll)), min_size=1, max_size=8))
def test_consensus_is_min_with_failed_dominating(states: list[KVPoll]) -> None:
    result = consensus(states)
    if F in states:
        assert result is F
    else:
        assert result == min(states)
    # Order of reports does not matter.
    assert consensus(list(reversed(states))) is result


def test_consensus_of_nobody_is_an_error() -> None:
    with pytest.raises(IllegalTransition, match="zero ranks"):
        consensus([])
