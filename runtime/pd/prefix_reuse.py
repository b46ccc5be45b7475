"""Decode-side prefix reuse: the leading prompt pages decode already holds,
and the rules both legs apply to them.

A decode rank with the prefix cache on keeps the full prompt pages it
received. When a new room's prompt starts with pages it still holds, it
references them in its page table and tells prefill, in `TransferMeta.reuse`,
how many leading pages it holds and the key of the last one; prefill then
writes only the tokens after them.

The key is a page-chain key (`prefix_cache.chain_page_keys`) from a root that
only this protocol uses (`REUSE_ROOT`), so both legs compute the same chain
whatever their engines' cache salts (decode's cache keys include its own
sharding, prefill's its own). The leg's prompt digest already makes decode's
whole prompt equal prefill's; the key check on top says decode counted its
pages over that same prompt, and a mismatch fails the room before any write
(`reuse_problem`), never a guess.

Rules (checked here, relied on by both sides):
- at least one page is always sent: decode reuses at most the full pages
  before the prompt's last token (`num_reusable_pages`), so every transfer
  carries the last token's KV and concludes the usual way;
- prefill writes no token before `first_sent_token(reuse)`: the reused pages
  are read by other sequences and must never be written;
- decode expects `num_sent_tokens(...)` tokens of KV and checks only those.

Pure module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final

import msgspec

from pdcluster.runtime.engine.prefix_cache import KEY_BYTES, chain_page_keys, root_key

__all__ = [
    "REUSE_MISMATCH",
    "REUSE_ROOT",
    "ReusedPrefix",
    "build_reuse",
    "first_sent_token",
    "num_reusable_pages",
    "num_sent_tokens",
    "reuse_keys",
    "reuse_problem",
]

REUSE_ROOT: Final = root_key(b"pdcluster.pd.decode-reuse.v1")
REUSE_MISMATCH: Final = "reuse_mismatch"

MAX_REUSED_PAGES: Final = 1 << 17


class ReusedPrefix(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode holds the room's first `num_pages` full pages; `last_key` is the
    reuse-chain key of the last of them."""

    num_pages: Annotated[int, msgspec.Meta(ge=1, le=MAX_REUSED_PAGES)]
    last_key: Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]


def reuse_keys(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Reuse-chain keys of the full pages of `token_ids` (the prompt)."""
    return list(chain_page_keys(token_ids, page_size, REUSE_ROOT))


def num_reusable_pages(num_hit_pages: int, num_tokens: int, page_size: int) -> int:
    """How many of decode's `num_hit_pages` leading cached pages a room of
    `num_tokens` prompt tokens may reuse: none past the page before the last
    token, so prefill always sends at least the last token."""
    for name, value in (("num_hit_pages", num_hit_pages), ("num_tokens", num_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    if num_tokens == 0:
        return 0
    return min(num_hit_pages, (num_tokens - 1) // page_size)


def build_reuse(token_ids: Sequence[int], num_pages: int, page_size: int) -> ReusedPrefix | None:
    """What decode sends for reusing the first `num_pages` pages (None: none)."""
    if num_pages == 0:
        return None
    if num_pages != num_reusable_pages(num_pages, len(token_ids), page_size):
        raise ValueError(
            f"{num_pages} pages cannot be reused for a prompt of {len(token_ids)} tokens "
            f"(page size {page_size}): at least its last token must be sent"
        )
    key = chain_page_keys(token_ids[: num_pages * page_size], page_size, REUSE_ROOT)[-1]
    return ReusedPrefix(num_pages=num_pages, last_key=bytes(key))


def first_sent_token(reuse: ReusedPrefix | None, page_size: int) -> int:
    """The first prompt token whose KV prefill writes into decode's pages."""
    return 0 if reuse is None else reuse.num_pages * page_size


def num_sent_tokens(num_tokens: int, reuse: ReusedPrefix | None, page_size: int) -> int:
    """Prompt tokens whose KV travels (the rest decode already holds)."""
    return max(0, num_tokens - first_sent_token(reuse, page_size))


def reuse_problem(
    page_keys: Sequence[bytes], num_tokens: int, reuse: ReusedPrefix | None, page_size: int
) -> str | None:
    """Why prefill must refuse decode's `reuse` for its prompt, or None.

    `page_keys` are prefill's reuse-chain keys of its prompt's full pages
    (`reuse_keys`); `num_tokens` the prompt's length. Refused: reusing the
    page of the last token (nothing would be sent), or a key that is not
    prefill's key of that page (decode counted over another prompt).
    """
    if reuse is None:
        return None
    n = reuse.num_pages
    if n != num_reusable_pages(n, num_tokens, page_size):
        return (
            f"{REUSE_MISMATCH}: decode reuses {n} pages of a {num_tokens}-token prompt "
            f"(page size {page_size}); at most {num_reusable_pages(n, num_tokens, page_size)}"
        )
    if len(page_keys) < n:
        return f"{REUSE_MISMATCH}: prefill knows {len(page_keys)} page keys, decode reuses {n}"
    if bytes(page_keys[n - 1]) != reuse.last_key:
        return f"{REUSE_MISMATCH}: decode's key of page {n - 1} is not prefill's"
    return None
