"""`POST /admin/fail_peer` and its `gone` flag.

The operator reports a lost pod with `gone: true` (deleted, exited) and a
pod NotReady past its grace with `gone: false` (it may be hung and resume).
Rooms tied to the peer fail at once either way. What differs is when their
pages may be reused: on a one-sided transport (shm) only once the peer acks
or is gone (test_policies.py, `one_sided`); over tcp at once, because the
receiver writes a frame only while its (room, generation) is receiving, so
a resumed peer's late frames are dropped — checked here on the shared tcp
cluster with survivors decoding in the reused pages while the peer resumes.

A body the worker cannot trust is refused before anything is failed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.operator.failover.admin_client import AdminClient
from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd_worker.admin_body import (
    FailPeerBodyError,
    FailPeerRequest,
    parse_fail_peer,
)
from tests.faults.harness import (
    FaultCluster,
    PDClient,
    PDResult,
    check_survivors,
    make_prompts,
    start_traffic,
    tied_rooms,
    wait_mid_transfer,
    wait_until,
)
from tests.faults.rogue import Background, RoguePrefill
from tests.pd_integration.reference import colocated_outputs

MAX_TOKENS = 4

# ------------------------------------------------------------------ the body, pure

JSON_SCALARS = st.none() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=5,
)


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({"peer": "10.0.0.7:8998"}, FailPeerRequest("10.0.0.7:8998", "peer_lost", True)),
        ({"peer": "10.0.0.7", "reason": "decode_pod_lost", "gone": True}, None),
        ({"peer": "10.0.0.7", "reason": "prefill_pod_lost", "gone": False}, None),
        ({"peer": "tcp://10.0.0.7:5555", "gone": False, "extra": 1}, None),
        ({"peer": "10.0.0.7", "gone": True, "incarnation": "3f2c-uid"}, None),
    ],
)
def test_good_bodies_parse(body: dict[str, Any], want: FailPeerRequest | None) -> None:
    got = parse_fail_peer(body)
    if want is None:
        want = FailPeerRequest(
            body["peer"], body.get("reason", "peer_lost"), body["gone"], body.get("incarnation")
        )
    assert got == want
    assert parse_fail_peer(got.to_json()) == got


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ([], 422, "body must be"),
        ("peer", 422, "body must be"),
        ({"reason": "x"}, 422, "body must be"),
        ({"peer": ""}, 422, "empty"),
        ({"peer": "p" * 257}, 422, "too long"),
        ({"peer": "p", "reason": "r" * 257}, 422, "too long"),
        ({"peer": "p", "gone": "false"}, 400, "gone must be true or false"),
        ({"peer": "p", "gone": 0}, 400, "gone must be true or false"),
        ({"peer": "p", "gone": 1}, 400, "gone must be true or false"),
        ({"peer": "p", "gone": None}, 400, "gone must be true or false"),
        ({"peer": "p", "gone": [False]}, 400, "gone must be true or false"),
        ({"peer": "p", "incarnation": 7}, 400, "incarnation must be a string"),
        ({"peer": "p", "incarnation": ""}, 400, "incarnation must be a string"),
        ({"peer": "p", "incarnation": "u" * 129}, 400, "incarnation must be a string"),
    ],
)
def test_bad_bodies_are_refused_with_a_reason(body: Any, status: int, words: str) -> None:
    with pytest.raises(FailPeerBodyError, match=words) as err:
        parse_fail_peer(body)
    assert err.value.status == status


@given(gone=JSON_VALUES)
def test_only_a_json_boolean_is_a_gone_flag(gone: Any) -> None:
    body = {"peer": "10.0.0.7:8998", "gone": gone}
    if isinstance(gone, bool):
        assert parse_fail_peer(body).gone is gone
    else:
        with pytest.raises(FailPeerBodyError) as err:
            parse_fail_peer(body)
        assert err.value.status == 400


@given(
    peer=st.text(min_size=1, max_size=256),
    reason=st.text(max_size=256),
    gone=st.booleans(),
    incarnation=st.none() | st.text(min_size=1, max_size=128),
)
def test_what_is_sent_is_what_is_parsed(
    peer: str, reason: str, gone: bool, incarnation: str | None
) -> None:
    call = FailPeerRequest(peer, reason, gone, incarnation)
    assert parse_fail_peer(call.to_json()) == call


# ------------------------------------------------------------------ on a real worker


def room_failures(cluster: FaultCluster, name: str) -> dict[str, int]:
    # Only rooms: heartbeat counters of the shared cluster move on their own.
    return {k: v for k, v in cluster.stats(name).items() if k.startswith("room_failed:")}


@pytest.mark.parametrize("gone", ["false", 0, None])
def test_a_bad_gone_flag_is_refused_and_fails_nothing(
    pd: FaultCluster, client: PDClient, compat: CompatInfo, gone: Any
) -> None:
    rogue = RoguePrefill(pd.token, compat)
    peer = "{}:{}".format(*rogue.bootstrap)
    before = room_failures(pd, "decode-0")
    try:
        leg = Background(client.generate, None, pd.url("decode-0"), rogue.bootstrap, [7] * 40)
        rogue.expect(pdmsg.TransferMeta)
        resp = pd.admin("decode-0", "POST", "/admin/fail_peer", json={"peer": peer, "gone": gone})
        assert resp.status_code == 400
        assert "gone must be true or false" in resp.json()["error"]["message"]
        time.sleep(0.3)
        rooms = [r for r in pd.rooms("decode-0") if peer in r["peers"]]
        assert [r["state"] for r in rooms] == ["WaitingForInput"]
        assert room_failures(pd, "decode-0") == before
        # A good call still works afterwards: the room fails with its reason.
        assert pd.fail_peer("decode-0", peer, "prefill_pod_lost", gone=True).is_success
        res: PDResult = leg.result(10)
        assert res.decode.status == 502 and "prefill_pod_lost" in res.decode.error
        pd.assert_clean(["decode-0"], timeout=3)
    finally:
        rogue.close()


def test_the_operators_client_speaks_the_workers_admin_api(pd: FaultCluster) -> None:
    async def call(gone: bool) -> tuple[bool, int]:
        admin = AdminClient(timeout_s=5.0)
        try:
            # A peer nothing is tied to: the call is accepted and fails no room.
            res = await admin.fail_peer(
                pd.url("decode-0"), pd.token, "127.0.0.1:9", "prefill_pod_lost", gone=gone
            )
        finally:
            await admin.aclose()
        return res.ok, res.status

    before = room_failures(pd, "decode-0")
    assert asyncio.run(call(False)) == (True, 200)
    assert asyncio.run(call(True)) == (True, 200)
    assert room_failures(pd, "decode-0") == before
    pd.assert_clean(["decode-0"], timeout=1)


@pytest.mark.slow
def test_tcp_pages_come_back_at_once_after_a_not_ready_report(
    pd: FaultCluster, client: PDClient
) -> None:
    victims = make_prompts(6, seed=61, lo=2500, hi=4000)
    survivors = make_prompts(6, seed=62, lo=200, hi=1200)
    expected = colocated_outputs(pd.manifest, survivors, MAX_TOKENS)
    traffic = start_traffic(
        pd, client, [("prefill-1", "decode-0", p) for p in victims], [], propagate=False
    )
    wait_mid_transfer(pd, "decode-0", "prefill-1")
    pd.hang("prefill-1")
    reported_at = time.monotonic()
    resp = pd.fail_peer("decode-0", pd.peer("prefill-1"), "prefill_pod_lost", gone=False)
    assert resp.status_code == 200 and resp.json()["gone"] is False
    # Over tcp a resumed writer's frames are dropped by (room, generation):
    # the pages return without waiting for an ack or the release timer.
    wait_until(lambda: not tied_rooms(pd, "decode-0", "prefill-1"), 2, 0.01, "rooms released")
    release_s = pd.manifest.spec.transfer.abort_release_timeout_seconds
    assert time.monotonic() - reported_at < release_s
    pd.assert_clean(["decode-0"], timeout=1)
    # Survivors take those pages while the hung writer resumes and flushes.
    later = start_traffic(
        pd, client, [], [("prefill-0", "decode-0", p) for p in survivors], propagate=True
    )
    pd.cont("prefill-1")
    check_survivors(later.result(), expected)
    lost = [r for r in traffic.result() if not r.decode.ok]
    assert lost, "every victim finished before the report"
    for res in lost:
        assert "prefill_pod_lost" in res.decode.error or "prefill_unreachable" in res.decode.error
    # prefill-1 finished (or timed out) what it was sending into the void.
    spec = pd.manifest.spec.transfer
    pd.assert_clean(timeout=spec.waiting_timeout_seconds + spec.abort_release_timeout_seconds)


def test_a_prefill_restarted_in_place_is_used_before_the_report_expires(
    pd: FaultCluster, client: PDClient, compat: CompatInfo
) -> None:
    """The operator reports a prefill gone; it comes back at the same address.

    While the old process still answers (a terminating pod) the report
    stands: new rooms fail with its reason and `peers_down` lists it. Once a
    new process serves there, decode's next probe sees another start in
    `/health` and takes rooms for it at once, long before the report's
    `bootstrapTimeoutSeconds` would have ended it.
    """
    transfer = pd.manifest.spec.transfer
    interval = transfer.heartbeat.interval_seconds
    old: RoguePrefill | None = RoguePrefill(pd.token, compat)
    assert old is not None
    port = old.bootstrap[1]
    peer = f"127.0.0.1:{port}"
    new: RoguePrefill | None = None
    try:
        leg = Background(client.generate, None, pd.url("decode-0"), old.bootstrap, [7] * 20)
        old.expect(pdmsg.TransferMeta)
        time.sleep(2 * interval)  # decode's probes saw the old process's start
        reported_at = time.monotonic()
        assert pd.fail_peer("decode-0", peer, "prefill_pod_lost", gone=True).is_success
        assert leg.result(10).decode.status == 502

        # The old process keeps answering its probes: that proves no new start.
        time.sleep(4 * interval)
        assert pd.info("decode-0")["peers_down"].get(peer) == "prefill_pod_lost"
        refused = client.generate(None, pd.url("decode-0"), old.bootstrap, [8] * 20)
        assert refused.decode.status == 502 and "prefill_pod_lost" in refused.decode.error

        old.close()
        old = None
        new = RoguePrefill(pd.token, compat, port=port)  # a restart in place
        wait_until(
            lambda: peer not in pd.info("decode-0")["peers_down"],
            transfer.bootstrap_timeout_seconds,
            0.02,
            "decode to see the restarted prefill",
        )
        took = time.monotonic() - reported_at
        assert took < transfer.bootstrap_timeout_seconds - 1.0, f"readmitted {took:.2f}s after"
        # New rooms reach the restarted process.
        leg = Background(client.generate, None, pd.url("decode-0"), new.bootstrap, [9] * 20)
        new.expect(pdmsg.TransferMeta, timeout=3)
        pd.fail_peer("decode-0", peer, "test_cleanup", gone=False)
        assert leg.result(10).decode.status == 502
    finally:
        for rogue in (old, new):
            if rogue is not None:
                rogue.close()
    pd.assert_clean(["decode-0"])
