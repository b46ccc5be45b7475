"""No write lands on a page reported released (docs/design.md §14: a page is never
reused while a peer may still write it).

A frame already past the receiver's resolve is still being scattered when
its room fails. The agent stops resolving the room at once, but the pages
may go back to the leader (`released`) only once that write returned: the
next owner of a page must never find the failed room's late bytes in it.
The scatter is held mid-frame by a test double around the real one; the
decode agent, its receiver and the sockets are real.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd_worker.group import GroupFail, GroupFailPeer, GroupMessage
from pdcluster.runtime.transfer import tcp
from tests.faults.decode_rig import PAGE_SIZE, PREFILL_PEER, RANK, DecodeRig

LATE = 7.0  # the failed room's frame: every float of it is 7.0
POISON = 0x5A  # the next owner's bytes


@pytest.fixture
def held_scatter(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldScatter]:
    held = HeldScatter(tcp.scatter_bytes)
    monkeypatch.setattr(tcp, "scatter_bytes", held)
    yield held
    held.finish.set()


class HeldScatter:
    """The real scatter, held after it was entered until `finish` is set."""

    def __init__(self, real: Callable[..., None]) -> None:
        self.real = real
        self.entered, self.finish, self.returned = (threading.Event() for _ in range(3))
        self.returned_at = 0.0

    def __call__(self, *args: Any) -> None:
        self.entered.set()
        self.finish.wait(10)
        self.real(*args)
        self.returned_at = time.monotonic()
        self.returned.set()


@pytest.fixture
def rig() -> Iterator[DecodeRig]:
    # A failed room's pages wait for the ack or this release timeout (tcp).
    opened = DecodeRig(abortReleaseTimeoutSeconds=0.3)
    yield opened
    opened.close()


@pytest.mark.parametrize(
    "fail",
    [
        pytest.param(
            lambda room: GroupFailPeer(peer=PREFILL_PEER, reason="prefill_pod_lost"),
            id="fail_peer_gone",
        ),
        pytest.param(
            lambda room: GroupFailPeer(peer=PREFILL_PEER, reason="prefill_pod_lost", gone=False),
            id="fail_peer_not_ready",
        ),
        pytest.param(
            lambda room: GroupFail(room=room, reason="client_disconnected"),
            id="abort_release_timeout",
        ),
    ],
)
def test_released_waits_for_the_write_in_flight(
    rig: DecodeRig, held_scatter: HeldScatter, fail: Callable[[int], GroupMessage]
) -> None:
    room, pages = 4101, [3, 9]
    meta = rig.open_room(room, "rid-late", pages, num_tokens=2 * PAGE_SIZE)
    rig.send_frame(meta, 0, 2 * PAGE_SIZE, LATE)
    assert held_scatter.entered.wait(5), "the frame never reached the scatter"
    rig.group(fail(room))
    rig.wait_report(room, "failed")
    # The next owner of the pages writes them as soon as they are released.
    early = rig.poll_report(room, "released", timeout=0.5)
    if early is not None:
        for page in pages:
            rig.fill_page(page, POISON)
    held_scatter.finish.set()
    assert held_scatter.returned.wait(5)
    released_at = rig.wait_report(room, "released")[0]
    if early is None:
        for page in pages:
            rig.fill_page(page, POISON)
    want = zlib.crc32(bytes([POISON]) * rig.page_bytes(pages[0]).numel())
    got = {page: zlib.crc32(rig.page_bytes(page).numpy().tobytes()) for page in pages}
    # A late byte of the failed room in a released page: silent corruption.
    assert got == dict.fromkeys(pages, want)
    assert released_at >= held_scatter.returned_at
    assert rig.agent.counts()["release_fenced"] == 1


class HeldSecondScatter(HeldScatter):
    """Lets the first scatter through; holds the second until `finish` is set."""

    def __init__(self, real: Callable[..., None]) -> None:
        super().__init__(real)
        self.calls = 0

    def __call__(self, *args: Any) -> None:
        self.calls += 1
        if self.calls == 1:
            self.real(*args)
            return
        super().__call__(*args)


def test_complete_waits_for_a_frame_still_landing_in_the_rooms_pages(
    rig: DecodeRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every source said Success, yet a frame of the room (one its source sent
    after the Success) is still being scattered: nothing is concluded before it
    returned, and then the byte count sees the extra frame and fails the room
    rather than hand the engine pages that a late write changed."""
    held = HeldSecondScatter(tcp.scatter_bytes)
    monkeypatch.setattr(tcp, "scatter_bytes", held)
    room, pages = 4102, [5, 12]
    meta = rig.open_room(room, "rid-landing", pages, num_tokens=2 * PAGE_SIZE)
    rig.send_frame(meta, 0, 2 * PAGE_SIZE, 1.0)
    rig.send_frame(meta, 0, PAGE_SIZE, LATE)
    try:
        assert held.entered.wait(5), "the second frame never reached the scatter"
        # The Success was read before that frame and waited for the agent
        # (handed to its thread, not run on the I/O thread that scatters).
        success = pdmsg.Status(
            room=room, generation=meta.generation, rank=RANK, state=KVPoll.Success, first_token=1
        )
        sender = rig.prefill.address
        rig.agent.post(lambda: rig.agent.on_message(success, time.monotonic(), sender))
        assert rig.poll_report(room, "complete", timeout=0.5) is None
        assert not rig.has_report(room, "failed")
    finally:
        held.finish.set()
    assert held.returned.wait(5)
    failed_at, failed = rig.wait_report(room, "failed")
    assert failed_at >= held.returned_at
    assert failed.reason == "incomplete_transfer: received 3072 of 2048 KV bytes"
    assert not rig.has_report(room, "complete")
    assert rig.agent.counts()["complete_fenced"] == 1
    rig.wait_report(room, "released")
