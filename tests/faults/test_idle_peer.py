"""A prefill instance no room uses any more stops being probed (loopback).

Real decode agent and sockets: once its last room is released and
`heartbeat.idleSeconds` passed, the prefill leaves the heartbeat set and its
bootstrap client is dropped; the next room on it brings both back.
"""

from __future__ import annotations

import time

from pdcluster.runtime.pd.kvpoll import KVPoll
from tests.faults.decode_rig import PAGE_SIZE, PREFILL_PEER, DecodeRig
from tests.faults.harness import wait_until

IDLE_S = 0.5


def watched(rig: DecodeRig) -> tuple[bool, bool]:
    """(probed, has a bootstrap client), read under the agent's lock."""
    with rig.agent.lock:
        return PREFILL_PEER in rig.agent.liveness.peers(), PREFILL_PEER in rig.agent.bootstrap


def test_an_idle_prefill_leaves_the_heartbeat_and_comes_back_with_a_room() -> None:
    # Probes of the rig's prefill fail (nothing answers /health there); the
    # threshold keeps it from being declared dead meanwhile.
    rig = DecodeRig(
        heartbeat={"intervalSeconds": 0.2, "failureThreshold": 100, "idleSeconds": IDLE_S}
    )
    try:
        meta = rig.open_room(6101, "rid-idle-1", [1], num_tokens=PAGE_SIZE)
        assert watched(rig) == (True, True)
        time.sleep(2 * IDLE_S)  # a live room keeps its prefill watched however long it takes
        assert watched(rig) == (True, True)
        rig.send_frame(meta, 0, PAGE_SIZE, 1.0)
        rig.send_status(meta, KVPoll.Success, first_token=1)
        released_at = rig.wait_report(6101, "released")[0]
        wait_until(lambda: watched(rig) == (False, False), 5.0, what="idle prefill dropped")
        # The idle clock starts at the last tick (50 ms apart) that saw the room.
        assert time.monotonic() - released_at >= IDLE_S - 0.1
        assert rig.agent.counts()["peer_idle_dropped"] == 1
        # The next room on it: watched again, with a fresh client (no cached
        # /route: it is fetched anew, and nothing answers here, so the room fails).
        rig.open_room_only(6102, "rid-idle-2", num_tokens=PAGE_SIZE)
        wait_until(lambda: watched(rig) == (True, True), 5.0, what="prefill watched again")
        _, rep = rig.wait_report(6102, "failed", timeout=15.0)
        assert rep.reason is not None and rep.reason.startswith("bootstrap_unreachable")
        rig.wait_report(6102, "released")
    finally:
        rig.close()
