"""Bootstrap registry: distinct ranks, consistent compat fields, dp-rank entries expire."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd.bootstrap_registry import (
    BootstrapRegistry,
    NotReady,
    RankRegistration,
    RegistryError,
    UnknownRank,
)
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord

from .sim import compat

SHAPE = InstanceShape(dp=1, cp=1, tp=2, pp=2)


def reg(tp: int = 0, pp: int = 0, port: int = 7000, **compat_overrides: object) -> RankRegistration:
    return RankRegistration(
        rank=RankCoord(tp=tp, pp=pp),
        shape=SHAPE,
        endpoint=f"tcp://127.0.0.1:{port}",
        compat=compat(**compat_overrides),
    )


def test_ready_only_when_every_distinct_rank_registered() -> None:
    r = BootstrapRegistry(SHAPE)
    assert r.register(reg(0, 0)) is True
    assert r.register(reg(0, 0, port=7001)) is False  # a rank registering twice counts once
    r.register(reg(0, 1))
    r.register(reg(1, 0))
    with pytest.raises(NotReady) as err:
        r.instance_info()
    assert (err.value.registered, err.value.expected, err.value.status) == (3, 4, 503)
    r.register(reg(1, 1))
    info = r.instance_info()
    assert info.shape == SHAPE and len(info.ranks) == 4
    # The re-registration replaced the address (a restarted rank on a new port).
    assert r.rank_address(RankCoord()).endpoint == "tcp://127.0.0.1:7001"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("page_size", 8),
        ("kv_dtype", "float16"),
        ("kv_layout", "HND"),
        ("allocation_policy", "prefill_complete"),
        ("model_fingerprint", "other"),
    ],
)
def test_inconsistent_compat_field_is_400_naming_it(field: str, value: object) -> None:
    r = BootstrapRegistry(SHAPE)
    r.register(reg(0, 0))
    with pytest.raises(RegistryError) as err:
        r.register(reg(1, 0, **{field: value}))
    assert err.value.status == 400 and err.value.field == field
    assert f"{field} mismatch" in str(err.value) and str(value) in str(err.value)
    assert r.num_registered == 1  # nothing changed


@pytest.mark.parametrize(
    ("registration", "field"),
    [
        (
            RankRegistration(RankCoord(), InstanceShape(tp=4, pp=2), "tcp://x:1", compat()),
            "shape.tp",
        ),
        (RankRegistration(RankCoord(tp=2), SHAPE, "tcp://x:1", compat()), "rank.tp"),
        (RankRegistration(RankCoord(dp=1), SHAPE, "tcp://x:1", compat()), "rank.dp"),
    ],
)
def test_shape_and_coordinates_are_checked(registration: RankRegistration, field: str) -> None:
    r = BootstrapRegistry(SHAPE)
    with pytest.raises(RegistryError) as err:
        r.register(registration)
    assert err.value.field == field and r.num_registered == 0


def test_unknown_rank_is_404() -> None:
    r = BootstrapRegistry(SHAPE)
    with pytest.raises(UnknownRank) as err:
        r.rank_address(RankCoord(tp=1))
    assert err.value.status == 404


def test_dp_rank_entries_expire() -> None:
    r = BootstrapRegistry(InstanceShape(dp=4), dp_entry_ttl_s=10.0)
    r.register_dp_rank(room=77, dp_rank=3, now=0.0)
    assert r.query_dp_ranks([77, 78], now=9.9) == {77: 3}
    assert r.query_dp_ranks([77], now=10.0) == {}
    with pytest.raises(RegistryError) as err:
        r.register_dp_rank(room=1, dp_rank=4, now=0.0)
    assert err.value.field == "dp_rank"


@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), max_size=20))
def test_count_is_distinct_ranks(ranks: list[tuple[int, int]]) -> None:
    r = BootstrapRegistry(SHAPE)
    for tp, pp in ranks:
        r.register(reg(tp, pp))
    assert r.num_registered == len(set(ranks))
    assert r.is_ready == (len(set(ranks)) == 4)
