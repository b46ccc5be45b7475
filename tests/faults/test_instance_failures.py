"""`/admin/failures` and `pd_stats` speak for the whole instance, not its front rank.

One prefill instance of dp 2 × tp 2 (four rank processes). The operator
reads one URL per pod; a failure that only a follower rank, or only dp
group 1, records must show up there — and a room that fails on both ranks
of a group must count once (the operator's Event counts rooms).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from tests.faults.harness import (
    FaultCluster,
    base_spec,
    gen_body,
    mint_rid,
    mint_room,
    post_leg,
    wait_until,
)
from tests.faults.rogue import RogueDecode, fetch_instance

BOOTSTRAP_S = 1.5
KEY = "room_failed:bootstrap_timeout"
FRONT = "prefill-0"


@pytest.fixture(scope="module")
def dp2tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    spec = base_spec(bootstrapTimeoutSeconds=BOOTSTRAP_S)
    spec["prefill"]["topology"] = {"dp": 2, "tp": 2, "cp": 1, "pp": 1}  # type: ignore[index]
    tmp: Path = tmp_path_factory.mktemp("dp2tp2")
    with FaultCluster(tmp, "faults-dp2tp2", spec) as cluster:
        yield cluster


def failures(pd: FaultCluster) -> dict[str, Any]:
    resp = pd.admin(FRONT, "GET", "/admin/failures")
    resp.raise_for_status()
    body: dict[str, Any] = resp.json()
    return body


def rank_count(body: dict[str, Any], coord: RankCoord) -> int:
    count: int = body["ranks"].get(str(coord), {}).get(KEY, 0)
    return count


def test_every_rank_of_every_dp_group_reports(dp2tp2: FaultCluster) -> None:
    body = failures(dp2tp2)
    ranks = {str(RankCoord(dp=d, tp=t)) for d in (0, 1) for t in (0, 1)}
    assert set(body["ranks"]) == ranks
    assert body["missing"] == []
    info = dp2tp2.info(FRONT)
    assert set(info["pd_stats_by_rank"]) == ranks and info["pd_stats_missing"] == []


@pytest.mark.parametrize("coord", [RankCoord(dp=0, tp=1), RankCoord(dp=1, tp=1)])
def test_a_failure_only_a_follower_rank_sees_is_counted_at_the_front(
    dp2tp2: FaultCluster, coord: RankCoord
) -> None:
    """Metadata for a room whose leg never comes reaches one follower only: it alone fails it."""
    pd = dp2tp2
    instance = fetch_instance(pd.bootstrap(FRONT), pd.token)
    endpoint = next(r.endpoint for r in instance.ranks if r.rank == coord)
    before = failures(pd)
    stats_before = pd.stats(FRONT).get(KEY, 0)
    rogue = RogueDecode(pd.token, instance.compat)
    try:
        ack = rogue.register(endpoint)
        assert ack.accepted, ack.reason
        room = mint_room()
        rogue.meta(endpoint, room, mint_rid(), [0, 1])
        _, status = rogue.expect(pdmsg.Status, room, timeout=BOOTSTRAP_S + 5)
        assert status.state is KVPoll.Failed and status.room == room
    finally:
        rogue.close()

    def counted() -> dict[str, Any] | None:
        body = failures(pd)
        return body if body["failures"].get(KEY, 0) == before["failures"].get(KEY, 0) + 1 else None

    after = wait_until(counted, 5, 0.05, "the follower's failure at the front")
    assert rank_count(after, coord) == rank_count(before, coord) + 1
    for other in {RankCoord(dp=d, tp=t) for d in (0, 1) for t in (0, 1)} - {coord}:
        assert rank_count(after, other) == rank_count(before, other)
    assert pd.stats(FRONT).get(KEY, 0) == stats_before + 1


def test_a_room_of_dp_group_1_counts_once_though_both_its_ranks_fail_it(
    dp2tp2: FaultCluster,
) -> None:
    """A prefill leg whose decode never comes, routed to dp group 1 (odd room)."""
    pd = dp2tp2
    before = failures(pd)
    room = mint_room() // 2 * 2 + 1
    body = gen_body([5] * 20, 4, room=room, bootstrap=pd.bootstrap(FRONT))
    res = post_leg(pd.url(FRONT), body, 30.0)
    assert res.status == 502 and "bootstrap_timeout" in res.error, res

    def counted() -> dict[str, Any] | None:
        got = failures(pd)
        leaders = [RankCoord(dp=1, tp=t) for t in (0, 1)]
        grown = all(rank_count(got, c) == rank_count(before, c) + 1 for c in leaders)
        return got if grown else None

    after = wait_until(counted, 5, 0.05, "both ranks of dp group 1 to report")
    # Two ranks failed it; it is one room.
    assert after["failures"][KEY] == before["failures"].get(KEY, 0) + 1
    for coord in (RankCoord(dp=0, tp=0), RankCoord(dp=0, tp=1)):
        assert rank_count(after, coord) == rank_count(before, coord)
