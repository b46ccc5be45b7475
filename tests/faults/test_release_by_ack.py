"""A failed room's pages come back by its writer's ABORT_ACK, not by the release timer.

With tcp, decode frees a failed room's pages either when every prefill rank
it notified acknowledged the ABORT of the room's current generation, or when
`abortReleaseTimeoutSeconds` passed. The release timer here is 60 s, so a
release within a tenth of it can only be the ack's doing, however loaded the
machine; a stale ack (an older generation) releases nothing.

The cluster-level abort tests (test_cancellation.py, test_nixl_faults.py)
check the same exchange through a real worker but leave which path released
the pages to this test: their release timer is short, so any bound on the
ack's latency there would be a wall-clock race with the timer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd_worker.group import GroupFail
from tests.faults.decode_rig import PAGE_SIZE, DecodeRig

RELEASE_S = 60.0
ACK_BOUND_S = RELEASE_S / 10


@pytest.fixture
def rig() -> Iterator[DecodeRig]:
    opened = DecodeRig(abortReleaseTimeoutSeconds=RELEASE_S)
    yield opened
    opened.close()


def test_the_current_ack_releases_a_failed_room_and_a_stale_one_does_not(rig: DecodeRig) -> None:
    room = 4201
    meta = rig.open_room(room, "rid-acked", [2, 5], num_tokens=2 * PAGE_SIZE)
    rig.group(GroupFail(room=room, reason="client_disconnected"))
    rig.wait_report(room, "failed")
    abort: pdmsg.Abort = rig.wait_message(pdmsg.Abort, room)
    assert (abort.generation, abort.rid) == (meta.generation, meta.rid)

    stale_before = rig.agent.counts().get("dropped:stale_generation", 0)
    rig.send_ack(room, meta.generation - 1)
    wait_for_count(rig, "dropped:stale_generation", stale_before + 1)
    assert not rig.has_report(room, "released"), "a stale ack released the pages"

    rig.send_ack(room, meta.generation)
    rig.wait_report(room, "released", timeout=ACK_BOUND_S)


def wait_for_count(rig: DecodeRig, key: str, want: int) -> None:
    deadline = time.monotonic() + ACK_BOUND_S
    while rig.agent.counts().get(key, 0) < want:
        assert time.monotonic() < deadline, f"{key} never reached {want}: {rig.agent.counts()}"
        time.sleep(0.01)
