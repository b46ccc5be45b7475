"""What happens before a byte moves (scenarios 8, 9 and 11).

- bootstrap server unreachable: the request fails fast with a clear reason,
  other requests are not held up meanwhile, and once the prefill instance
  comes up it is used right away;
- incompatible peers (KV page size, dtype, allocation policy, topology,
  token): the request fails with a message naming the field and both values,
  in either direction, and nothing is reserved;
- a prompt over what an instance can hold: 400 on either leg at once,
  nothing reserved, no peer traffic.
"""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.ports import free_ports
from tests.faults.harness import (
    FaultCluster,
    PDClient,
    PDResult,
    fast_bound,
    gen_body,
    make_prompts,
    mint_rid,
    mint_room,
    post_leg,
    router_generate,
)
from tests.faults.rogue import Background, RogueDecode, RoguePrefill, fetch_instance
from tests.pd_integration.reference import colocated_outputs


def test_unreachable_bootstrap_fails_fast_then_the_late_instance_is_used(
    pd: FaultCluster, client: PDClient, compat: CompatInfo
) -> None:
    port = free_ports(1)[0]
    nowhere = ("127.0.0.1", port)
    # A published prefill that does not answer (its pod not up yet): decode may try it.
    pd.publish_prefill_peers([*pd.prefill_peers(), f"127.0.0.1:{port}"])
    # Whichever notices first: the /route retries or the heartbeat.
    reasons = ("bootstrap_unreachable", "prefill_unreachable")

    def failed() -> int:
        stats = pd.stats("decode-0")
        return sum(stats.get(f"room_failed:{r}", 0) for r in reasons)

    before = failed()
    prompt = make_prompts(1, seed=101, lo=20, hi=20)[0]
    expected = colocated_outputs(pd.manifest, [prompt], 4)[0]
    lost = Background(client.generate, None, pd.url("decode-0"), nowhere, [1] * 10, 4)
    time.sleep(0.1)
    # Decode fetches /route off its scheduler: others are served meanwhile.
    assert not lost.done(), "the unreachable request should still be retrying"
    other = client.pair(pd, "prefill-0", "decode-0", prompt)
    assert other.decode.ok and other.decode.output_ids == expected
    res: PDResult = lost.result(15)
    assert res.decode.status == 502 and any(r in res.decode.error for r in reasons)
    # Served meanwhile, not after: a scheduler stalled by a synchronous /route fetch
    # would answer `other` only once the lost request's retries ended (its failure,
    # a heartbeat verdict at the earliest: over a second here; a fraction of one for `other`).
    assert other.decode.ended_at < res.decode.ended_at, "held up behind the /route retries"
    assert res.decode.elapsed < pd.manifest.spec.transfer.bootstrap_timeout_seconds + 1
    assert failed() == before + 1
    pd.assert_clean(["decode-0"])

    # The prefill instance starts late on that address: the next probe finds
    # it and new requests reach it at once.
    rogue = RoguePrefill(pd.token, compat, port=port)
    try:
        time.sleep(1.0)
        leg = Background(client.generate, None, pd.url("decode-0"), nowhere, [1] * 10, 4)
        _, meta = rogue.expect(pdmsg.TransferMeta, timeout=3)
        pd.fail_peer("decode-0", f"127.0.0.1:{port}", "test_cleanup")
        assert leg.result(10).decode.status == 502
    finally:
        rogue.close()
    pd.assert_clean(["decode-0"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"page_size": 32}, "page_size mismatch: prefill=32, decode=16"),
        ({"kv_dtype": "float16"}, "kv_dtype mismatch: prefill=float16, decode=float32"),
        (
            {"allocation_policy": "prefill_complete"},
            "allocation_policy mismatch: prefill=prefill_complete, decode=early",
        ),
        ({"model_fingerprint": "other-model"}, "model_fingerprint mismatch"),
    ],
)
def test_incompatible_prefill_instance_fails_the_request_by_name(
    pd: FaultCluster,
    client: PDClient,
    compat: CompatInfo,
    change: dict[str, object],
    message: str,
) -> None:
    before = pd.stats("decode-0").get("room_failed:incompatible", 0)
    with RoguePrefill(pd.token, msgspec.structs.replace(compat, **change)) as rogue:
        res = client.generate(None, pd.url("decode-0"), rogue.bootstrap, [2] * 40, 4)
        assert res.decode.status == 502
        assert message in res.decode.error
        assert not any(isinstance(m, pdmsg.TransferMeta) for m in rogue.seen)
        assert pd.stats("decode-0").get("room_failed:incompatible", 0) == before + 1
        pd.assert_clean(["decode-0"])


def test_unsupported_topology_fails_the_request_by_name(
    pd: FaultCluster, client: PDClient, compat: CompatInfo
) -> None:
    # tp=3 cannot split the tiny model's 4 KV heads.
    rogue = RoguePrefill(pd.token, compat, shape=InstanceShape(tp=3), register=False)
    try:
        for tp in range(3):
            rogue.rank = RankCoord(tp=tp)
            rogue.register()
        res = client.generate(None, pd.url("decode-0"), rogue.bootstrap, [2] * 40, 4)
        assert res.decode.status == 502 and "unsupported_topology" in res.decode.error
        pd.assert_clean(["decode-0"])
    finally:
        rogue.close()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"compat": "kv_dtype"}, "kv_dtype mismatch: prefill=float32, decode=float16"),
        ({"compat": "page_size"}, "page_size mismatch: prefill=16, decode=8"),
        ({"token": "wrong-token"}, "unauthorized"),
        ({"token": ""}, "unauthorized"),
    ],
)
def test_incompatible_decode_rank_is_refused_by_prefill(
    pd: FaultCluster, compat: CompatInfo, changes: dict[str, str], reason: str
) -> None:
    prefill = fetch_instance(pd.bootstrap("prefill-0"), pd.token).ranks[0].endpoint
    rogue = RogueDecode(pd.token, compat)
    before = pd.stats("prefill-0")
    try:
        layout: dict[str, object] = {}
        if changes.get("compat") == "kv_dtype":
            layout["compat"] = msgspec.structs.replace(compat, kv_dtype="float16")
        elif changes.get("compat") == "page_size":
            layout["compat"] = msgspec.structs.replace(compat, page_size=8)
        if "token" in changes:
            layout["token"] = changes["token"]
        ack = rogue.register(prefill, **layout)
        assert not ack.accepted
        assert reason in (ack.reason or "")
        # Unregistered, its claims change nothing on the prefill rank.
        room = mint_room()
        rogue.meta(prefill, room, mint_rid(), list(range(4)))
        _, again = rogue.expect(pdmsg.LayoutAck)
        assert not again.accepted and "unregistered_peer" in (again.reason or "")
        assert pd.rooms("prefill-0") == []
        after = pd.stats("prefill-0")
        assert (
            after.get("dropped:unregistered_peer", 0)
            == before.get("dropped:unregistered_peer", 0) + 1
        )
        pd.assert_clean(["prefill-0"])
    finally:
        rogue.close()


def test_prompt_over_capacity_is_refused_on_both_legs(pd: FaultCluster, compat: CompatInfo) -> None:
    rogue = RoguePrefill(pd.token, compat)
    limit = pd.info("decode-0")["max_prompt_tokens"]
    prompt = [7] * (limit + 1)
    try:
        body = gen_body(prompt, 4, bootstrap=rogue.bootstrap)
        for worker in ("prefill-0", "decode-0"):
            res = post_leg(pd.url(worker), body, 10)
            assert res.status == 400, res
            assert f"at most {limit}" in res.error
            # At once, not after waiting for a peer (the leg would time out at 10 s).
            assert res.elapsed < fast_bound(0.0, 10, "a refusal"), res.elapsed
        via_router = router_generate(pd.endpoint, prompt, 4, 10)
        assert via_router.status == 400 and str(limit) in via_router.error
        # Nothing reserved, no peer contacted.
        time.sleep(0.2)
        assert rogue.seen == []
        pd.assert_clean(["prefill-0", "decode-0"], timeout=1)
    finally:
        rogue.close()


def test_bootstrap_route_requires_the_cluster_token(pd: FaultCluster) -> None:
    host, port = pd.bootstrap("prefill-0")
    url = f"http://{host}:{port}/route"
    params = {"dp": -1, "cp": -1, "tp": -1, "pp": -1}
    assert httpx.get(url, params=params).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(url, params=params, headers=wrong).status_code == 403
    reg = {"rank": {}, "shape": {}, "endpoint": "tcp://127.0.0.1:1", "compat": {}}
    assert httpx.put(url, json=reg, headers=wrong).status_code == 403
    # Nothing changed: the instance still lists its one real rank.
    info = fetch_instance((host, port), pd.token)
    assert [r.endpoint for r in info.ranks] == [pd.info("prefill-0")["endpoint"]]
    assert httpx.get(f"http://{host}:{port}/health").status_code == 200
