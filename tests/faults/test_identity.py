"""A ZMQ peer is the connection it proved, never what its frame says.

A rogue peer on the cluster network forges frames naming a real rank's
endpoint: a KV-layout registration that earns a genuine rejection (which
the prefill used to send to the decode named in the frame, failing every
room of that decode from this prefill), and KV frames for a live room sent
from a connection that is not the room's source. Each is refused: the
forger's own connection gets the refusal, the named rank keeps serving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.kvpoll import KVPoll
from tests.faults.harness import (
    FaultCluster,
    PDClient,
    gen_body,
    make_prompts,
    mint_rid,
    mint_room,
    post_leg,
    wait_until,
)
from tests.faults.rogue import Background, RogueDecode, RoguePrefill
from tests.pd_integration.reference import colocated_outputs

MAX_TOKENS = 4


def counters(cluster: FaultCluster, name: str) -> dict[str, Any]:
    info = cluster.info(name)
    return {**info["pd_stats"], **{f"kv:{k}": v for k, v in info["kv_receive_stats"].items()}}


def rooms_of(cluster: FaultCluster, name: str) -> set[int]:
    return {r["room"] for r in cluster.rooms(name)}


def forge_during_a_live_room(
    cluster: FaultCluster, seed: int, forge: Callable[[], None], refused: Callable[[], bool]
) -> None:
    """Hold a room live on both sides, forge, and check the room still completes.

    The decode leg goes first: its room waits at the prefill for the prefill
    leg, so it is live (and sourced from prefill-0) when the forgery lands.
    """
    prompt = make_prompts(1, seed=seed, lo=60, hi=60)[0]
    expected = colocated_outputs(cluster.manifest, [prompt], MAX_TOKENS)[0]
    rid, room = mint_rid(), mint_room()
    body = gen_body(
        prompt, MAX_TOKENS, rid=rid, room=room, bootstrap=cluster.bootstrap("prefill-0")
    )
    leg = Background(post_leg, cluster.url("decode-0"), body, 40)
    wait_until(lambda: room in rooms_of(cluster, "prefill-0"), 10, 0.05, "the room at prefill")
    forge()
    wait_until(refused, 5, 0.05, "the forged frame refused")
    assert room in rooms_of(cluster, "decode-0")  # not failed by the forgery
    pre = post_leg(cluster.url("prefill-0"), body, 40)
    dec = leg.result(40)
    assert pre.ok, pre
    assert dec.ok and dec.output_ids == expected, dec


def forge_a_registration_for_decode_0(
    cluster: FaultCluster, seed: int, rogue: RogueDecode, counter: str, **layout: Any
) -> str:
    """`rogue` sends prefill-0 a KV-layout registration naming decode-0's endpoint
    during a live room of decode-0: prefill-0 counts `counter`, the room is served.
    Prefill-0's endpoint."""
    decode_ep = cluster.info("decode-0")["endpoint"]
    prefill_ep: str = cluster.info("prefill-0")["endpoint"]
    before = counters(cluster, "prefill-0").get(counter, 0)
    forge_during_a_live_room(
        cluster,
        seed,
        lambda: rogue.send(prefill_ep, rogue.layout(decode_endpoint=decode_ep, **layout)),
        lambda: counters(cluster, "prefill-0").get(counter, 0) > before,
    )
    return prefill_ep


def test_a_forged_registration_without_the_token_never_reaches_the_decode_it_names(
    pd: FaultCluster, compat: CompatInfo
) -> None:
    rogue = RogueDecode("not-" + pd.token, compat)
    try:
        forge_a_registration_for_decode_0(pd, 181, rogue, "endpoint:bad_proof")
        assert not any(isinstance(m, pdmsg.LayoutAck) for m in rogue.seen)
    finally:
        rogue.close()


def test_an_insider_naming_another_decode_in_its_registration_is_dropped(
    pd: FaultCluster, compat: CompatInfo
) -> None:
    # It holds the cluster token (its connection proves its own address), but
    # its registration speaks for the real decode, with a wrong layout token.
    rogue = RogueDecode(pd.token, compat)
    try:
        prefill_ep = forge_a_registration_for_decode_0(
            pd, 183, rogue, "reject:sender_mismatch", token="wrong"
        )
        # Its own registration, under its own address, is answered to it alone.
        ack = rogue.register(prefill_ep, token="wrong")
        assert not ack.accepted
    finally:
        rogue.close()


def test_kv_for_a_room_from_a_connection_other_than_its_source_is_dropped(
    pd: FaultCluster, client: PDClient, compat: CompatInfo
) -> None:
    source = RoguePrefill(pd.token, compat)
    intruder = RoguePrefill(pd.token, compat, register=False)
    prompt = make_prompts(1, seed=185, lo=40, hi=40)[0]
    try:
        leg = Background(
            client.generate, None, pd.url("decode-0"), source.bootstrap, prompt, MAX_TOKENS
        )
        _, meta = source.expect(pdmsg.TransferMeta)
        before = counters(pd, "decode-0")
        intruder.send_kv(meta, len(prompt), fill=7, is_last=True)
        wait_until(
            lambda: (
                counters(pd, "decode-0").get("endpoint:kv_wrong_source", 0)
                > before.get("endpoint:kv_wrong_source", 0)
            ),
            5,
            0.05,
            "the intruder's frame dropped",
        )
        assert counters(pd, "decode-0").get("kv:accepted", 0) == before.get("kv:accepted", 0)
        # The room's own source still delivers.
        source.send_kv(meta, len(prompt), is_last=True)
        wait_until(
            lambda: counters(pd, "decode-0").get("kv:accepted", 0) > before.get("kv:accepted", 0),
            5,
            0.05,
            "the source's frame taken",
        )
        source.status(meta, KVPoll.Success, first_token=3)
        res = leg.result(30)
        assert res.decode.status == 200, res
    finally:
        intruder.close()
        source.close()
