"""Room identity rules (scenarios 6 and 7): duplicates, second endpoints, late messages.

A room number binds one request to one set of pages. A second request with
the same room, a second decode endpoint claiming it, or a message arriving
after the room concluded must be refused loudly — never merged into, or
resurrect, the original — and must leave the original untouched.
"""

from __future__ import annotations

import math

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.kvpoll import KVPoll
from tests.faults.harness import (
    PAGE,
    FaultCluster,
    PDClient,
    PDResult,
    gen_body,
    make_prompts,
    mint_rid,
    mint_room,
    post_leg,
    wait_until,
)
from tests.faults.rogue import Background, RogueDecode, RoguePrefill, fetch_instance
from tests.pd_integration.reference import colocated_outputs


def test_duplicate_room_on_decode_is_refused(
    pd: FaultCluster, client: PDClient, compat: CompatInfo
) -> None:
    rogue = RoguePrefill(pd.token, compat)
    room = mint_room()
    try:
        first = Background(
            client.generate, None, pd.url("decode-0"), rogue.bootstrap, [3] * 20, 4, room=room
        )
        _, meta = rogue.expect(pdmsg.TransferMeta, room)
        second: PDResult = client.generate(
            None, pd.url("decode-0"), rogue.bootstrap, [4] * 20, 4, room=room
        )
        assert second.decode.status == 409, second.decode
        assert "already in use" in second.decode.error
        # The first request's room is untouched and still waits for its KV.
        assert pd.room_state("decode-0", room) == "WaitingForInput"
        assert sum(isinstance(m, pdmsg.TransferMeta) for m in rogue.seen) == 1
        rogue.send_kv(meta, 20, is_last=True)
        rogue.status(meta, KVPoll.Success, first_token=9)
        done: PDResult = first.result(10)
        assert done.decode.ok and done.decode.output_ids[0] == 9
        pd.assert_clean(["decode-0"])
    finally:
        rogue.close()


def test_duplicate_room_on_prefill_is_refused(pd: FaultCluster) -> None:
    room = mint_room()
    prompt = make_prompts(1, seed=91, lo=30, hi=30)[0]
    bootstrap = pd.bootstrap("prefill-0")
    first = Background(
        post_leg,
        pd.url("prefill-0"),
        gen_body(prompt, 4, room=room, bootstrap=bootstrap),
        30.0,
    )
    wait_until(lambda: pd.room_state("prefill-0", room) == "Bootstrapping", 5)
    second = post_leg(pd.url("prefill-0"), gen_body(prompt, 4, room=room, bootstrap=bootstrap), 10)
    assert second.status == 409 and "already in use" in second.error
    assert pd.room_state("prefill-0", room) == "Bootstrapping"
    # The original still completes once its decode leg comes.
    decode = post_leg(
        pd.url("decode-0"),
        gen_body(prompt, 4, room=room, bootstrap=bootstrap),
        30,
    )
    # A different rid on the decode leg: prefill refuses to bind the room to it.
    assert decode.status == 502 and "room_conflict" in decode.error
    res = first.result(15)
    assert res.status == 502  # no decode ever claimed it under its rid: bootstrap timeout
    pd.assert_clean(["prefill-0", "decode-0"])


def test_second_endpoint_for_a_room_is_refused(pd: FaultCluster, compat: CompatInfo) -> None:
    prefill = fetch_instance(pd.bootstrap("prefill-0"), pd.token).ranks[0].endpoint
    owner, intruder = RogueDecode(pd.token, compat), RogueDecode(pd.token, compat)
    rid, room = mint_rid(), mint_room()
    prompt = make_prompts(1, seed=92, lo=300, hi=300)[0]
    pages = list(range(math.ceil(len(prompt) / PAGE)))
    try:
        for rogue in (owner, intruder):
            assert rogue.register(prefill).accepted
        owner.meta(prefill, room, rid, pages)
        wait_until(lambda: pd.room_state("prefill-0", room) == "Bootstrapping", 5)
        # Same rid, same decode rank, another endpoint: a redirect of the KV.
        intruder.meta(prefill, room, rid, pages)
        _, refused = intruder.expect(pdmsg.Status, room)
        assert refused.state is KVPoll.Failed
        assert "second endpoint" in (refused.reason or "")
        body = gen_body(prompt, 4, rid=rid, room=room, bootstrap=pd.bootstrap("prefill-0"))
        res = post_leg(pd.url("prefill-0"), body, 30)
        assert res.ok, res.error
        _, ok = owner.expect(pdmsg.Status, room)
        while ok.state is not KVPoll.Success:
            _, ok = owner.expect(pdmsg.Status, room)
        # The leg answers once its last frame is queued: frames may still be on the way.
        wait_until(lambda: owner.frames_for(room) > 0, 5, what="the owner's KV frames")
        assert intruder.frames_for(room) == 0
        pd.assert_clean(["prefill-0"])
    finally:
        owner.close()
        intruder.close()


def test_updates_for_a_cleared_room_are_dropped(
    pd: FaultCluster, client: PDClient, compat: CompatInfo
) -> None:
    rogue = RoguePrefill(pd.token, compat)
    try:
        leg = Background(client.generate, None, pd.url("decode-0"), rogue.bootstrap, [6] * 30, 4)
        _, meta = rogue.expect(pdmsg.TransferMeta)
        rogue.status(meta, KVPoll.Failed)
        res: PDResult = leg.result(10)
        assert res.decode.status == 502 and "failed" in res.decode.error
        # Failed is not drained: decode still asks, and waits for the ack.
        _, abort = rogue.expect(pdmsg.Abort, meta.room)
        rogue.ack(meta.decode_endpoint, meta.room, abort.generation)
        pd.assert_clean(["decode-0"])
        before = pd.stats("decode-0").get("dropped:unknown_room", 0)
        # A late status and KV frame for the concluded room: dropped, never a new room.
        rogue.status(meta, KVPoll.Transferring)
        rogue.send_kv(meta, 30, is_last=True)
        rogue.status(meta, KVPoll.Success, first_token=1)
        wait_until(lambda: pd.stats("decode-0").get("dropped:unknown_room", 0) >= before + 2, 5)
        assert pd.room_state("decode-0", meta.room) is None
        pd.assert_clean(["decode-0"])
    finally:
        rogue.close()


def test_replayed_room_is_refused_on_both_legs(pd: FaultCluster) -> None:
    """A request replayed with the room of one that already finished gets a clear error."""
    prompt = make_prompts(1, seed=93, lo=50, hi=50)[0]
    expected = colocated_outputs(pd.manifest, [prompt], 4)[0]
    room = mint_room()
    bootstrap = pd.bootstrap("prefill-0")
    client = PDClient()
    try:
        first = client.generate(
            pd.url("prefill-0"), pd.url("decode-0"), bootstrap, prompt, room=room
        )
        assert first.decode.ok and first.decode.output_ids == expected
        # No abort of the other leg when one fails (a router would send one):
        # decode's own answer is what is checked, not the client's abort racing it.
        again = client.generate(
            pd.url("prefill-0"), pd.url("decode-0"), bootstrap, prompt, room=room, propagate=False
        )
        # Prefill remembers the concluded room: reuse is refused, clearly, on both legs.
        assert again.prefill is not None and again.prefill.status == 502
        assert "already concluded" in again.prefill.error
        assert again.decode.status == 502 and "room_closed" in again.decode.error
    finally:
        client.close()
    pd.assert_clean(["prefill-0", "decode-0"])
