"""first_bad_token: its fast path for plain int lists agrees with the entry-by-entry rule."""

from __future__ import annotations

import enum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.engine.token_ids import first_bad_token, is_token


class Small(enum.IntEnum):
    ONE = 1


def reference(ids: list[object], limit: int | None) -> int | None:
    for i, t in enumerate(ids):
        if not is_token(t) or (limit is not None and t >= limit):  # type: ignore[operator]
            return i
    return None


ENTRIES = st.one_of(
    st.integers(min_value=-3, max_value=40),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, min_value=0, max_value=40),
    st.sampled_from([Small.ONE, "7", 2**64]),
)


@given(ids=st.lists(ENTRIES, max_size=30), limit=st.one_of(st.none(), st.integers(0, 40)))
def test_it_names_the_entry_the_entry_by_entry_rule_names(
    ids: list[object], limit: int | None
) -> None:
    assert first_bad_token(ids, limit) == reference(ids, limit)


@given(ids=st.lists(st.integers(min_value=0, max_value=99), max_size=50))
def test_plain_token_lists_pass_and_one_bad_entry_is_found_where_it_is(ids: list[int]) -> None:
    assert first_bad_token(ids, 100) is None
    for bad in (-1, True, None, 1.0, 100):
        for at in {0, len(ids) // 2, len(ids)}:
            spoiled: list[object] = [*ids[:at], bad, *ids[at:]]
            assert first_bad_token(spoiled, 100) == at


@pytest.mark.parametrize(
    ("ids", "limit", "expected"),
    [
        ([], None, None),
        ([0, 1, 2], None, None),
        ([0, 1, 2], 3, None),
        ([0, 1, 3], 3, 2),
        ([Small.ONE, 2], None, None),  # an int subclass other than bool is a token
        ([1, None], None, 1),  # None is found, not mistaken for "no bad entry"
        ([False], None, 0),
    ],
)
def test_examples(ids: list[object], limit: int | None, expected: int | None) -> None:
    assert first_bad_token(ids, limit) == expected
