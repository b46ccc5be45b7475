"""Which of a prompt's tokens a prefill rank may send now, for pools that move whole pages.

Our engine's pages hold one row per token, so any run of tokens can move,
and a chunk's KV leaves the moment it is computed. Some engines keep a
page's interior in a layout of their own: vLLM's CPU attention stores a
page's K transposed (head_dim × tokens) for its vector kernels, so a token's
K is no row at all. Such a pool (`KVPoolShape.whole_pages`) moves in whole
pages only, and each page exactly once, because two writes of one page in
flight (one-sided NIXL) may land in either order:

- a page leaves once every token of it is computed, and the prompt's last,
  partial page once the whole prompt is;
- that last write covers the page to its end: the slots past the prompt
  hold whatever the prefill page held, and the decode writes each of them
  (recomputing the last prompt token, then generating) before reading it.

Pools of row pages (whole_pages False) keep sending whatever is computed.

Pure module.
"""

from __future__ import annotations


def sendable_end(computed: int, last: int, page_size: int, whole_pages: bool) -> int:
    """Of the tokens below `last` (the rank's share of the prompt), how far the
    KV may leave once `computed` tokens are computed."""
    end = min(computed, last)
    if not whole_pages or end >= last:
        return end
    return end // page_size * page_size


def written_end(end: int, last: int, page_size: int, whole_pages: bool) -> int:
    """Where a transfer ending at token `end` writes to: the end of its page when the
    pages move whole and the prompt ends there."""
    if whole_pages and end >= last:
        return -(-end // page_size) * page_size
    return end


def num_written_tokens(num_tokens: int, first_sent: int, page_size: int, whole_pages: bool) -> int:
    """Token slots a decode rank receives for a prompt of `num_tokens` whose first
    `first_sent` tokens it holds already."""
    end = written_end(num_tokens, num_tokens, page_size, whole_pages)
    return max(0, end - first_sent)
