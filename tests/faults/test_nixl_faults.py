"""The fault suite's transfer scenarios on `transfer.backend: nixl`.

One cluster for the module (`nixl_pd`: two prefill instances, one decode,
a short release timeout): prefill-0 serves the survivors, prefill-1 is
killed and hung. The invariants are the suite's (docs/design.md §14): the
lost rooms fail within the heartbeat bound, a page a NIXL writer may still
reach is freed only by its ack or a definitive verdict, survivors equal
colocated output and every worker gets all its pages back. The room rules
(abort in every KVPoll state, stale generations, duplicate rooms) run the
tcp's tests against this cluster (duplicate rooms) or, where a
one-sided writer is owed other rules (ABORT sent again until acked), a
version of their own.

Start-up allowance: the fixture sends one request through every prefill →
decode pair before the first scenario (with the harness's start-up
timeout), so the first contact of two agents (metadata, UCX wire-up) is
paid there, never inside a scenario's bounds. The prompts of the first
scenario fit the decode's pages at once: the shm module's five-prompt case
needs more pages than the pool holds and leans on admission waits within
`bootstrapTimeoutSeconds`, which is not what this module is about.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import InstanceShape
from pdcluster.runtime.pd.kvpoll import KVPoll
from tests.faults import test_cancellation, test_room_rules
from tests.faults.conftest import make_ready
from tests.faults.harness import (
    FaultCluster,
    PDClient,
    PDResult,
    abort_decode_leg,
    base_spec,
    heartbeat_bound,
    held_pages,
    make_prompts,
    mint_rid,
    one_sided_victims,
    run_all_equal_colocated,
    survivors_served,
    wait_until,
)
from tests.faults.rogue import Background, RoguePrefill, fetch_instance
from tests.transfer.nixl_helpers import need_nixl

MAX_TOKENS = 4
PAGE = 16
START_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def nixl_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    need_nixl()
    tmp: Path = tmp_path_factory.mktemp("nixl")
    spec = base_spec(backend="nixl", abortReleaseTimeoutSeconds=1.0)
    spec["kvCache"]["numPages"] = 448
    spec["prefill"]["replicas"] = 2
    with FaultCluster(tmp, "faults-nixl", spec) as cluster:
        warm_up(cluster)
        yield cluster


def warm_up(cluster: FaultCluster) -> None:
    """One request through every prefill -> decode pair, off the scenarios' clocks."""
    client = PDClient()
    try:
        for prefill in cluster.workers("prefill"):
            for decode in cluster.workers("decode"):
                res = client.pair(cluster, prefill, decode, [7] * 40, timeout=START_TIMEOUT_S)
                assert res.decode.ok, f"warm-up {prefill} -> {decode}: {res.decode.error}"
    finally:
        client.close()
    cluster.assert_clean()


@pytest.fixture
def nixl_pd(nixl_cluster: FaultCluster) -> FaultCluster:
    """The module's cluster with every worker alive, resumed and healthy."""
    return make_ready(nixl_cluster)


@pytest.fixture
def nixl_compat(nixl_pd: FaultCluster) -> CompatInfo:
    return fetch_instance(nixl_pd.bootstrap("prefill-0"), nixl_pd.token).compat


def test_nixl_transfers_equal_colocated(nixl_pd: FaultCluster, client: PDClient) -> None:
    prompts = make_prompts(5, seed=131, lo=1, hi=1300)
    run_all_equal_colocated(nixl_pd, client, prompts, MAX_TOKENS)
    info = nixl_pd.info("prefill-0")["kv_transport"]
    assert info["backend"] == "nixl" and info["writes"]["prepped_writes"] >= 1
    nixl_pd.assert_clean()


def test_sigstopped_nixl_writer_keeps_its_pages_until_it_acks(
    nixl_pd: FaultCluster, client: PDClient
) -> None:
    traffic = one_sided_victims(nixl_pd, client, seed=154)
    nixl_pd.hang("prefill-1")
    hung_at = time.monotonic()
    peer = nixl_pd.peer("prefill-1")

    def failed() -> bool:
        rooms = [r for r in nixl_pd.rooms("decode-0") if peer in r["peers"]]
        return bool(rooms) and all(r["state"] == "Failed" for r in rooms)

    bound = heartbeat_bound(nixl_pd)
    wait_until(failed, bound + 5, 0.01, "the hung writer's rooms to fail")
    assert time.monotonic() - hung_at <= bound
    held = held_pages(nixl_pd, "decode-0")
    assert held > 0
    time.sleep(nixl_pd.manifest.spec.transfer.abort_release_timeout_seconds + 1)
    assert held_pages(nixl_pd, "decode-0") == held, "pages a hung writer may reach were freed"
    survivors_served(nixl_pd, client, seed=155)
    # It resumes, reads the ABORTs, waits for its WRITE handles and acks.
    nixl_pd.cont("prefill-1")
    for res in traffic.result(30):
        assert res.decode.ok or "prefill_unreachable" in res.decode.error, res.decode.error
    nixl_pd.assert_clean(timeout=10)


def test_abort_mid_write_frees_pages_only_after_the_writer_drained(
    nixl_pd: FaultCluster, client: PDClient
) -> None:
    """Poison, end to end: decode aborts a room prefill-0 is WRITE-ing; its pages come
    back (by the ack: a one-sided release never times out) and the next rooms,
    reusing them, decode exactly their colocated output."""
    prompt = make_prompts(1, seed=157, lo=3200, hi=3500)[0]
    rid = mint_rid()
    leg = Background(
        client.generate,
        nixl_pd.url("prefill-0"),
        nixl_pd.url("decode-0"),
        nixl_pd.bootstrap("prefill-0"),
        prompt,
        MAX_TOKENS,
        rid=rid,
        propagate=False,
    )

    def transferring() -> bool:
        return any(
            r["rid"] == rid and r["state"] == "Transferring" for r in nixl_pd.rooms("decode-0")
        )

    wait_until(transferring, 30, 0.005, "prefill-0 writing the room into decode-0")
    assert nixl_pd.abort("decode-0", rid)["found"] is True
    res: PDResult = leg.result(30)
    assert res.decode.status == 502 and "aborted" in res.decode.error
    nixl_pd.assert_clean(["decode-0", "prefill-0"], timeout=5)
    survivors_served(nixl_pd, client, seed=158)
    nixl_pd.assert_clean()


@pytest.mark.parametrize("state", test_cancellation.DECODE_STATES)
def test_decode_abort_in_each_state(
    nixl_pd: FaultCluster, client: PDClient, nixl_compat: CompatInfo, state: str
) -> None:
    """Abort by rid in each KVPoll state: a notified writer gets ABORT(room, generation)
    — again and again until it acks, as a one-sided writer must — the pages stay held
    past the release timeout, a stale ack frees nothing, the ack frees them."""
    shape = InstanceShape(tp=2) if state == "Bootstrapping" else None
    rogue = RoguePrefill(nixl_pd.token, nixl_compat, shape=shape)
    prompt = make_prompts(1, seed=161, lo=40, hi=40)[0]
    num_pages = math.ceil(len(prompt) / PAGE)
    release_s = nixl_pd.manifest.spec.transfer.abort_release_timeout_seconds
    try:
        leg = Background(
            client.generate, None, nixl_pd.url("decode-0"), rogue.bootstrap, prompt, 300,
            timeout=30,
        )  # fmt: skip
        meta: pdmsg.TransferMeta | None = None
        if state == "Bootstrapping":
            wait_until(lambda: nixl_pd.rooms("decode-0"), 10, what="the decode room")
            time.sleep(0.3)  # a few /route retries
            (room_view,) = nixl_pd.rooms("decode-0")
            assert room_view["state"] == "Bootstrapping"
            rid = room_view["rid"]
        else:
            _, meta = rogue.expect(pdmsg.TransferMeta)
            rid = meta.rid
            if state == "Transferring":
                rogue.status(meta, KVPoll.Transferring)
            elif state == "Success":
                rogue.status(meta, KVPoll.Success, first_token=7)
            room = meta.room
            if state == "Success":  # handed to the engine: decoding 300 tokens
                wait_until(lambda: nixl_pd.room_state("decode-0", room) is None, 5)
            else:
                wait_until(lambda: nixl_pd.room_state("decode-0", room) == state, 5, what=state)
        result = abort_decode_leg(nixl_pd, rid, leg, state)
        if meta is None or state == "Success":
            # No writer holds these pages: nothing to wait for.
            assert rogue.quiet(pdmsg.Abort, result.room, 0.3)
            nixl_pd.assert_clean(["decode-0"], timeout=5)
            return
        _, msg = rogue.expect(pdmsg.Abort, meta.room, timeout=5)
        assert (msg.generation, msg.rid) == (meta.generation, meta.rid)
        time.sleep(release_s + 0.5)  # the release timer frees nothing one-sided
        assert held_pages(nixl_pd, "decode-0") == num_pages
        rogue.ack(meta.decode_endpoint, meta.room, meta.generation - 1)  # stale
        time.sleep(0.3)
        assert held_pages(nixl_pd, "decode-0") == num_pages
        assert nixl_pd.room_state("decode-0", meta.room) == "Failed"
        aborts = [m for m in rogue.seen if isinstance(m, pdmsg.Abort)]
        assert len(aborts) >= 2, "an unacked one-sided ABORT is sent again"
        assert {(m.room, m.generation) for m in aborts} == {(meta.room, meta.generation)}
        rogue.ack(meta.decode_endpoint, meta.room, meta.generation)
        # Only the ack can free them: one-sided, the release timer frees nothing (held
        # past it above), and no peer verdict comes. So no latency bound is needed.
        nixl_pd.assert_clean(["decode-0"], timeout=5)
        num_aborts = len([m for m in rogue.seen if isinstance(m, pdmsg.Abort)])
        time.sleep(release_s)
        assert len([m for m in rogue.seen if isinstance(m, pdmsg.Abort)]) == num_aborts
    finally:
        rogue.close()


def test_duplicate_room_on_decode_is_refused(
    nixl_pd: FaultCluster, client: PDClient, nixl_compat: CompatInfo
) -> None:
    test_room_rules.test_duplicate_room_on_decode_is_refused(nixl_pd, client, nixl_compat)


def test_duplicate_room_on_prefill_is_refused(nixl_pd: FaultCluster) -> None:
    test_room_rules.test_duplicate_room_on_prefill_is_refused(nixl_pd)


# Last: prefill-1 stays dead, so no scenario after it pays for a restart.
def test_kill9_nixl_writer_mid_transfer(nixl_pd: FaultCluster, client: PDClient) -> None:
    """kill -9 prefill-1 while it WRITEs into decode-0: its rooms fail within the heartbeat
    bound, the pages wait for a definitive verdict (never a timer), survivors are clean."""
    traffic = one_sided_victims(nixl_pd, client, seed=151)
    killed_at = time.monotonic()
    nixl_pd.kill("prefill-1")
    results: list[PDResult] = traffic.result(30)
    for res in results:
        if not res.decode.ok:
            assert "prefill_unreachable" in res.decode.error, res.decode.error
            assert res.decode.ended_at - killed_at <= heartbeat_bound(nixl_pd)
    assert not all(r.decode.ok for r in results), "every victim finished before the kill"
    held = held_pages(nixl_pd, "decode-0")
    assert held > 0
    time.sleep(nixl_pd.manifest.spec.transfer.abort_release_timeout_seconds + 1)
    assert held_pages(nixl_pd, "decode-0") == held
    survivors_served(nixl_pd, client, seed=152)
    resp = nixl_pd.fail_peer("decode-0", nixl_pd.peer("prefill-1"), "pod_deleted")
    assert resp.status_code == 200
    nixl_pd.assert_clean(["decode-0"], timeout=2)
