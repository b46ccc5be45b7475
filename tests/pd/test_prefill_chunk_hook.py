"""The prefill agent's chunk hook runs on the engine thread: one room's error fails that room.

A destination that cannot be written (an shm pool that vanished, a transport
error) used to raise out of the hook, through the engine's step, and end the
step's other requests with it — or the engine thread. The hook now fails the
room with the reason and returns.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.prefill_rooms import PrefillRankInfo, PrefillRoomTable
from pdcluster.runtime.pd.room_common import RoomLeg
from pdcluster.runtime.pd_worker.prefill_agent import PrefillAgent

from .sim import compat


def _agent_with(table: PrefillRoomTable, room: int, rid: str, error: Exception) -> Any:
    performed: list[Any] = []

    def broken(*_: Any) -> None:
        raise error

    fake = SimpleNamespace(
        lock=threading.RLock(),
        rid_room={rid: room},
        table=table,
        ctx=SimpleNamespace(coord=RankCoord()),
        _on_chunk=broken,
        perform=performed.extend,
        performed=performed,
    )
    return fake


def test_a_chunk_that_cannot_be_sent_fails_its_room_and_does_not_raise() -> None:
    table = PrefillRoomTable(PrefillRankInfo(RankCoord(), "tcp://127.0.0.1:7000", compat(), "t"))
    table.open_room(RoomLeg(11, "req-a", 32), 0.0)
    agent = _agent_with(table, 11, "req-a", ValueError("decode offers no shared-memory pool"))
    PrefillAgent.on_chunk(agent, "req-a", [0, 1], 0, 16)  # must not raise into the step
    failed = [a for a in agent.performed if isinstance(a, A.RoomFailed)]
    assert [f.room for f in failed] == [11]
    assert failed[0].reason == "transfer_failed: ValueError: decode offers no shared-memory pool"
    # The room concluded (a tombstone answers late messages for it).
    assert 11 not in table and table.tombstone(11, now=1.0) is not None


def test_a_chunk_of_an_unknown_rid_is_ignored() -> None:
    table = PrefillRoomTable(PrefillRankInfo(RankCoord(), "tcp://127.0.0.1:7000", compat(), "t"))
    agent = _agent_with(table, 11, "req-a", ValueError("never called"))
    PrefillAgent.on_chunk(agent, "other", [0], 0, 4)
    assert agent.performed == []
