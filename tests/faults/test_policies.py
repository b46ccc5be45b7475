"""One-sided transport and `prefill_complete` under faults.

(`failurePolicy: recompute` and the KV checksum live in test_recompute.py.)
Two more clusters of their own:
- `one_sided`: `shm` (prefill writes straight into decode's memory), two
  prefill instances and a short release timeout — a layout the prefill cannot
  write is refused at registration, naming both sides; a failed room's pages
  wait for the writer's acknowledgement or a definitive verdict (operator,
  restart), never for a timer or a heartbeat, while survivors keep their
  colocated outputs;
- `staged`: `allocationPolicy: prefill_complete` with `auth.zmqCurve` —
  late BOOTSTRAP meets a tombstone; a decode on this policy against an
  `early` prefill fails by name; a ZMQ peer without the token is deaf.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.transfer.curve import cluster_keys
from tests.faults.harness import (
    PAGE,
    FaultCluster,
    PDClient,
    PDResult,
    base_spec,
    fast_bound,
    gen_body,
    held_pages,
    make_prompts,
    mint_rid,
    mint_room,
    one_sided_victims,
    post_leg,
    router_generate,
    run_all_equal_colocated,
    survivors_served,
    wait_until,
)
from tests.faults.rogue import Background, RogueDecode, RoguePrefill, fetch_instance
from tests.pd_integration.reference import colocated_outputs

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def one_sided(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    tmp: Path = tmp_path_factory.mktemp("one-sided")
    spec = base_spec(backend="shm", abortReleaseTimeoutSeconds=1.0)
    spec["kvCache"]["numPages"] = 240
    spec["prefill"]["replicas"] = 2
    with FaultCluster(tmp, "faults-one-sided", spec) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    tmp: Path = tmp_path_factory.mktemp("staged")
    spec = base_spec(allocationPolicy="prefill_complete")
    spec["auth"] = {"zmqCurve": True}
    with FaultCluster(tmp, "faults-staged", spec) as cluster:
        yield cluster


# ------------------------------------------------------------------ shm (one-sided writes)


def test_one_sided_transfers_equal_colocated(one_sided: FaultCluster, client: PDClient) -> None:
    prompts = make_prompts(5, seed=131, lo=1, hi=1500)
    run_all_equal_colocated(one_sided, client, prompts, MAX_TOKENS)
    one_sided.assert_clean()


def test_a_layout_the_prefill_cannot_write_is_refused_naming_both_and_it_keeps_serving(
    one_sided: FaultCluster, tmp_path: Path
) -> None:
    """Another transfer backend, or a shared-memory pool the prefill cannot open: refused
    at registration, naming both sides, and the prefill keeps serving."""
    cluster = one_sided
    info = fetch_instance(cluster.bootstrap("prefill-0"), cluster.token)
    prefill = info.ranks[0].endpoint
    prompt = make_prompts(1, seed=5, lo=12, hi=12)[0]
    expected = colocated_outputs(cluster.manifest, [prompt], 4)[0]
    shm_compat: CompatInfo = info.compat
    assert shm_compat.transfer_backend == "shm"
    tcp_compat = CompatInfo(**{**_fields(shm_compat), "transfer_backend": "tcp"})
    cases = [
        (tcp_compat, {}, "backend_mismatch: prefill shm, decode tcp"),
        # Same backend, but the pool lives where this prefill cannot open it
        # (another node, another pod's /dev/shm).
        (shm_compat, {"shm_pool_path": str(tmp_path / "elsewhere")}, "backend_mismatch: "),
    ]
    for compat, changes, reason in cases:
        rogue = RogueDecode(cluster.token, compat)
        try:
            ack = rogue.register(prefill, **changes)
        finally:
            rogue.close()
        assert not ack.accepted
        assert ack.reason is not None and ack.reason.startswith(reason), ack.reason
        res = router_generate(cluster.endpoint, prompt, 4, 30)
        assert res.ok and res.output_ids == expected, res.body
    cluster.assert_clean()


def _fields(compat: CompatInfo) -> dict[str, Any]:
    return {name: getattr(compat, name) for name in compat.__struct_fields__}


def test_one_sided_pages_wait_for_the_ack_not_a_timer(
    one_sided: FaultCluster, client: PDClient
) -> None:
    compat = fetch_instance(one_sided.bootstrap("prefill-0"), one_sided.token).compat
    rogue = RoguePrefill(one_sided.token, compat)
    prompt = [4] * 50
    num_pages = math.ceil(len(prompt) / PAGE)
    try:
        leg = Background(client.generate, None, one_sided.url("decode-0"), rogue.bootstrap, prompt)
        _, meta = rogue.expect(pdmsg.TransferMeta)
        assert len(meta.dst_pages) == num_pages
        assert one_sided.abort("decode-0", meta.rid)["found"] is True
        assert leg.result(10).decode.status == 502
        rogue.expect(pdmsg.Abort, meta.room)
        release_s = one_sided.manifest.spec.transfer.abort_release_timeout_seconds
        time.sleep(release_s + 1.0)
        # The prefill may still be writing into these pages: they stay reserved.
        info = one_sided.info("decode-0")
        assert info["num_free_pages"] == info["num_total_pages"] - num_pages
        rogue.ack(meta.decode_endpoint, meta.room, meta.generation - 1)  # stale: ignored
        time.sleep(0.3)
        info = one_sided.info("decode-0")
        assert info["num_free_pages"] == info["num_total_pages"] - num_pages
        rogue.ack(meta.decode_endpoint, meta.room, meta.generation)
        one_sided.assert_clean(["decode-0"], timeout=3)
    finally:
        rogue.close()


@pytest.mark.slow
def test_hung_one_sided_writer_keeps_its_pages_until_it_acks(
    one_sided: FaultCluster, client: PDClient
) -> None:
    traffic = one_sided_victims(one_sided, client, seed=132)
    one_sided.hang("prefill-1")
    peer = one_sided.peer("prefill-1")

    def failed() -> bool:
        rooms = [r for r in one_sided.rooms("decode-0") if peer in r["peers"]]
        return bool(rooms) and all(r["state"] == "Failed" for r in rooms)

    wait_until(failed, 3, 0.01, "the hung writer's rooms to fail")
    # The clients know; the pages stay out of reach while the writer may wake up.
    held = held_pages(one_sided, "decode-0")
    assert held > 0
    time.sleep(one_sided.manifest.spec.transfer.abort_release_timeout_seconds + 1)
    assert held_pages(one_sided, "decode-0") == held
    survivors_served(one_sided, client, seed=133)
    # It resumes, reads the ABORTs, finishes or drops its writes and acks.
    one_sided.cont("prefill-1")
    results: list[PDResult] = traffic.result(30)
    for res in results:
        assert res.decode.ok or "prefill_unreachable" in res.decode.error
    survivors_served(one_sided, client, seed=134)
    one_sided.assert_clean(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("then", ["pod_gone", "resumes"])
def test_not_ready_verdict_keeps_one_sided_pages_until_gone_or_acked(
    one_sided: FaultCluster, client: PDClient, then: str
) -> None:
    """The operator's NotReady report (`gone: false`) fails rooms but frees no page."""
    traffic = one_sided_victims(one_sided, client, seed=137)
    one_sided.hang("prefill-1")
    peer = one_sided.peer("prefill-1")
    resp = one_sided.fail_peer("decode-0", peer, "prefill_pod_lost", gone=False)
    assert resp.status_code == 200 and resp.json()["gone"] is False

    def failed() -> bool:
        rooms = [r for r in one_sided.rooms("decode-0") if peer in r["peers"]]
        return bool(rooms) and all(r["state"] == "Failed" for r in rooms)

    wait_until(failed, 3, 0.01, "the hung writer's rooms to fail")
    held = held_pages(one_sided, "decode-0")
    assert held > 0, "pages a hung writer may still write were freed"
    assert any(
        (r["reason"] or "").startswith("prefill_pod_lost") for r in one_sided.rooms("decode-0")
    )
    # Neither the release timer nor more verdicts of the same kind free them.
    time.sleep(one_sided.manifest.spec.transfer.abort_release_timeout_seconds + 1)
    assert one_sided.fail_peer("decode-0", peer, "prefill_pod_lost", gone=False).status_code == 200
    assert held_pages(one_sided, "decode-0") == held
    survivors_served(one_sided, client, seed=138)
    if then == "pod_gone":
        # The pod is deleted after all: its processes die, the operator says so.
        one_sided.kill("prefill-1")
        assert one_sided.fail_peer("decode-0", peer, "prefill_pod_lost", gone=True).is_success
        one_sided.assert_clean(["decode-0"], timeout=2)
    else:
        # It was only hung: it reads the ABORTs, drains and acks.
        one_sided.cont("prefill-1")
        one_sided.assert_clean(["decode-0"], timeout=10)
    for res in traffic.result(30):
        lost = ("prefill_pod_lost", "prefill_unreachable")
        assert res.decode.ok or any(r in res.decode.error for r in lost), res.decode.error
    survivors_served(one_sided, client, seed=139)


@pytest.mark.slow
@pytest.mark.parametrize("verdict", ["operator", "restart"])
def test_killed_one_sided_writer_pages_come_back(
    one_sided: FaultCluster, client: PDClient, verdict: str
) -> None:
    traffic = one_sided_victims(one_sided, client, seed=135)
    one_sided.kill("prefill-1")
    traffic.result(30)
    # A heartbeat cannot tell dead from hung: the pages wait for a definitive verdict.
    assert held_pages(one_sided, "decode-0") > 0
    if verdict == "operator":
        resp = one_sided.fail_peer("decode-0", one_sided.peer("prefill-1"), "pod_deleted")
        assert resp.status_code == 200
        one_sided.assert_clean(["decode-0"], timeout=2)
    else:
        # Back on the same bootstrap address with new rank endpoints: the old writer is gone.
        one_sided.restart("prefill-1")
        one_sided.assert_clean(["decode-0"], timeout=5)
        stats = one_sided.stats("decode-0")
        assert stats.get("room_failed:prefill_unreachable", 0) >= 1
    survivors_served(one_sided, client, seed=136)


def test_prompt_over_page_capacity_is_refused(one_sided: FaultCluster) -> None:
    info = one_sided.info("decode-0")
    capacity = info["num_total_pages"] * PAGE
    prompt = [6] * (capacity + 10)
    assert len(prompt) <= info["max_prompt_tokens"]
    body = gen_body(
        prompt,
        MAX_TOKENS,
        bootstrap=one_sided.bootstrap("prefill-0"),
    )
    for worker in ("prefill-0", "decode-0"):
        res = post_leg(one_sided.url(worker), body, 10)
        assert res.status == 400, res
        assert res.error
        # At once, not after waiting for a peer (the leg would time out at 10 s).
        assert res.elapsed < fast_bound(0.0, 10, "a refusal"), res.elapsed
    one_sided.assert_clean(["prefill-0", "decode-0"], timeout=1)


# ------------------------------------------------------------------ prefill_complete


def test_prefill_complete_equals_colocated(staged: FaultCluster, client: PDClient) -> None:
    prompts = make_prompts(5, seed=141, lo=1, hi=1500)
    run_all_equal_colocated(staged, client, prompts, MAX_TOKENS)
    staged.assert_clean()


def test_late_bootstrap_meets_a_tombstone(staged: FaultCluster) -> None:
    info = fetch_instance(staged.bootstrap("prefill-0"), staged.token)
    prefill = info.ranks[0].endpoint
    rogue = RogueDecode(staged.token, info.compat, curve=cluster_keys(staged.token))
    rid, room = mint_rid(), mint_room()
    try:
        assert rogue.register(prefill).accepted
        body = gen_body(
            [5] * 40, MAX_TOKENS, rid=rid, room=room, bootstrap=staged.bootstrap("prefill-0")
        )
        leg = Background(post_leg, staged.url("prefill-0"), body, 20.0)
        wait_until(lambda: staged.rooms("prefill-0"), 5, what="the prefill room")
        assert staged.abort("prefill-0", rid)["found"] is True
        assert leg.result(10).status == 502
        staged.assert_clean(["prefill-0"], timeout=5)
        rogue.bootstrap_msg(prefill, room, rid)
        _, status = rogue.expect(pdmsg.Status, room)
        assert status.state is KVPoll.Failed and (status.reason or "").startswith("room_closed")
        assert not any(isinstance(m, pdmsg.Ready) for m in rogue.seen)
        staged.assert_clean(["prefill-0"])
    finally:
        rogue.close()


def test_allocation_policy_mismatch_names_both(
    staged: FaultCluster, pd: FaultCluster, client: PDClient
) -> None:
    # A prefill_complete decode against an early prefill instance (of the other
    # cluster, which the decode is told it may contact, as the operator would).
    staged.publish_prefill_peers([*staged.prefill_peers(), pd.peer("prefill-0")])
    try:
        res = client.generate(
            pd.url("prefill-0"), staged.url("decode-0"), pd.bootstrap("prefill-0"), [3] * 30
        )
    finally:
        staged.publish_prefill_peers()
    assert res.decode.status == 502
    assert "allocation_policy mismatch: prefill=early, decode=prefill_complete" in res.decode.error
    assert res.prefill is not None and res.prefill.status == 502
    staged.assert_clean(["decode-0"])
    pd.assert_clean(["prefill-0"])


def test_zmq_curve_admits_only_token_holders(staged: FaultCluster) -> None:
    """`auth.zmqCurve`: the cluster above runs encrypted; a peer without the token is deaf."""
    info = fetch_instance(staged.bootstrap("prefill-0"), staged.token)
    prefill = info.ranks[0].endpoint
    before = staged.stats("prefill-0")
    outsider = RogueDecode(staged.token, info.compat)  # right token inside, but no CURVE keys
    try:
        outsider.send(prefill, outsider.layout())
        outsider.meta(prefill, mint_room(), mint_rid(), [0, 1])
        time.sleep(1.0)
        assert outsider.seen == []  # no LayoutAck, no Status: nothing got through
    finally:
        outsider.close()
    assert staged.stats("prefill-0") == before
    insider = RogueDecode(staged.token, info.compat, curve=cluster_keys(staged.token))
    try:
        assert insider.register(prefill).accepted
    finally:
        insider.close()
    staged.assert_clean()
