"""One check and one message for "these numbers have a lower bound".

`require_at_least("RoomQueue", max_active=(n, 1), max_queued=(m, 0))` raises
`ValueError("RoomQueue needs max_active >= 1 and max_queued >= 0, got 0, 4")`
unless every value reaches its bound; the message names every bound and
every value, in the order given. `require_positive(settings, "a_s", "b_s")`
checks a settings object's durations: `a_s must be > 0, got 0`.

Pure module.
"""

from __future__ import annotations


def require_at_least(what: str, **bounds: tuple[float, float]) -> None:
    """Raise ValueError naming all `bounds` (name=(value, minimum)) unless each value >= minimum."""
    if all(value >= minimum for value, minimum in bounds.values()):
        return
    needs = [f"{name} >= {minimum}" for name, (_, minimum) in bounds.items()]
    listed = " and ".join(needs) if len(needs) < 3 else f"{', '.join(needs[:-1])} and {needs[-1]}"
    got = ", ".join(str(value) for value, _ in bounds.values())
    raise ValueError(f"{what} needs {listed}, got {got}")


def require_positive(settings: object, *names: str) -> None:
    """Raise ValueError "<name> must be > 0, got <value>" for the first of `settings`'
    attributes `names` that is not > 0 (NaN included)."""
    for name in names:
        value = getattr(settings, name)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
