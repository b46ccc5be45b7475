"""`require_at_least`: the shared lower-bound check and its message."""

from __future__ import annotations

import pytest

from pdcluster.runtime.bounds import require_at_least, require_positive


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


class _Durations:
    a_s = 1.0
    b_s = 0.0
    c_s = float("nan")


@pytest.mark.parametrize(("name", "shown"), [("b_s", "0.0"), ("c_s", "nan")])
def test_a_duration_not_above_zero_is_refused_by_name(name: str, shown: str) -> None:
    with pytest.raises(ValueError) as err:
        require_positive(_Durations(), "a_s", name)
    assert str(err.value) == f"{name} must be > 0, got {shown}"


def test_positive_durations_pass() -> None:
    assert require_positive(_Durations(), "a_s") is None
