from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.router.rooms import (
    MAX_ROOM,
    MAX_ROOM_DRAWS,
    RID_PATTERN,
    RidMinter,
    RoomExhaustedError,
    is_valid_rid,
    mint_room,
    room_for_draw,
)


class ScriptedSource:
    """Returns the given values in turn (masked to the bits asked for)."""

    def __init__(self, values: list[int]) -> None:
        self.values = values or [0]
        self.calls = 0

    def getrandbits(self, k: int) -> int:
        value = self.values[self.calls % len(self.values)]
        self.calls += 1
        return value & ((1 << k) - 1)


@settings(deadline=None)  # CPU-bound; a loaded CI machine must not flake
@given(
    st.lists(st.integers(min_value=0, max_value=(1 << 64) - 1), max_size=50), st.integers(1, 300)
)
def test_rids_are_fixed_width_hex_and_never_repeat_whatever_the_source(
    values: list[int], count: int
) -> None:
    minter = RidMinter(ScriptedSource(values))
    rids = [minter.mint() for _ in range(count)]
    assert len(set(rids)) == count
    for rid in rids:
        assert RID_PATTERN.fullmatch(rid)
        assert len(rid) == len("req-") + 32
    # Fixed width: no rid is a prefix of another ("req-1" vs "req-10").
    assert not any(a != b and b.startswith(a) for a in rids[:20] for b in rids[:20])


def test_rids_of_two_routers_differ() -> None:
    a = RidMinter(random.Random(1))
    b = RidMinter(random.Random(2))
    assert {a.mint() for _ in range(100)}.isdisjoint({b.mint() for _ in range(100)})


@pytest.mark.parametrize(
    ("rid", "valid"),
    [
        ("req-" + "0" * 32, True),
        ("req-" + "a" * 32, True),
        ("req-" + "A" * 32, False),
        ("req-" + "0" * 31, False),
        ("req-" + "0" * 33, False),
        ("rq-" + "0" * 32, False),
        ("req-1", False),
    ],
)
def test_rid_validation(rid: str, valid: bool) -> None:
    assert is_valid_rid(rid) is valid


@given(
    st.integers(min_value=0, max_value=MAX_ROOM),
    st.integers(min_value=1, max_value=1024).flatmap(
        lambda dp: st.tuples(st.just(dp), st.integers(0, dp - 1))
    ),
)
def test_room_for_draw_hits_the_rank_and_fits_a_positive_int64(
    draw: int, dp_rank: tuple[int, int]
) -> None:
    dp, rank = dp_rank
    room = room_for_draw(draw, dp, rank)
    assert 0 <= room <= MAX_ROOM < 1 << 63
    assert room % dp == rank


@pytest.mark.parametrize("dp", [1, 2, 3, 7, 8, 1000, (1 << 62) + 1])
def test_room_for_draw_at_the_top_of_the_range(dp: int) -> None:
    for rank in {0, dp - 1, dp // 2}:
        room = room_for_draw(MAX_ROOM, dp, rank)
        assert room <= MAX_ROOM and room % dp == rank


@pytest.mark.parametrize(
    ("draw", "dp", "rank"),
    [(0, 0, 0), (0, 2, 2), (0, 2, -1), (-1, 1, 0), (MAX_ROOM + 1, 1, 0)],
)
def test_room_for_draw_rejects_bad_arguments(draw: int, dp: int, rank: int) -> None:
    with pytest.raises(ValueError):
        room_for_draw(draw, dp, rank)


@settings(deadline=None)  # CPU-bound; a loaded CI machine must not flake
@given(st.integers(1, 64).flatmap(lambda dp: st.tuples(st.just(dp), st.integers(0, dp - 1))))
def test_minted_rooms_are_nonzero_rank_aware_and_not_in_use(dp_rank: tuple[int, int]) -> None:
    dp, rank = dp_rank
    source = random.Random(dp * 1000 + rank)
    in_use: set[int] = set()
    for _ in range(50):
        room = mint_room(source, dp_size=dp, dp_rank=rank, in_use=in_use)
        assert 1 <= room <= MAX_ROOM
        assert room % dp == rank
        assert room not in in_use
        in_use.add(room)


def test_room_in_use_is_drawn_again() -> None:
    first = (1 << 40) + 5
    source = ScriptedSource([first, first, first + 1])
    assert mint_room(source, in_use=set()) == first
    assert mint_room(source, in_use={first}) == first + 1


def test_zero_room_is_drawn_again() -> None:
    source = ScriptedSource([0, 3])
    assert mint_room(source) == 3


def test_a_stuck_source_fails_loudly_instead_of_looping() -> None:
    source = ScriptedSource([42])
    with pytest.raises(RoomExhaustedError, match="not random"):
        mint_room(source, in_use={42})
    assert source.calls == MAX_ROOM_DRAWS


def test_rooms_spread_over_the_63_bit_range() -> None:
    source = random.Random(3)
    rooms = [mint_room(source) for _ in range(2000)]
    # Roughly half of the rooms have bit 62 set; none has bit 63.
    high = sum(room >> 62 for room in rooms)
    assert 850 < high < 1150
    assert all(room >> 63 == 0 for room in rooms)
