"""Which prompt tokens may leave now, for pools that move whole pages (vLLM's CPU pages)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.transfer.page_span import num_written_tokens, sendable_end, written_end


def test_row_pages_send_whatever_is_computed():
    assert sendable_end(45, 100, 32, whole_pages=False) == 45
    assert written_end(45, 100, 32, whole_pages=False) == 45
    assert num_written_tokens(45, 0, 32, whole_pages=False) == 45


def test_whole_pages_hold_a_partial_page_until_the_prompt_ends_there():
    assert sendable_end(45, 100, 32, whole_pages=True) == 32
    assert sendable_end(100, 100, 32, whole_pages=True) == 100
    assert written_end(100, 100, 32, whole_pages=True) == 128  # the last page to its end
    assert written_end(64, 100, 32, whole_pages=True) == 64
    assert num_written_tokens(100, 32, 32, whole_pages=True) == 96


@given(st.lists(st.integers(1, 200), min_size=1, max_size=8), st.sampled_from([1, 4, 32]))
def test_chunks_send_every_page_exactly_once_and_nothing_past_the_last(chunks, page_size):
    """Whatever chunks the compute comes in, a whole-page pool's sends tile the
    prompt's pages, once each, and end at the last page's end."""
    total = sum(chunks)
    computed = sent = 0
    spans = []
    for chunk in chunks:
        computed += chunk
        end = sendable_end(computed, total, page_size, whole_pages=True)
        if end > sent:
            spans.append((sent, written_end(end, total, page_size, whole_pages=True)))
            sent = end
    pages = [p for a, b in spans for p in range(a // page_size, -(-b // page_size))]
    assert pages == list(range(-(-total // page_size)))
    assert all(a % page_size == 0 for a, _ in spans)
    assert spans[-1][1] == num_written_tokens(total, 0, page_size, whole_pages=True)
