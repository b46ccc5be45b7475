"""Fixtures shared by the transfer tests: one endpoint pair per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.transfer.transfer_helpers import Link


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    opened = Link.open()
    yield opened
    opened.close()
