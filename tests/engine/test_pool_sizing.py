"""KV pages from a device's free memory, when the manifest gives no numPages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.engine.engine import LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.pool_sizing import (
    DEFAULT_CPU_PAGES,
    PoolSizingError,
    num_pages_for_device,
)

GIB = 1 << 30


@given(
    total=st.integers(1 * GIB, 200 * GIB),
    in_use=st.floats(0.0, 0.8),
    peak=st.integers(0, 4 * GIB),
    utilization=st.floats(0.05, 1.0),
    page=st.integers(1 << 10, 64 << 20),
)
def test_the_pool_is_the_largest_that_fits_the_share(
    total: int, in_use: float, peak: int, utilization: float, page: int
) -> None:
    used = int(total * in_use)
    budget = int(total * utilization) - used - peak
    try:
        pages = num_pages_for_device(
            total_bytes=total,
            in_use_bytes=used,
            utilization=utilization,
            peak_step_bytes=peak,
            bytes_per_page=page,
        )
    except PoolSizingError as err:
        assert budget // page < 2
        assert "gpuMemoryUtilization" in str(err) and "numPages" in str(err)
        return
    assert pages >= 2
    assert pages * page <= budget < (pages + 1) * page


def test_a_full_device_names_what_to_change() -> None:
    with pytest.raises(PoolSizingError, match=r"90% of 80.0 GiB .* 79.0 GiB are in use"):
        num_pages_for_device(
            total_bytes=80 * GIB,
            in_use_bytes=79 * GIB,
            utilization=0.9,
            peak_step_bytes=GIB,
            bytes_per_page=1 << 20,
        )
    with pytest.raises(PoolSizingError, match=r"\(0, 1\]"):
        num_pages_for_device(
            total_bytes=GIB, in_use_bytes=0, utilization=1.5, peak_step_bytes=0, bytes_per_page=1
        )


def test_a_cpu_engine_without_num_pages_keeps_the_fixed_default() -> None:
    engine = LLMEngine(EngineConfig(num_pages=None))
    assert engine.num_total_pages == DEFAULT_CPU_PAGES == engine.runner.pool.shape.num_pages
