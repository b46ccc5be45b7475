"""Pod layout: which ranks of an instance each pod hosts (runtime/pod_layout.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.engine.topology import ParallelConfig
from pdcluster.runtime.pod_layout import (
    LEADER_POD,
    PodLayout,
    PodLayoutError,
    compute_pod_layout,
)
from pdcluster.runtime.spec import SpecError, parse_spec


@pytest.mark.parametrize(
    ("num_ranks", "gpus_per_pod", "ranges"),
    [
        (1, None, [range(0, 1)]),
        (4, None, [range(0, 4)]),
        (4, 4, [range(0, 4)]),
        (4, 2, [range(0, 2), range(2, 4)]),
        (4, 1, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),
        (16, 8, [range(0, 8), range(8, 16)]),
        (6, 3, [range(0, 3), range(3, 6)]),
    ],
)
def test_pod_k_hosts_the_kth_contiguous_block_of_ranks(
    num_ranks: int, gpus_per_pod: int | None, ranges: list[range]
) -> None:
    layout = compute_pod_layout(num_ranks, gpus_per_pod)
    assert layout.num_pods == len(ranges)
    assert [layout.rank_range(k) for k in range(layout.num_pods)] == ranges
    assert layout.is_multi_pod == (len(ranges) > 1)


@pytest.mark.parametrize(
    ("num_ranks", "gpus_per_pod", "phrase"),
    [
        (4, 3, "must be divisible by gpusPerPod (3)"),
        (6, 4, "must be divisible by gpusPerPod (4)"),
        (2, 4, "gpusPerPod (4) is larger than the ranks per instance (2"),
        (1, 2, "is larger than the ranks per instance"),
        (4, 0, "gpusPerPod must be at least 1"),
        (0, None, "at least one rank"),
    ],
)
def test_a_gpus_per_pod_that_does_not_fit_is_refused_with_the_numbers(
    num_ranks: int, gpus_per_pod: int | None, phrase: str
) -> None:
    with pytest.raises(PodLayoutError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        compute_pod_layout(num_ranks, gpus_per_pod)
    with pytest.raises(PodLayoutError):
        PodLayout(num_ranks=num_ranks, ranks_per_pod=gpus_per_pod or 0)


def test_pod_and_rank_indexes_outside_the_instance_are_errors() -> None:
    layout = compute_pod_layout(4, 2)
    for bad_pod in (-1, 2):
        with pytest.raises(PodLayoutError, match="outside the instance's 2 pods"):
            layout.rank_range(bad_pod)
        with pytest.raises(PodLayoutError):
            layout.is_leader(bad_pod)
    for bad_rank in (-1, 4):
        with pytest.raises(PodLayoutError, match="outside the instance's 4 ranks"):
            layout.pod_of_rank(bad_rank)


divisor_layouts = st.integers(1, 64).flatmap(
    lambda r: st.tuples(st.just(r), st.sampled_from([g for g in range(1, r + 1) if r % g == 0]))
)


@given(divisor_layouts)
def test_ranges_partition_the_ranks_and_pod_0_leads(case: tuple[int, int]) -> None:
    num_ranks, gpus = case
    layout = compute_pod_layout(num_ranks, gpus)
    hosted = [r for k in range(layout.num_pods) for r in layout.rank_range(k)]
    # Every rank on exactly one pod, in rank order, each pod the same size.
    assert hosted == list(range(num_ranks))
    assert {len(layout.rank_range(k)) for k in range(layout.num_pods)} == {gpus}
    for rank in range(num_ranks):
        assert rank in layout.rank_range(layout.pod_of_rank(rank))
    assert layout.pod_of_rank(0) == LEADER_POD
    assert [layout.is_leader(k) for k in range(layout.num_pods)] == [True] + [False] * (
        layout.num_pods - 1
    )


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.data())
def test_a_pod_holds_whole_dp_groups_exactly_when_they_fit(
    dp: int, cp: int, tp: int, pp: int, data: st.DataObject
) -> None:
    parallel = ParallelConfig(dp=dp, cp=cp, tp=tp, pp=pp)
    ranks = parallel.world_size
    gpus = data.draw(st.sampled_from([g for g in range(1, ranks + 1) if ranks % g == 0]))
    layout = compute_pod_layout(ranks, gpus)
    # The dp-group-0 leader (rank 0: bootstrap server, HTTP API) is on the leader pod.
    assert layout.pod_of_rank(parallel.rank_info(0).leader_rank) == LEADER_POD
    pods_of_groups = [{layout.pod_of_rank(r) for r in g} for g in parallel.dp_groups()]
    if gpus % parallel.group_size == 0:
        assert all(len(pods) == 1 for pods in pods_of_groups)
    elif parallel.group_size % gpus == 0:
        assert all(len(pods) == parallel.group_size // gpus for pods in pods_of_groups)


def _role(extra: dict[str, object]) -> dict[str, object]:
    return {"prefill": {"topology": {"tp": 2, "pp": 2}, **extra}, "decode": {}}


def test_the_spec_keeps_gpus_per_pod_as_written_and_left_out_means_one_pod() -> None:
    left_out = parse_spec(_role({})).prefill
    assert left_out is not None and left_out.gpus_per_pod is None
    assert left_out.pods_per_instance == 1
    assert left_out.pod_layout.rank_range(0) == range(4)
    spread = parse_spec(_role({"gpusPerPod": 1})).prefill
    assert spread is not None and spread.pods_per_instance == 4


@pytest.mark.parametrize(
    ("gpus", "phrase"),
    [(3, "divisible by gpusPerPod (3)"), (8, "gpusPerPod (8) is larger than the ranks")],
)
def test_the_spec_refuses_a_gpus_per_pod_that_does_not_fit(gpus: int, phrase: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(_role({"gpusPerPod": gpus}))
    assert phrase in str(err.value) and "prefill" in str(err.value)
