"""`require_at_least`: the shared lower-bound check and its message."""

from __future__ import annotations

import pytest

from pdcluster.runtime.bounds import require_at_least


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({"a": (0, 1)}, "thing needs a >= 1, got 0"),
        ({"a": (1, 1), "b": (-1, 0)}, "thing needs a >= 1 and b >= 0, got 1, -1"),
        (
            {"a": (0.5, 1), "b": (0, 0), "c": (3, 1)},
            "thing needs a >= 1, b >= 0 and c >= 1, got 0.5, 0, 3",
        ),
    ],
)
def test_a_value_below_its_bound_is_refused_naming_every_bound_and_value(
    bounds: dict[str, tuple[float, float]], message: str
) -> None:
    with pytest.raises(ValueError) as err:
        require_at_least("thing", **bounds)
    assert str(err.value) == message


@pytest.mark.parametrize("bounds", [{}, {"a": (1, 1)}, {"a": (2, 1), "b": (0.0, 0)}])
def test_values_at_or_above_their_bounds_pass(bounds: dict[str, tuple[float, float]]) -> None:
    assert require_at_least("thing", **bounds) is None
