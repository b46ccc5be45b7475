"""A peer dies or hangs in the middle of transfers (scenarios 1, 2 and 3).

The victims are prefill-1 (killed with SIGKILL, or hung with SIGSTOP) and
decode-1 (killed); prefill-0 and decode-0 serve the survivors at the same
time. Each test asserts docs/design.md §14: the decode rooms tied to a lost prefill
fail within `interval × threshold + probe timeout` (heartbeat) or at once
(the operator's admin fast path), each with the load slack of
`harness.fast_bound`, every client gets a readable error instead of
hanging, survivors' outputs equal colocated output, the failures are
counted, and every surviving worker returns all its pages.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.conftest import make_ready
from tests.faults.harness import (
    PAGE,
    FaultCluster,
    PDClient,
    PDResult,
    check_survivors,
    fast_bound,
    heartbeat_bound,
    live,
    make_prompts,
    probe_timeout_s,
    start_traffic,
    tied_rooms,
    wait_mid_transfer,
    wait_until,
)
from tests.faults.rogue import Background
from tests.pd_integration.reference import colocated_outputs

MAX_TOKENS = 4
UNREACHABLE = ("prefill_unreachable", "bootstrap_unreachable")


def victims_on_prefill_1(
    pd: FaultCluster, client: PDClient, victims: list[list[int]], survivors: list[list[int]]
) -> Background:
    """Victims prefill-1 → decode-0 (left to the workers' own detection), survivors
    prefill-0 → both decodes; returns once prefill-1 is mid-transfer to decode-0."""
    traffic = start_traffic(
        pd,
        client,
        [("prefill-1", "decode-0", p) for p in victims],
        [("prefill-0", f"decode-{i % 2}", p) for i, p in enumerate(survivors)],
        propagate=False,
    )
    wait_mid_transfer(pd, "decode-0", "prefill-1")
    return traffic


def prefill_1_rooms_failed(pd: FaultCluster, since: float, what: str) -> float:
    """Seconds from `since` until decode-0 holds no live room of prefill-1 (waits a
    few seconds past the heartbeat bound, so a late verdict is measured)."""
    wait_until(
        lambda: not live(tied_rooms(pd, "decode-0", "prefill-1")),
        heartbeat_bound(pd) + 5,
        0.01,
        what,
    )
    return time.monotonic() - since


def test_hung_prefill_fails_rooms_by_heartbeat_then_serves_again(
    pd: FaultCluster, client: PDClient
) -> None:
    victims = make_prompts(6, seed=21, lo=2500, hi=4000)
    survivors = make_prompts(4, seed=22, lo=1, hi=300)
    expected = colocated_outputs(pd.manifest, survivors, MAX_TOKENS)
    failed_before = pd.failures("decode-0").get("prefill_unreachable", 0)
    traffic = victims_on_prefill_1(pd, client, victims, survivors)

    hung_at = time.monotonic()
    pd.hang("prefill-1")
    detected = prefill_1_rooms_failed(pd, hung_at, "rooms of the hung prefill to fail")
    assert detected <= heartbeat_bound(pd), f"rooms failed {detected:.2f}s after the hang"
    # The same process answers again: the next probe revives it, and a new
    # request through it works (not only after the dead-peer memory expires).
    pd.cont("prefill-1")
    transfer = pd.manifest.spec.transfer
    next_probe = fast_bound(
        transfer.heartbeat.interval_seconds + probe_timeout_s(pd), 30.0, "the next probe"
    )
    pd.wait_seen_answering(["prefill-1"], timeout=next_probe)
    # The resumed prefill still holds the victims' rooms (decode dropped its
    # connection with them, so no ABORT reached it) and computes their prompts
    # until its own timeouts end them; a room sent meanwhile queues behind
    # them and, on a loaded box, past decode's waiting timeout. Wait them out.
    wait_until(
        lambda: not live(pd.rooms("prefill-1")),
        transfer.bootstrap_timeout_seconds + transfer.waiting_timeout_seconds + 10,
        0.1,
        "the resumed prefill-1 to end the rooms decode failed",
    )
    again = client.pair(pd, "prefill-1", "decode-0", survivors[0], MAX_TOKENS)
    assert again.decode.ok, again.decode.error
    assert again.decode.output_ids == expected[0]

    # The lost rooms' clients had their answer while the prefill was still stopped.
    results: list[PDResult] = traffic.result()
    lost = results[: len(victims)]
    for res in lost:
        if res.decode.ok:  # finished before the hang
            continue
        assert res.decode.status == 502, res.decode
        assert "prefill_unreachable" in res.decode.error
        assert res.decode.ended_at - hung_at <= heartbeat_bound(pd)
    check_survivors(results[len(victims) :], expected)
    num_lost = sum(1 for r in lost if not r.decode.ok)
    assert num_lost >= 1
    failed = pd.failures("decode-0").get("prefill_unreachable", 0) - failed_before
    assert failed == num_lost
    pd.assert_clean()


def test_admin_fast_path_fails_rooms_at_once(pd: FaultCluster, client: PDClient) -> None:
    """The operator reports prefill-1's pod lost: decode fails its rooms now, not at a probe.

    prefill-1 keeps running (as a pod that turned NotReady may), so no
    heartbeat verdict can race the fast path: every lost room carries the
    operator's reason.
    """
    victims = make_prompts(6, seed=31, lo=2500, hi=4000)
    survivors = make_prompts(3, seed=32, lo=1, hi=300)
    expected = colocated_outputs(pd.manifest, survivors, MAX_TOKENS)
    traffic = start_traffic(
        pd,
        client,
        [("prefill-1", "decode-0", p) for p in victims],
        [("prefill-0", "decode-0", p) for p in survivors],
    )
    wait_mid_transfer(pd, "decode-0", "prefill-1")

    lost_rooms = {r["room"] for r in live(tied_rooms(pd, "decode-0", "prefill-1"))}
    # At once: long before the rooms' waiting timeout (the heartbeat cannot fire).
    transfer = pd.manifest.spec.transfer
    bound = fast_bound(0.0, transfer.waiting_timeout_seconds, "the fast path")
    t0 = time.monotonic()
    # NotReady (`gone: false`): the same process may answer again and be used.
    resp = pd.fail_peer("decode-0", pd.peer("prefill-1"), "prefill_pod_lost", gone=False)
    assert resp.status_code == 200, resp.text

    def all_failed() -> bool:
        # Rooms opened after the report may use the peer again (it answers /route).
        return not {r["room"] for r in live(tied_rooms(pd, "decode-0", "prefill-1"))} & lost_rooms

    wait_until(all_failed, bound + 5, 0.005, "fast path")
    took = time.monotonic() - t0
    assert took < bound, f"fast path took {took:.3f}s"
    results: list[PDResult] = traffic.result()
    # (A room may have finished in the instant between the snapshot and the report.)
    lost = [r for r in results[: len(victims)] if r.room in lost_rooms and not r.decode.ok]
    assert lost
    for res in lost:
        assert "prefill_pod_lost" in res.decode.error, res.decode
        assert res.decode.ended_at - t0 < bound
    check_survivors(results[len(victims) :], expected)
    assert pd.stats("decode-0").get("room_failed:prefill_pod_lost", 0) >= len(lost)
    failures = pd.admin("decode-0", "GET", "/admin/failures").json()["failures"]
    assert failures.get("room_failed:prefill_pod_lost", 0) >= len(lost)

    # The next probe finds the peer answering: new rooms may use it again.
    next_probe = fast_bound(
        transfer.heartbeat.interval_seconds + probe_timeout_s(pd),
        transfer.bootstrap_timeout_seconds,  # how long the report alone refuses rooms
        "the next probe",
    )
    pd.wait_seen_answering(["prefill-1"], timeout=next_probe)
    again = client.pair(pd, "prefill-1", "decode-0", survivors[0], MAX_TOKENS)
    assert again.decode.ok, again.decode.error
    # prefill-1 finished (or timed out) what it was sending into the void.
    pd.assert_clean(
        timeout=transfer.waiting_timeout_seconds + transfer.abort_release_timeout_seconds
    )


@pytest.mark.slow
def test_kill9_prefill_mid_transfer(pd: FaultCluster, client: PDClient) -> None:
    """kill -9 a prefill mid-transfer: its rooms fail by heartbeat, later ones at once.

    Rooms open at the kill fail within the heartbeat bound. Once decode's
    heartbeat declared the prefill dead, a new room for it waits for one
    probe (the prefill may be back), which fails: the room fails within the
    probe timeout with the verdict's reason (`prefill_unreachable`) — no
    /route fetch and retries against the dead server (`bootstrap_unreachable`,
    seconds later).
    """
    # Victims and two survivors share a prefix decode-0 holds (decode-side
    # reuse): the victims' failed rooms must free none of the pages the
    # survivors read.
    shared = make_prompts(1, seed=40, lo=6 * PAGE, hi=6 * PAGE)[0]
    victims = [shared + p for p in make_prompts(8, seed=41, lo=2500, hi=4000)]
    plain = make_prompts(6, seed=42, lo=1, hi=600)
    survivors = [shared + p for p in plain[:2]] + plain[2:]
    expected = colocated_outputs(pd.manifest, survivors, MAX_TOKENS)
    assert client.pair(pd, "prefill-0", "decode-0", shared + [1, 2, 3], MAX_TOKENS).decode.ok
    before = pd.failures("decode-0")
    failed_before = sum(before.get(r, 0) for r in UNREACHABLE)
    dead_before = pd.stats("decode-0").get("peer_dead", 0)
    held_before = pd.stats("decode-0").get("room_held_for_probe", 0)
    traffic = victims_on_prefill_1(pd, client, victims, survivors)

    killed_at = time.monotonic()
    pd.kill("prefill-1")
    open_at_kill = {r["room"] for r in live(tied_rooms(pd, "decode-0", "prefill-1"))}
    assert open_at_kill, "no room of the victim left at the kill"
    detected = prefill_1_rooms_failed(pd, killed_at, "rooms of the killed prefill to fail")
    assert detected <= heartbeat_bound(pd), f"rooms failed {detected:.2f}s after kill -9"
    wait_until(
        lambda: pd.stats("decode-0").get("peer_dead", 0) > dead_before,
        heartbeat_bound(pd),
        0.01,
        "the heartbeat verdict",
    )
    # (Peers of earlier scenarios, long gone, may be listed too.)
    assert pd.info("decode-0")["peers_down"].get(pd.peer("prefill-1")) == "prefill_unreachable"

    # After the verdict: new rooms for the dead prefill wait for one probe, then fail
    # with the verdict's reason (a /route fetch and its retries against the dead
    # server would fail as `bootstrap_unreachable`). Fast means within one probe
    # timeout (plus the load slack), not at the bootstrap timeout.
    transfer = pd.manifest.spec.transfer
    bound = fast_bound(probe_timeout_s(pd), transfer.bootstrap_timeout_seconds, "a held room")
    late = client.many(
        [
            lambda p=p: client.pair(
                pd,
                "prefill-1",
                "decode-0",
                p,
                MAX_TOKENS,
                propagate=False,
                timeout=transfer.bootstrap_timeout_seconds + 30,
            )
            for p in plain[:3]
        ]
    )
    for res in late:
        assert res.decode.status == 502, res.decode
        assert "prefill_unreachable" in res.decode.error, res.decode.error
        assert res.decode.elapsed < bound, (
            f"a room after the verdict took {res.decode.elapsed:.2f}s"
        )
    # Each of this test's late rooms was held for the probe. (The counter alone
    # cannot say which: a victim request still arriving after the verdict is
    # held too.)
    decode_log = pd.log("decode-0", lines=5000)
    for res in late:
        assert f"room {res.room} held for a probe" in decode_log, res.room
    assert pd.stats("decode-0").get("room_held_for_probe", 0) >= held_before + len(late)

    results: list[PDResult] = traffic.result()
    lost = [r for r in results[: len(victims)] if not r.decode.ok]
    assert lost, "every victim finished before the kill"
    assert {r.room for r in lost} >= open_at_kill - {r.room for r in results if r.decode.ok}
    for res in lost:
        assert res.decode.status == 502
        # Rooms still fetching the instance's addresses at the kill find it unreachable there.
        assert any(r in res.decode.error for r in UNREACHABLE), res.decode.error
        assert res.decode.ended_at - killed_at <= heartbeat_bound(pd)
        # The prefill leg saw its worker vanish.
        assert res.prefill is not None and not res.prefill.ok
    check_survivors(results[len(victims) :], expected)
    failures = pd.failures("decode-0")
    failed = sum(failures.get(r, 0) for r in UNREACHABLE) - failed_before
    assert failed == len(lost) + len(late)
    assert pd.stats("decode-0").get("peer_dead", 0) == dead_before + 1
    pd.assert_clean(["prefill-0", "decode-0", "decode-1"])


@pytest.mark.slow
def test_killed_decode_leaves_nothing_on_prefill(
    pd22_cluster: FaultCluster, client: PDClient
) -> None:
    pd = make_ready(pd22_cluster, ["prefill-0", "decode-0", "decode-1"])
    victims = make_prompts(6, seed=51, lo=2500, hi=4000)
    survivors = make_prompts(4, seed=52, lo=1, hi=300)
    expected = colocated_outputs(pd.manifest, survivors, MAX_TOKENS)
    failed_before = sum(pd.failures("prefill-0").values())
    traffic = start_traffic(
        pd,
        client,
        [("prefill-0", "decode-1", p) for p in victims],
        [("prefill-0", "decode-0", p) for p in survivors],
    )

    def transferring() -> bool:
        return any(r["state"] == "Transferring" for r in pd.rooms("prefill-0"))

    wait_until(transferring, 30, 0.01, "a prefill-0 room to be Transferring")
    killed_at = time.monotonic()
    pd.kill("decode-1")
    results: list[PDResult] = traffic.result()
    spec = pd.manifest.spec.transfer
    bound = (
        spec.bootstrap_timeout_seconds
        + spec.waiting_timeout_seconds
        + spec.abort_release_timeout_seconds
    )
    pd.assert_clean(["prefill-0"], timeout=bound)
    assert time.monotonic() - killed_at <= bound + 1
    check_survivors(results[len(victims) :], expected)
    lost = [r for r in results[: len(victims)] if not r.decode.ok]
    assert lost
    prefill_errors = 0
    for res in lost:
        assert res.prefill is not None
        assert res.prefill.ended_at - killed_at <= bound
        if not res.prefill.ok:
            prefill_errors += 1
            assert res.prefill.status == 502 and res.prefill.error.startswith("prefill failed")
    failed = sum(pd.failures("prefill-0").values()) - failed_before
    assert failed >= prefill_errors


@pytest.mark.slow
def test_hung_decode_does_not_stall_transfers_to_others(pd: FaultCluster, client: PDClient) -> None:
    """SIGSTOP decode-1 while prefill-0 streams KV into it: decode-0 keeps being served.

    The hung peer holds its connection open and reads nothing, so the KV
    frames queued for it never leave. Prefill drops it after the release
    timeout and its rooms fail; transfers to every other decode go on. When
    decode-1 resumes, none of its rooms decodes from KV that never arrived.
    """
    survivors = make_prompts(4, seed=62, lo=1, hi=300)
    expected = colocated_outputs(pd.manifest, survivors, MAX_TOKENS)
    release_s = pd.manifest.spec.transfer.abort_release_timeout_seconds

    def transferring() -> bool:
        return any(r["state"] == "Transferring" for r in pd.rooms("prefill-0"))

    # On a quiet box every victim's KV can be in decode-1's socket buffer before
    # the SIGSTOP lands, and the hang then bites no room: try again, with new
    # prompts, until one round catches victims mid-transfer.
    for attempt in range(3):
        victims = make_prompts(8, seed=61 + 10 * attempt, lo=3000, hi=4000)
        expected_victims = colocated_outputs(pd.manifest, victims, MAX_TOKENS)
        traffic = start_traffic(pd, client, [("prefill-0", "decode-1", p) for p in victims], [])
        wait_until(transferring, 30, 0.01, "a prefill-0 room to be Transferring")
        pd.hang("decode-1")
        hung_at = time.monotonic()
        served = client.many(
            [lambda p=p: client.pair(pd, "prefill-0", "decode-0", p, MAX_TOKENS) for p in survivors]
        )
        check_survivors(served, expected)
        for res in served:
            assert res.decode.ended_at - hung_at < release_s + 5, "survivor stalled behind the hang"
        pd.cont("decode-1")
        results: list[PDResult] = traffic.result(60)
        for i, (res, want) in enumerate(zip(results, expected_victims, strict=True)):
            if res.decode.ok:  # finished before the hang, or untouched by it
                assert res.decode.output_ids == want, f"victim {i} decoded KV that never arrived"
        if not all(r.decode.ok for r in results):
            break
    assert not all(r.decode.ok for r in results), "every victim finished before the hang, 3 times"
    assert pd.stats("prefill-0").get("endpoint:peer_stalled", 0) >= 1
    spec = pd.manifest.spec.transfer
    pd.assert_clean(timeout=spec.waiting_timeout_seconds + spec.abort_release_timeout_seconds)
