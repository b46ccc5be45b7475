"""A Status or ABORT_ACK counts only from the connection of the source it names.

A peer holding the cluster token proves its own endpoint, not another's
(docs/security.md, "ZMQ identity"). Decode used to match a room's Status and
AbortAck by the `rank` field alone, so such a peer could conclude a room with
its own first token (the prompt's KV never arrived) or release a failed
room's pages while the real source was still writing into them. The decode
rank, its endpoint and the sockets are real; the source and the insider are
two plain endpoints keyed by the same token.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd_worker.group import GroupFail
from pdcluster.runtime.transfer.endpoint import Endpoint, EndpointConfig
from tests.faults.decode_rig import PAGE_SIZE, RANK, TOKEN, DecodeRig

FORGED_TOKEN = 17
REAL_TOKEN = 5


@pytest.fixture
def rig() -> Iterator[DecodeRig]:
    opened = DecodeRig()
    yield opened
    opened.close()


@pytest.fixture
def insider() -> Iterator[Endpoint]:
    """A peer with the cluster token that is not the room's source."""
    ep = Endpoint(
        EndpointConfig(host="127.0.0.1", advertise_host="127.0.0.1", token=TOKEN),
        on_control=lambda sender, data: None,
    )
    ep.start()
    yield ep
    ep.close()


def test_a_status_from_another_connection_does_not_conclude_the_room(
    rig: DecodeRig, insider: Endpoint
) -> None:
    room, pages = 5201, [2, 6]
    meta = rig.open_room(room, "rid-forged-status", pages, num_tokens=2 * PAGE_SIZE)
    forged = pdmsg.Status(
        room=room,
        generation=meta.generation,
        rank=RANK,
        state=KVPoll.Success,
        first_token=FORGED_TOKEN,
    )
    insider.send_control(rig.agent.address, pdmsg.encode(forged))
    assert rig.poll_report(room, "complete", timeout=0.5) is None
    assert rig.agent.counts().get("dropped:wrong_sender", 0) == 1
    # The real source's KV and Success still conclude the room, with its token.
    rig.send_frame(meta, 0, 2 * PAGE_SIZE, 3.0)
    rig.send_status(meta, KVPoll.Success, first_token=REAL_TOKEN)
    _, report = rig.wait_report(room, "complete")
    assert report.first_token == REAL_TOKEN
    for page in pages:
        assert bool((rig.page_bytes(page).view(torch.float32) == 3.0).all())


def test_an_abort_ack_from_another_connection_releases_no_page(
    rig: DecodeRig, insider: Endpoint
) -> None:
    room, pages = 5202, [4, 8]
    meta = rig.open_room(room, "rid-forged-ack", pages, num_tokens=2 * PAGE_SIZE)
    rig.group(GroupFail(room=room, reason="client_disconnected"))
    rig.wait_report(room, "failed")
    rig.wait_message(pdmsg.Abort, room)
    forged = pdmsg.AbortAck(room=room, rank=RANK, generation=meta.generation)
    insider.send_control(rig.agent.address, pdmsg.encode(forged))
    # The real source may still be writing: its pages stay with the room.
    assert rig.poll_report(room, "released", timeout=0.5) is None
    assert rig.agent.counts().get("dropped:wrong_sender", 0) == 1
    rig.send_ack(room, meta.generation)
    rig.wait_report(room, "released")
