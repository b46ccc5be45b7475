"""Failure policy, KV checksum, one-sided transport and `prefill_complete` under faults.

Two more clusters, each 1 prefill + 1 decode:
- `recompute`: tcp, `failurePolicy: recompute`, `checksum: true` — a lost
  prefill or a corrupted KV frame still ends in the colocated output;
- `one_sided`: `shm` (prefill writes straight into decode's memory) with
  `allocationPolicy: prefill_complete` and a short release timeout — a
  failed room's pages wait for the prefill's acknowledgement however long
  it takes, never for a timer; late BOOTSTRAP meets a tombstone; a decode
  on this policy against an `early` prefill fails by name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.transfer.checksum import compute_checksum
from tests.faults.harness import (
    FaultCluster,
    PDClient,
    PDResult,
    base_spec,
    gen_body,
    make_prompts,
    mint_rid,
    mint_room,
    post_leg,
    wait_until,
)
from tests.faults.rogue import Background, RogueDecode, RoguePrefill, fetch_instance
from tests.faults.test_cancellation import abort
from tests.pd_integration.reference import colocated_outputs

PAGE = 16
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def recompute(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    tmp: Path = tmp_path_factory.mktemp("recompute")
    spec = base_spec(failurePolicy="recompute", checksum=True)
    with FaultCluster(tmp, "faults-recompute", spec) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def one_sided(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    tmp: Path = tmp_path_factory.mktemp("one-sided")
    spec = base_spec(
        backend="shm", allocationPolicy="prefill_complete", abortReleaseTimeoutSeconds=1.0
    )
    spec["kvCache"]["numPages"] = 128
    with FaultCluster(tmp, "faults-one-sided", spec) as cluster:
        yield cluster


def run_all(
    cluster: FaultCluster, client: PDClient, prompts: list[list[int]], timeout: float = 40
) -> list[PDResult]:
    return client.many(
        [
            lambda p=p: client.generate(
                cluster.url("prefill-0"),
                cluster.url("decode-0"),
                cluster.bootstrap("prefill-0"),
                p,
                MAX_TOKENS,
                timeout=timeout,
            )
            for p in prompts
        ]
    )


# ------------------------------------------------------------------ recompute + checksum


def test_checksummed_transfers_equal_colocated(recompute: FaultCluster, client: PDClient) -> None:
    prompts = make_prompts(6, seed=121, lo=1, hi=1500)
    expected = colocated_outputs(recompute.manifest, prompts, MAX_TOKENS)
    results = run_all(recompute, client, prompts)
    assert [r.decode.output_ids for r in results] == expected
    stats = recompute.info("decode-0")["kv_receive_stats"]
    assert stats.get("accepted", 0) >= len(prompts)
    assert not any("checksum" in k for k in stats)
    recompute.assert_clean()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_corrupted_kv_frame_is_caught_before_decoding(
    recompute: FaultCluster, pd: FaultCluster, client: PDClient, policy: str
) -> None:
    cluster = recompute if policy == "recompute" else pd
    compat = fetch_instance(cluster.bootstrap("prefill-0"), cluster.token).compat
    rogue = RoguePrefill(cluster.token, compat)
    prompt = make_prompts(1, seed=122, lo=40, hi=40)[0]
    expected = colocated_outputs(cluster.manifest, [prompt], MAX_TOKENS)[0]
    before = cluster.failures("decode-0")
    try:
        leg = Background(
            client.generate, None, cluster.url("decode-0"), rogue.bootstrap, prompt, MAX_TOKENS
        )
        _, meta = rogue.expect(pdmsg.TransferMeta)
        payload_len = 4 * 2 * len(prompt) * 4 * 32 * 4
        wrong = compute_checksum(bytes(payload_len)) ^ 1
        rogue.send_kv(meta, len(prompt), checksum=wrong, is_last=True)
        res: PDResult = leg.result(20)
        after = cluster.failures("decode-0")
        assert after.get("checksum_mismatch", 0) == before.get("checksum_mismatch", 0) + 1
        if policy == "recompute":
            # Decode computed the prompt itself: the client never noticed.
            assert res.decode.ok, res.decode.error
            assert res.decode.output_ids == expected
            assert after.get("recomputed", 0) == before.get("recomputed", 0) + 1
        else:
            assert res.decode.status == 502 and "checksum_mismatch" in res.decode.error
        _, abort = rogue.expect(pdmsg.Abort, meta.room)
        rogue.ack(meta.decode_endpoint, meta.room, abort.generation)
        cluster.assert_clean(["decode-0"])
    finally:
        rogue.close()


def test_abort_is_not_recomputed(recompute: FaultCluster, client: PDClient) -> None:
    compat = fetch_instance(recompute.bootstrap("prefill-0"), recompute.token).compat
    rogue = RoguePrefill(recompute.token, compat)
    before = recompute.failures("decode-0").get("recomputed", 0)
    try:
        leg = Background(client.generate, None, recompute.url("decode-0"), rogue.bootstrap, [9] * 9)
        _, meta = rogue.expect(pdmsg.TransferMeta)
        assert abort(recompute, "decode-0", meta.rid)["found"] is True
        res: PDResult = leg.result(10)
        assert not res.decode.ok or res.decode.body["meta_info"]["finish_reason"]["type"] == "abort"
        assert recompute.failures("decode-0").get("recomputed", 0) == before
        rogue.expect(pdmsg.Abort, meta.room)
        rogue.ack(meta.decode_endpoint, meta.room, meta.generation)
        recompute.assert_clean(["decode-0"])
    finally:
        rogue.close()


@pytest.mark.slow
def test_lost_prefill_is_recomputed_by_decode(recompute: FaultCluster, client: PDClient) -> None:
    prompts = make_prompts(6, seed=123, lo=2500, hi=4000)
    expected = colocated_outputs(recompute.manifest, prompts, MAX_TOKENS)
    traffic = Background(run_all, recompute, client, prompts)

    def transferring() -> bool:
        rooms = recompute.rooms("decode-0")
        return len(rooms) >= 2 and any(r["state"] == "Transferring" for r in rooms)

    wait_until(transferring, 30, 0.01, "a transfer in flight")
    recompute.kill("prefill-0")
    results: list[PDResult] = traffic.result(60)
    for i, (res, want) in enumerate(zip(results, expected, strict=True)):
        assert res.decode.ok, f"request {i}: {res.decode.error}"
        assert res.decode.output_ids == want, f"request {i}: recomputed output != colocated"
    failures = recompute.failures("decode-0")
    assert failures.get("prefill_unreachable", 0) >= 1
    assert failures.get("recomputed", 0) >= failures.get("prefill_unreachable", 0)
    recompute.assert_clean(["decode-0"])


# ------------------------------------------------------------------ shm + prefill_complete


def test_one_sided_prefill_complete_equals_colocated(
    one_sided: FaultCluster, client: PDClient
) -> None:
    prompts = make_prompts(5, seed=131, lo=1, hi=1500)
    expected = colocated_outputs(one_sided.manifest, prompts, MAX_TOKENS)
    results = run_all(one_sided, client, prompts)
    assert [r.decode.output_ids for r in results] == expected
    one_sided.assert_clean()


def test_one_sided_pages_wait_for_the_ack_not_a_timer(
    one_sided: FaultCluster, client: PDClient
) -> None:
    compat = fetch_instance(one_sided.bootstrap("prefill-0"), one_sided.token).compat
    rogue = RoguePrefill(one_sided.token, compat)
    prompt = [4] * 50
    num_pages = math.ceil(len(prompt) / PAGE)
    try:
        leg = Background(client.generate, None, one_sided.url("decode-0"), rogue.bootstrap, prompt)
        _, boot = rogue.expect(pdmsg.Bootstrap)
        rogue.send(
            boot.decode_endpoint,
            pdmsg.Ready(room=boot.room, generation=boot.generation, rank=rogue.rank),
        )
        _, meta = rogue.expect(pdmsg.TransferMeta, boot.room)
        assert len(meta.dst_pages) == num_pages
        assert abort(one_sided, "decode-0", meta.rid)["found"] is True
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


def test_late_bootstrap_meets_a_tombstone(one_sided: FaultCluster) -> None:
    info = fetch_instance(one_sided.bootstrap("prefill-0"), one_sided.token)
    prefill = info.ranks[0].endpoint
    rogue = RogueDecode(one_sided.token, info.compat)
    rid, room = mint_rid(), mint_room()
    try:
        assert rogue.register(prefill).accepted
        body = gen_body(
            [5] * 40, MAX_TOKENS, rid=rid, room=room, bootstrap=one_sided.bootstrap("prefill-0")
        )
        leg = Background(post_leg, one_sided.url("prefill-0"), body, 20.0)
        wait_until(lambda: one_sided.rooms("prefill-0"), 5, what="the prefill room")
        assert abort(one_sided, "prefill-0", rid)["found"] is True
        assert leg.result(10).status == 502
        one_sided.assert_clean(["prefill-0"], timeout=5)
        rogue.bootstrap_msg(prefill, room, rid)
        _, status = rogue.expect(pdmsg.Status, room)
        assert status.state is KVPoll.Failed and (status.reason or "").startswith("room_closed")
        assert not any(isinstance(m, pdmsg.Ready) for m in rogue.seen)
        one_sided.assert_clean(["prefill-0"])
    finally:
        rogue.close()


def test_allocation_policy_mismatch_names_both(
    one_sided: FaultCluster, pd: FaultCluster, client: PDClient
) -> None:
    # A prefill_complete decode against an early prefill instance.
    res = client.generate(
        pd.url("prefill-0"), one_sided.url("decode-0"), pd.bootstrap("prefill-0"), [3] * 30
    )
    assert res.decode.status == 502
    assert "allocation_policy mismatch: prefill=early, decode=prefill_complete" in res.decode.error
    assert res.prefill is not None and res.prefill.status == 502
    one_sided.assert_clean(["decode-0"])
    pd.assert_clean(["prefill-0"])


def test_prompt_over_page_capacity_is_refused(one_sided: FaultCluster) -> None:
    info = one_sided.info("decode-0")
    capacity = info["num_total_pages"] * PAGE
    prompt = [6] * (capacity + 10)
    assert len(prompt) <= info["max_prompt_tokens"]
    body = gen_body(
        prompt,
        MAX_TOKENS,
        rid=mint_rid(),
        room=mint_room(),
        bootstrap=one_sided.bootstrap("prefill-0"),
    )
    for worker in ("prefill-0", "decode-0"):
        res = post_leg(one_sided.url(worker), body, 10)
        assert res.status == 400, res
        assert res.error
    one_sided.assert_clean(timeout=1)
