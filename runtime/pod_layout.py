"""How the ranks of one instance are spread over pods (`gpusPerPod`).

An instance of R = dp*tp*cp*pp ranks with `gpusPerPod: G` runs as R / G
pods. Ranks are numbered in the global rank order of
runtime/engine/topology.py (`((dp*cp + cp_rank)*tp + tp_rank)*pp + pp_rank`,
pp fastest), and pod k hosts the contiguous ranks [k*G, (k+1)*G):

    R = 4 (tp=2, pp=2), G = 2          R = 4 (dp=2, tp=2), G = 1
    pod 0 (leader): ranks 0, 1          pod 0 (leader): rank 0
    pod 1:          ranks 2, 3          pod 1: rank 1   pod 2: rank 2 ...

Invariants (tested):
- the pods' rank ranges partition [0, R): every rank lives on exactly one
  pod, and a pod's ranks are contiguous;
- pod 0 is the leader: it hosts rank 0 (dp group 0's leader, where the
  bootstrap server and the HTTP API run);
- `gpusPerPod` left out means one pod holding every rank (the layout every
  manifest had before it could be set); set, it is obeyed, never raised —
  a G that does not divide R, or exceeds it, is an error here.

Because the order is dp-major and a pod's ranks are contiguous, a pod holds
whole dp groups when G is a multiple of cp*tp*pp, and a dp group spans
several pods otherwise (e.g. TP16 over two pods of 8). With dp > 1 the
leader of dp group d (its rank d*R/dp) may live on a pod k > 0: that pod
then hosts the group's torch store and internal HTTP API at its own
address (runtime/pod_rendezvous.py says how the pods learn it).

Pure module: no imports beyond the standard library, so the manifest
models (runtime/spec/) and the operator can both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

LEADER_POD = 0


class PodLayoutError(ValueError):
    """`gpusPerPod` does not fit the instance's ranks; the message says how."""


def check_gpus_per_pod(num_ranks: int, gpus_per_pod: int | None) -> None:
    """Raise PodLayoutError unless `gpus_per_pod` (None: left out) fits `num_ranks` ranks."""
    if num_ranks < 1:
        raise PodLayoutError(f"an instance needs at least one rank, got {num_ranks}")
    if gpus_per_pod is None:
        return
    if gpus_per_pod < 1:
        raise PodLayoutError(f"gpusPerPod must be at least 1, got {gpus_per_pod}")
    if gpus_per_pod > num_ranks:
        raise PodLayoutError(
            f"gpusPerPod ({gpus_per_pod}) is larger than the ranks per instance "
            f"({num_ranks} = dp*tp*cp*pp); a pod cannot hold more ranks than its instance has"
        )
    if num_ranks % gpus_per_pod:
        raise PodLayoutError(
            f"ranks per instance ({num_ranks} = dp*tp*cp*pp) must be divisible by "
            f"gpusPerPod ({gpus_per_pod})"
        )


@dataclass(frozen=True)
class PodLayout:
    """The pods of one instance: `num_pods` pods of `ranks_per_pod` ranks each."""

    num_ranks: int
    ranks_per_pod: int

    def __post_init__(self) -> None:
        check_gpus_per_pod(self.num_ranks, self.ranks_per_pod)

    @property
    def num_pods(self) -> int:
        return self.num_ranks // self.ranks_per_pod

    @property
    def is_multi_pod(self) -> bool:
        return self.num_pods > 1

    def rank_range(self, pod_index: int) -> range:
        """Global ranks pod `pod_index` hosts: [k*G, (k+1)*G)."""
        self._check_pod(pod_index)
        first = pod_index * self.ranks_per_pod
        return range(first, first + self.ranks_per_pod)

    def pod_of_rank(self, rank: int) -> int:
        """The pod hosting global rank `rank`."""
        if not 0 <= rank < self.num_ranks:
            raise PodLayoutError(f"rank {rank} is outside the instance's {self.num_ranks} ranks")
        return rank // self.ranks_per_pod

    def is_leader(self, pod_index: int) -> bool:
        self._check_pod(pod_index)
        return pod_index == LEADER_POD

    def _check_pod(self, pod_index: int) -> None:
        if not 0 <= pod_index < self.num_pods:
            raise PodLayoutError(
                f"pod index {pod_index} is outside the instance's {self.num_pods} pods"
            )


def compute_pod_layout(num_ranks: int, gpus_per_pod: int | None) -> PodLayout:
    """The layout of an instance of `num_ranks` ranks; `gpus_per_pod` None: one pod."""
    check_gpus_per_pod(num_ranks, gpus_per_pod)
    return PodLayout(num_ranks=num_ranks, ranks_per_pod=gpus_per_pod or num_ranks)
