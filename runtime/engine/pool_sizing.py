"""How many KV pages a rank allocates when the manifest does not say.

On a GPU the pool takes what is left of the rank's share of the device
once the weights are loaded and a forward step's peak is set aside:

    pages = floor((total × utilization − in_use − peak_step) / bytes_per_page)

`total` and `in_use` are the device's memory and what is already taken
(our weights and anything else on the device), read after loading the
weights; `utilization` is `kvCache.gpuMemoryUtilization`; `peak_step` is
the temporary memory of the largest step (measured by one profiling step).
On a CPU the pool keeps a fixed default: host memory is shared with every
other process of the node, and local mode runs several workers on one host.

Pure module: no torch.
"""

from __future__ import annotations

from pdcluster.runtime.bounds import require_at_least

DEFAULT_CPU_PAGES = 512
MIN_PAGES = 2


class PoolSizingError(ValueError):
    """The device has no room for a KV pool; the message names the setting to change."""


def num_pages_for_device(
    *,
    total_bytes: int,
    in_use_bytes: int,
    utilization: float,
    peak_step_bytes: int,
    bytes_per_page: int,
) -> int:
    """KV pages that fit this rank's share of the device (see the module doc)."""
    require_at_least(
        "num_pages_for_device",
        total_bytes=(total_bytes, 1),
        in_use_bytes=(in_use_bytes, 0),
        peak_step_bytes=(peak_step_bytes, 0),
        bytes_per_page=(bytes_per_page, 1),
    )
    if not 0 < utilization <= 1:
        raise PoolSizingError(f"gpuMemoryUtilization must be in (0, 1], got {utilization}")
    budget = int(total_bytes * utilization) - in_use_bytes - peak_step_bytes
    pages = budget // bytes_per_page
    if pages < MIN_PAGES:
        gib = 1 << 30
        raise PoolSizingError(
            f"no room for a KV pool: {utilization:.0%} of {total_bytes / gib:.1f} GiB is "
            f"{total_bytes * utilization / gib:.1f} GiB, {in_use_bytes / gib:.1f} GiB are in use "
            f"(weights and other processes) and a step needs {peak_step_bytes / gib:.2f} GiB; "
            f"raise kvCache.gpuMemoryUtilization, lower engine.maxBatchTokens, or set "
            f"kvCache.numPages"
        )
    return int(pages)
