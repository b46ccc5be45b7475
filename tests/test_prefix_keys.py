"""chain_page_keys hashes a prompt's pages from one packed payload: the keys are
the ones page_key gives page by page, and the documented scheme's bytes."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.prefix_keys import (
    PageKeyError,
    chain_page_keys,
    page_key,
    root_key,
)

ROOT = root_key(b"salt")


def by_page(tokens: list[int], page_size: int) -> list[bytes]:
    parent, keys = ROOT, []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_key(parent, tokens[start : start + page_size])
        keys.append(parent)
    return keys


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=70),
    page_size=st.integers(min_value=1, max_value=9),
)
def test_the_chain_equals_page_by_page_keys(tokens: list[int], page_size: int) -> None:
    assert chain_page_keys(tokens, page_size, ROOT) == by_page(tokens, page_size)


def test_a_key_is_blake2b_of_the_parent_then_the_pages_little_endian_words() -> None:
    tokens = [1, 2, 3, 4, 70000, 6]
    first = hashlib.blake2b(ROOT, digest_size=16, person=b"pdcluster.page")
    first.update(struct.pack("<4I", 1, 2, 3, 4))
    assert chain_page_keys(tokens, 4, ROOT) == [first.digest()]
    pairs = chain_page_keys(tokens, 2, ROOT)
    third = hashlib.blake2b(pairs[1], digest_size=16, person=b"pdcluster.page")
    third.update(struct.pack("<2I", 70000, 6))
    assert pairs[2] == third.digest()


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_a_token_id_outside_four_bytes_is_refused_in_a_full_page_only(bad: int) -> None:
    with pytest.raises(PageKeyError, match="token ids must be integers"):
        chain_page_keys([1, bad, 3, 4], 2, ROOT)
    # A trailing partial page gets no key, so it is not read.
    assert len(chain_page_keys([1, 2, bad], 2, ROOT)) == 1
