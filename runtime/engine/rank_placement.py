"""Which GPU and which NIC each rank process of a pod uses.

A pod running G ranks (`gpusPerPod`, or every rank of the instance) asks
for G GPUs, and its container sees them as devices 0..G-1 (the device
plugin exposes exactly those). Rank r of the instance runs on pod
r // G as its *local rank* r mod G, and local rank k uses device k:
- whatever the dp, tp, cp or pp coordinates: with `dp: 8` in one pod, the
  eight dp groups' engines land on devices 0..7, never all on device 0
  (each dp group is its own torch world, so its ranks are numbered from 0
  inside it: the global rank, not the group rank, picks the device);
- a pod seeing fewer devices than it runs ranks is refused, never two
  engines on one GPU;
- `device: cuda:N` (an explicit index, local mode on one GPU) is kept.

With `transfer.ucx.rankNetDevices`, local rank k sets UCX_NET_DEVICES to
entry k (the NIC nearest GPU k on a typical 8-GPU, 8-NIC node), otherwise
to `netDevices` (or leaves UCX to choose).

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.runtime.pod_layout import PodLayout
from pdcluster.runtime.spec import UcxSpec


class RankPlacementError(ValueError):
    """The pod cannot give each of its ranks a device of its own; the message says why."""


@dataclass(frozen=True)
class RankPlacement:
    global_rank: int
    local_rank: int  # index among the pod's ranks
    device: str  # "cpu" or "cuda:K"
    ucx_net_devices: str | None  # UCX_NET_DEVICES for this rank; None: unchanged


def local_rank(layout: PodLayout, global_rank: int) -> int:
    """Index of `global_rank` among its pod's ranks."""
    if not 0 <= global_rank < layout.num_ranks:
        raise RankPlacementError(
            f"rank {global_rank} is outside an instance of {layout.num_ranks} ranks"
        )
    return global_rank % layout.ranks_per_pod


def place_rank(
    layout: PodLayout,
    global_rank: int,
    device: str,
    num_visible_devices: int,
    ucx: UcxSpec | None = None,
) -> RankPlacement:
    """Where rank `global_rank` runs; `num_visible_devices` is the pod's CUDA device count."""
    local = local_rank(layout, global_rank)
    chosen = device
    if device == "cuda":
        if num_visible_devices < layout.ranks_per_pod:
            raise RankPlacementError(
                f"this pod runs {layout.ranks_per_pod} ranks but sees {num_visible_devices} "
                "CUDA devices: each rank needs a GPU of its own (request one nvidia.com/gpu "
                "per rank; the operator does on device: cuda)"
            )
        chosen = f"cuda:{local}"
    elif device != "cpu" and not device.startswith("cuda:"):
        raise RankPlacementError(f"device {device!r}: expected cpu, cuda or cuda:N")
    nic = ucx.net_devices_for(local) if ucx is not None else None
    return RankPlacement(global_rank, local, chosen, nic)
