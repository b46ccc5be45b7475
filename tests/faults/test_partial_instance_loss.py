"""One pod of a two-pod prefill instance is lost while decode holds a room of it.

A real decode rank (`DecodeRig`, one-sided transport) resolves a room against
a prefill instance of two ranks on two "pods" (endpoints on 127.0.0.1 and
127.0.0.3), as the operator reports a lost pod 1: the instance failing, not
gone (its leader's rank may still write), and pod 1's own ranks gone. The
room fails at once and ABORTs its sources; its pages stay until the
surviving writer acknowledges, however the reports are ordered.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.bootstrap_registry import InstanceInfo, RankAddress
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd_worker.group import GroupFailPeer, GroupOpen, GroupPages
from pdcluster.runtime.transfer.endpoint import Endpoint, EndpointConfig
from tests.faults.decode_rig import PAGE_SIZE, PREFILL_PEER, TOKEN, DecodeRig, _compat

LEADER_UID, POD1_UID = "uid-prefill-0", "uid-prefill-1"
POD1_HOST = "127.0.0.3"
RANK0, RANK1 = RankCoord(tp=0), RankCoord(tp=1)


@pytest.fixture
def rig() -> Iterator[tuple[DecodeRig, Endpoint]]:
    opened = DecodeRig(backend="shm")
    pod1 = Endpoint(
        EndpointConfig(host=POD1_HOST, advertise_host=POD1_HOST, token=TOKEN),
        on_control=opened._on_prefill_control,
    )
    pod1.start()
    opened.agent.bootstrap.get(PREFILL_PEER)._instance = InstanceInfo(
        shape=InstanceShape(tp=2),
        compat=_compat(),
        ranks=[
            RankAddress(rank=RANK0, endpoint=opened.prefill.address, incarnation=LEADER_UID),
            RankAddress(rank=RANK1, endpoint=pod1.address, incarnation=POD1_UID),
        ],
    )
    yield opened, pod1
    pod1.close()
    opened.close()


@pytest.mark.parametrize("pod_report_first", [False, True])
def test_pages_wait_for_the_surviving_writer_not_for_the_lost_pods(
    rig: tuple[DecodeRig, Endpoint], pod_report_first: bool
) -> None:
    decode, pod1 = rig
    room, pages = 6101, [1, 2]
    decode.group(GroupOpen(room=room, rid="rid-p", num_tokens=2 * PAGE_SIZE, peer=PREFILL_PEER))
    decode.group(GroupPages(room=room, pages=pages))
    meta = decode.wait_message(pdmsg.TransferMeta, room)
    instance = GroupFailPeer(PREFILL_PEER, "prefill_pod_lost", gone=False, incarnation=LEADER_UID)
    own = GroupFailPeer(POD1_HOST, "prefill_pod_lost", gone=True, incarnation=POD1_UID)
    for msg in (own, instance) if pod_report_first else (instance, own):
        decode.group(msg)
    decode.wait_report(room, "failed")
    decode.wait_message(pdmsg.Abort, room)
    # Pod 1's ranks are gone; the leader's may still write into the pages.
    assert decode.poll_report(room, "released", timeout=1.0) is None
    (view,) = [v for v in decode.agent.room_views(0.0) if v["room"] == room]
    assert "unsettled=1" in view["detail"], view
    assert decode.agent.counts()["abort_sent"] >= 1
    # The leader drains and acknowledges: now they may go to another room.
    ack = pdmsg.AbortAck(room=room, rank=RANK0, generation=meta.generation)
    decode.prefill.send_control(decode.agent.address, pdmsg.encode(ack))
    decode.wait_report(room, "released")
