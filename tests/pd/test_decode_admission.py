"""Decode admission: all-or-nothing pages, FIFO with head-of-line blocking, slot backpressure."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd.decode_admission import AdmissionError, DecodeAdmission


class Pool:
    def __init__(self, n: int) -> None:
        self.free = list(range(n))
        self.calls: list[int] = []

    def allocate(self, k: int) -> Sequence[int] | None:
        self.calls.append(k)
        if k > len(self.free):
            return None  # all or nothing: never a partial grant
        out, self.free = self.free[:k], self.free[k:]
        return out

    def release(self, pages: Sequence[int]) -> None:
        self.free.extend(pages)


def test_head_of_line_blocks_smaller_requests_behind_it() -> None:
    pool = Pool(10)
    q = DecodeAdmission(num_slots=8, capacity_pages=10)
    q.enqueue(1, 6)
    q.enqueue(2, 6)  # does not fit after room 1
    q.enqueue(3, 1)  # would fit, but must not jump ahead of room 2
    admitted = q.admit(pool.allocate)
    assert [a.room for a in admitted] == [1]
    assert q.waiting_rooms() == [2, 3]
    pool.release(admitted[0].pages)
    q.release_slot(1)
    assert [a.room for a in q.admit(pool.allocate)] == [2, 3]


def test_no_free_slot_means_waiting_not_failing() -> None:
    pool = Pool(100)
    q = DecodeAdmission(num_slots=2, capacity_pages=100)
    for room in range(4):
        q.enqueue(room, 1)
    assert [a.room for a in q.admit(pool.allocate)] == [0, 1]
    assert q.num_free_slots == 0 and q.waiting_rooms() == [2, 3]
    assert q.admit(pool.allocate) == []  # backpressure: nothing fails, nothing admitted
    q.release_slot(0)
    assert [a.room for a in q.admit(pool.allocate)] == [2]


def test_prompt_over_capacity_is_refused_before_anything_is_reserved() -> None:
    pool = Pool(10)
    q = DecodeAdmission(num_slots=2, capacity_pages=10)
    with pytest.raises(AdmissionError) as err:
        q.enqueue(1, 11)
    assert err.value.reason == "prompt_too_long"
    assert q.num_waiting == 0 and pool.calls == []


def test_cancelled_head_unblocks_the_queue() -> None:
    pool = Pool(4)
    q = DecodeAdmission(num_slots=4, capacity_pages=10)
    q.enqueue(1, 8)
    q.enqueue(2, 2)
    assert q.admit(pool.allocate) == []
    assert q.cancel(1) and not q.cancel(1)
    assert [a.room for a in q.admit(pool.allocate)] == [2]


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (lambda q: q.enqueue(1, 0), "bad_size"),
        (lambda q: q.enqueue(1, True), "bad_size"),
        (lambda q: (q.enqueue(1, 1), q.enqueue(1, 1)), "duplicate_room"),
        (lambda q: q.release_slot(42), "no_slot"),
    ],
)
def test_bad_calls_raise_and_leave_state(call, reason: str) -> None:  # type: ignore[no-untyped-def]
    q = DecodeAdmission(num_slots=1, capacity_pages=4)
    with pytest.raises(AdmissionError) as err:
        call(q)
    assert err.value.reason == reason
    assert q.num_free_slots == 1 and q.waiting_rooms() in ([], [1])


def test_allocator_returning_wrong_count_is_an_error_and_room_stays_queued() -> None:
    q = DecodeAdmission(num_slots=1, capacity_pages=4)
    q.enqueue(1, 2)
    with pytest.raises(AdmissionError, match="returned 1 pages"):
        q.admit(lambda n: [0])
    assert q.waiting_rooms() == [1] and q.num_free_slots == 1


ops = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.integers(1, 12)),
        st.tuples(st.just("admit"), st.just(0)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
    ),
    max_size=60,
)


@given(ops, st.integers(1, 4))
def test_reference_model(seq: list[tuple[str, int]], slots: int) -> None:
    pool = Pool(16)
    q = DecodeAdmission(num_slots=slots, capacity_pages=16)
    next_room = 0
    waiting: list[tuple[int, int]] = []
    holding: dict[int, tuple[int, ...]] = {}
    for op, arg in seq:
        if op == "enqueue":
            q.enqueue(next_room, arg)
            waiting.append((next_room, arg))
            next_room += 1
        elif op == "admit":
            got = q.admit(pool.allocate)
            expected = []
            free = len(pool.free) + sum(len(a.pages) for a in got)
            while waiting and len(holding) + len(expected) < slots and waiting[0][1] <= free:
                room, need = waiting.pop(0)
                free -= need
                expected.append(room)
            assert [a.room for a in got] == expected
            for a in got:
                holding[a.room] = a.pages
        elif op == "finish" and holding:
            room = sorted(holding)[arg % len(holding)]
            pool.release(holding.pop(room))
            q.release_slot(room)
        elif op == "cancel" and waiting:
            room, _ = waiting.pop(arg % len(waiting))
            assert q.cancel(room)
        assert q.waiting_rooms() == [r for r, _ in waiting]
        assert q.num_free_slots == slots - len(holding) >= 0
        held = [p for pages in holding.values() for p in pages]
        assert len(held) == len(set(held)) and len(held) + len(pool.free) == 16
