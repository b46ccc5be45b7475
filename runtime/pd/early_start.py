"""How much prompt a prefill group computes before decode has paired it.

Under `early`, the prefill leg arrives at about the time decode starts
reserving pages; waiting for decode's metadata before computing would put
its round trip (a few hops, 1–2 ms on an idle box) in front of every
prompt. So the group may start a prompt *unpaired* (some destination still
unknown) and hold the KV it computes until the metadata is in.

Unbounded, that trades a round trip for a deadlock: prefill's pages would
fill up with prompts decode has not admitted while the prompts decode did
admit wait for pages on prefill, until the bootstrap timeout failed them.
So unpaired prompts together hold at most `limit` tokens:

- `limit = pool_tokens - max_prompt_tokens`: what stays free is always
  enough for the longest prompt a paired room may bring (paired rooms
  always progress: their pages on decode are reserved). A prompt of any
  length may start unpaired: the engine takes all of a prompt's pages when
  it admits it, so a long prompt counts whole, but its first chunk's
  compute hides the round trip as well as a short prompt's does. (With the
  budget at one chunk, every prompt longer than a chunk waited for pairing:
  2.6 ms of a 2,000-token request, docs/benchmarks.md.) What unpaired
  prompts cost is pages: under a saturated decode, prefill holds computed
  KV for rooms decode has queued, and paired rooms share the rest;
- a prompt past the budget starts when it is paired, as it always did;
- a prompt leaves the budget when it is paired or forgotten (failed,
  released), whichever comes first, once.

Pure module.
"""

from __future__ import annotations


def early_start_limit(pool_tokens: int, max_prompt_tokens: int) -> int:
    """Tokens unpaired prompts may hold at once (0: never start one unpaired)."""
    return max(0, pool_tokens - max_prompt_tokens)


class EarlyStartBudget:
    """The unpaired prompts one prefill group computes, and what they hold."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"EarlyStartBudget needs limit >= 0, got {limit}")
        self.limit = limit
        self._unpaired: dict[int, int] = {}  # room -> prompt tokens

    @property
    def unpaired_tokens(self) -> int:
        return sum(self._unpaired.values())

    def holds(self, room: int) -> bool:
        return room in self._unpaired

    def try_start(self, room: int, tokens: int) -> bool:
        """May `room`'s prompt of `tokens` start before it is paired? If so it is counted."""
        if tokens < 1:
            raise ValueError(f"room {room}: a prompt has at least one token, got {tokens}")
        if room in self._unpaired:
            raise ValueError(f"room {room} already started unpaired")
        if self.unpaired_tokens + tokens > self.limit:
            return False
        self._unpaired[room] = tokens
        return True

    def leave(self, room: int) -> None:
        """`room` was paired, or is gone: it holds nothing of the budget any more."""
        self._unpaired.pop(room, None)
