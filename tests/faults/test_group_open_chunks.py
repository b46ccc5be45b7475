"""A follower prefill rank opens a long prompt's room from its leader's frames.

A real `PrefillAgent` follower (its endpoint, loop and room table) takes
group frames from a plain endpoint that plays its leader, over real sockets.
The opening of a 64k-page room (page size 1) used to be one 1.2 MB frame that
the follower dropped as oversized; it now arrives as the open and its key
chunks, and the follower opens the room with every key and says `start`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.prefix_reuse import reuse_keys
from pdcluster.runtime.pd.prompt_digest import prompt_id
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd_worker.agent import AgentContext
from pdcluster.runtime.pd_worker.group import (
    MAX_GROUP_BYTES,
    PAGE_KEYS_PER_MESSAGE,
    GroupOpen,
    GroupReport,
    decode_group,
    encode_group,
    is_group_frame,
    wire_messages,
)
from pdcluster.runtime.pd_worker.prefill_agent import PrefillAgent
from pdcluster.runtime.spec import TransferSpec
from pdcluster.runtime.transfer.endpoint import Endpoint, EndpointConfig

TOKEN = "group-token"
PAGE_SIZE = 1
NUM_TOKENS = 64_001  # 64k full pages and the last token


class Leader:
    """The group leader's endpoint: sends group frames, keeps the reports."""

    def __init__(self) -> None:
        self.reports: list[GroupReport] = []
        self._cond = threading.Condition()
        self.endpoint = Endpoint(
            EndpointConfig(host="127.0.0.1", advertise_host="127.0.0.1", token=TOKEN),
            on_control=self._on_control,
        )
        self.endpoint.start()

    def _on_control(self, sender: str, data: bytes) -> None:
        if is_group_frame(data):
            msg = decode_group(data)
            if isinstance(msg, GroupReport):
                with self._cond:
                    self.reports.append(msg)
                    self._cond.notify_all()

    def wait_report(self, room: int, kind: str, timeout: float = 10.0) -> GroupReport | None:
        def find() -> GroupReport | None:
            return next((r for r in self.reports if r.room == room and r.kind == kind), None)

        with self._cond:
            return self._cond.wait_for(find, timeout)


@pytest.fixture
def group() -> Iterator[tuple[Leader, PrefillAgent]]:
    spec = TransferSpec.model_validate({})
    compat = CompatInfo(
        page_size=PAGE_SIZE,
        kv_dtype="float32",
        kv_layout="NHD",
        allocation_policy="early",
        model_fingerprint="group",
    )
    ctx = AgentContext(
        role="prefill",
        cluster="group",
        instance=0,
        coord=RankCoord(tp=1),
        group_rank=1,
        group_size=2,
        shape=InstanceShape(tp=2),
        compat=compat,
        token=TOKEN,
        room_settings=RoomSettings.from_spec(spec),
        transfer=spec,
        layers=(0, 1),
        heads=(1, 2),
        num_layers=1,
        num_kv_heads=2,
        head_dim=4,
        page_size=PAGE_SIZE,
        num_pages=8,
        host="127.0.0.1",
        advertise_host="127.0.0.1",
        bootstrap_address="",
    )
    leader = Leader()
    follower = PrefillAgent(ctx, KVPool(KVPoolShape(1, 8, PAGE_SIZE, 1, 4)), is_leader=False)
    follower.leader_address = leader.endpoint.address
    follower.start()
    try:
        yield leader, follower
    finally:
        follower.close()
        follower.aio.loop.close()
        leader.endpoint.close()


def test_a_follower_opens_a_64k_page_room_with_every_key(
    group: tuple[Leader, PrefillAgent],
) -> None:
    leader, follower = group
    prompt = [1 + i % 997 for i in range(NUM_TOKENS)]
    keys = reuse_keys(prompt, PAGE_SIZE)
    opening = GroupOpen(31, "rid-31", NUM_TOKENS, prompt=prompt_id(prompt), page_keys=keys)
    frames = [encode_group(m) for m in wire_messages(opening)]
    assert len(frames) > 1 and all(len(f) <= MAX_GROUP_BYTES for f in frames)
    for frame in frames:
        leader.endpoint.send_control(follower.address, frame)
    started = leader.wait_report(31, "start")
    assert started is not None, (leader.reports, follower.counts())
    with follower.lock:
        assert follower.table._rooms[31].page_keys == tuple(keys)
    assert follower.openings.num_pending == 0


def test_a_chunk_lost_in_between_fails_the_room_on_the_follower(
    group: tuple[Leader, PrefillAgent],
) -> None:
    leader, follower = group
    prompt = [1 + i % 997 for i in range(3 * PAGE_KEYS_PER_MESSAGE + 1)]
    opening = GroupOpen(
        32, "rid-32", len(prompt), prompt=prompt_id(prompt), page_keys=reuse_keys(prompt, 1)
    )
    head, first, *rest = wire_messages(opening)
    assert rest
    for msg in (head, *rest):  # the first chunk never arrives
        leader.endpoint.send_control(follower.address, encode_group(msg))
    failed = leader.wait_report(32, "failed")
    assert failed is not None and failed.reason == "rejected: page_keys_out_of_order"
    deadline = time.monotonic() + 5
    while follower.counts().get("group_reject:page_keys_out_of_order", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert leader.wait_report(32, "start", timeout=0.3) is None
