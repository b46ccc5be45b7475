"""Pure pieces behind failing loudly: readiness reasons, registration back-off,
the prefill room queue, and the transfer backend as a compatibility field."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd.compat import CompatError, check_compat
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.messages import KVLayoutRegister
from pdcluster.runtime.pd.prefill_peers import PeerLayouts
from pdcluster.runtime.pd.readiness import ReadinessFacts, RegistrationBackoff, compute_not_ready
from pdcluster.runtime.pd.room_queue import Offer, QueueFull, RoomQueue

from .sim import compat

HEALTHY = ReadinessFacts(engine_alive=True, engine_stalled=False, groups_ready=True)


# ------------------------------------------------------------------ readiness


def test_a_worker_with_everything_in_place_is_ready() -> None:
    assert compute_not_ready(HEALTHY) is None
    ready_prefill = ReadinessFacts(True, False, True, True, None, 4, 4)
    assert compute_not_ready(ready_prefill) is None


@pytest.mark.parametrize(
    ("facts", "reason"),
    [
        (ReadinessFacts(False, False, True), "engine_stopped"),
        (ReadinessFacts(True, True, True), "engine_stalled"),
        (
            ReadinessFacts(True, False, True, False, "wrong token"),
            "bootstrap_rejected: wrong token",
        ),
        (ReadinessFacts(True, False, True, True, None, 1, 4), "unregistered: 1/4 ranks registered"),
        (ReadinessFacts(True, False, True, False), "unregistered: this rank is not registered yet"),
        (ReadinessFacts(True, False, False, True), "dp_groups_starting"),
    ],
)
def test_each_missing_piece_keeps_the_worker_out_with_its_reason(
    facts: ReadinessFacts, reason: str
) -> None:
    assert compute_not_ready(facts) == reason


def test_a_stalled_engine_wins_over_registration() -> None:
    facts = ReadinessFacts(True, True, True, False, None, 0, 2)
    assert compute_not_ready(facts) == "engine_stalled"


def test_registration_backoff_grows_is_capped_and_never_ends() -> None:
    delays = list(itertools.islice(RegistrationBackoff(0.1, 2.0, 1.0).delays(), 50))
    assert delays[:5] == [0.1, 0.2, 0.4, 0.8, 1.0]
    assert delays[5:] == [1.0] * 45  # the old retries gave up after ~1.5 s in all
    assert sum(delays) > 40


@pytest.mark.parametrize("kwargs", [{"base_s": 0}, {"base_s": 3, "max_s": 2}, {"factor": 0.5}])
def test_bad_backoff_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="RegistrationBackoff"):
        RegistrationBackoff(**kwargs)


# ------------------------------------------------------------------ room queue


def test_rooms_past_max_active_wait_in_order_and_start_as_others_end() -> None:
    q = RoomQueue(max_active=2, max_queued=3)
    assert [q.offer(r) for r in (1, 2, 3, 4, 5)] == [Offer.start] * 2 + [Offer.queued] * 3
    assert q.is_full()
    with pytest.raises(QueueFull, match="prefill_busy: 2 rooms running and 3 queued"):
        q.offer(6)
    assert (q.num_active, q.num_queued) == (2, 3)  # the refusal changed nothing
    assert q.release(2) == [3]
    assert q.release(4) == []  # a queued room leaving starts nobody
    assert q.release(1) == [5]
    assert q.release(3) == [] and q.release(5) == []
    assert (q.num_active, q.num_queued) == (0, 0)


def test_a_newcomer_never_passes_a_waiting_room() -> None:
    q = RoomQueue(max_active=1, max_queued=2)
    q.offer(1)
    q.offer(2)
    q.release(1)  # 2 starts
    assert q.offer(3) is Offer.queued
    assert q.release(2) == [3]


def test_a_room_offered_twice_is_refused() -> None:
    q = RoomQueue(1, 1)
    q.offer(7)
    with pytest.raises(ValueError, match="already"):
        q.offer(7)


@pytest.mark.parametrize(("active", "queued"), [(0, 1), (1, -1)])
def test_bad_queue_bounds_are_refused(active: int, queued: int) -> None:
    with pytest.raises(ValueError, match="RoomQueue"):
        RoomQueue(active, queued)


@given(
    st.integers(1, 4),
    st.integers(0, 4),
    st.lists(st.tuples(st.booleans(), st.integers(0, 15)), max_size=60),
)
def test_queue_bounds_and_fifo_hold_under_any_sequence(
    max_active: int, max_queued: int, ops: list[tuple[bool, int]]
) -> None:
    q = RoomQueue(max_active, max_queued)
    order: list[int] = []  # model: arrival order of rooms still waiting
    started: list[int] = []
    for is_offer, room in ops:
        if is_offer:
            if room in q:
                continue
            try:
                if q.offer(room) is Offer.queued:
                    order.append(room)
            except QueueFull:
                assert q.is_full()
        else:
            if room in order:
                order.remove(room)
            now = q.release(room)
            assert now == order[: len(now)]  # heads of the queue, in arrival order
            del order[: len(now)]
            started.extend(now)
        assert q.num_active <= max_active and q.num_queued <= max_queued
        assert q.num_queued == len(order)
        # Nobody waits while a slot is free.
        assert q.num_queued == 0 or q.num_active == max_active


# ------------------------------------------------------------ transfer backend


def test_a_backend_mismatch_names_both_values() -> None:
    with pytest.raises(CompatError) as err:
        check_compat(compat(transfer_backend="shm"), compat(transfer_backend="tcp"))
    assert str(err.value) == "backend_mismatch: prefill shm, decode tcp"
    assert err.value.field == "transfer_backend"


def test_a_layout_from_a_decode_on_another_backend_is_refused_at_registration() -> None:
    peers = PeerLayouts(compat(transfer_backend="shm"), "tok")
    layout = KVLayoutRegister(
        token="tok",
        decode_rank=RankCoord(),
        decode_endpoint="tcp://127.0.0.1:7100",
        compat=compat(transfer_backend="tcp"),
        num_pages=8,
        layer_start=0,
        layer_end=2,
        head_start=0,
        head_end=2,
    )
    outcome = peers.register(layout)
    assert not outcome.accepted and outcome.code == "incompatible"
    assert outcome.reason == "backend_mismatch: prefill shm, decode tcp"
    assert len(peers) == 0
