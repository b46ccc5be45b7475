"""Each rank of a pod gets a GPU of its own, and its NIC (engine/rank_placement.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.engine.rank_placement import RankPlacementError, place_rank
from pdcluster.runtime.pod_layout import compute_pod_layout
from pdcluster.runtime.spec import SpecError, UcxSpec, parse_spec

axis = st.sampled_from([1, 2, 4])


@given(dp=axis, tp=axis, pp=st.sampled_from([1, 2]), data=st.data())
def test_no_two_ranks_of_a_pod_share_a_gpu_whatever_the_topology(
    dp: int, tp: int, pp: int, data: st.DataObject
) -> None:
    ranks = dp * tp * pp
    gpus_per_pod = data.draw(st.sampled_from([g for g in (1, 2, 4, 8, 16) if ranks % g == 0]))
    layout = compute_pod_layout(ranks, gpus_per_pod)
    for pod in range(layout.num_pods):
        devices = [
            place_rank(layout, r, "cuda", layout.ranks_per_pod).device
            for r in layout.rank_range(pod)
        ]
        indexes = sorted(int(d.removeprefix("cuda:")) for d in devices)
        assert indexes == list(range(layout.ranks_per_pod))


def test_dp8_in_one_pod_puts_each_engine_on_its_own_gpu() -> None:
    # Each dp group is its own torch world: its rank is 0 in its group, and the
    # global rank, not the group rank, must pick the device.
    layout = compute_pod_layout(8, None)
    devices = [place_rank(layout, d, "cuda", 8).device for d in range(8)]
    assert devices == [f"cuda:{d}" for d in range(8)]


def test_a_pod_seeing_fewer_gpus_than_ranks_is_refused() -> None:
    layout = compute_pod_layout(4, None)
    with pytest.raises(RankPlacementError, match="4 ranks but sees 2 CUDA devices"):
        place_rank(layout, 3, "cuda", 2)


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_cpu_and_an_explicit_index_are_kept(device: str) -> None:
    layout = compute_pod_layout(2, None)
    assert place_rank(layout, 1, device, 0).device == device


def test_each_local_rank_takes_its_nic_from_the_manifest_map() -> None:
    ucx = UcxSpec(rank_net_devices=["mlx5_0:1", "mlx5_1:1"])
    layout = compute_pod_layout(4, 2)  # two pods of two ranks
    nics = [place_rank(layout, r, "cuda", 2, ucx).ucx_net_devices for r in range(4)]
    assert nics == ["mlx5_0:1", "mlx5_1:1", "mlx5_0:1", "mlx5_1:1"]
    assert place_rank(layout, 3, "cuda", 2, UcxSpec(net_devices="mlx5_2:1")).ucx_net_devices == (
        "mlx5_2:1"
    )
    assert place_rank(layout, 3, "cuda", 2, UcxSpec()).ucx_net_devices is None


@pytest.mark.parametrize(
    ("ucx", "phrase"),
    [
        ({"netDevices": "mlx5_0:1", "rankNetDevices": ["mlx5_0:1"]}, "not both"),
        ({"rankNetDevices": ["mlx5_0:1"]}, "rankNetDevices has 1 entries but a prefill pod runs 2"),
    ],
)
def test_a_nic_map_that_does_not_fit_the_pods_is_refused(
    ucx: dict[str, object], phrase: str
) -> None:
    with pytest.raises(SpecError, match=phrase):
        parse_spec({"transfer": {"ucx": ucx}, "prefill": {"topology": {"tp": 2}}, "decode": {}})
