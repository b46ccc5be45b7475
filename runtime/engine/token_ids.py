"""Token id checks shared by the engine and its scheduler.

Pure module: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

__all__ = ["first_bad_token", "is_token"]


def is_token(value: object) -> bool:
    """A token id: an int >= 0 (bool excluded: True as a token is a caller's bug)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def first_bad_token(ids: Sequence[object], limit: int | None = None) -> int | None:
    """The index of the first entry of `ids` that is not a token id (or is not
    below `limit`, when given); None when every entry is one.

    A list of plain ints in range, the usual prompt, is settled by three passes
    in C (the set of the entries' types, their min and max); anything else is
    checked entry by entry. A per-entry check in Python costs about 0.1 µs a
    token, which the engine and its scheduler each paid for every prompt
    (0.2 ms each at 2,000 tokens, on decode's path to a request's first token).
    """
    if not ids:
        return None
    if set(map(type, ids)) == {int}:
        plain = cast("Sequence[int]", ids)
        if min(plain) >= 0 and (limit is None or max(plain) < limit):
            return None
    for i, t in enumerate(ids):
        if not is_token(t) or (limit is not None and cast(int, t) >= limit):
            return i
    return None
