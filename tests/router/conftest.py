from __future__ import annotations

from collections.abc import Iterator

import pytest

from .harness import LoopThread


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()
