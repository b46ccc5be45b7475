"""Real vLLM engines with our connector over tcp: a prefill and a decode, both legs sent at once.

One prefill (kv_producer) and one decode (kv_consumer, `kv_load_failure_policy:
fail`) of the same tiny model, in vLLM's CPU build, started once for the
module. The colocated reference is the prefill engine serving the same
prompt alone (greedy, float32). The module ends with the prefill killed and
restarted, so that test runs last.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.ports import free_ports
from pdcluster.runtime.transfer.identity import identity_key, prove
from tests.engine.testing import write_random_hf_dir
from tests.faults.harness import wait_until
from tests.faults.rogue import RogueDecode, RoguePrefill, fetch_instance
from tests.faults.test_garbage import FAKE_SENDER, ROUTING_ID
from tests.vllm_connector.engines import TOKEN, connector, restart, start_engines, stop_all
from tests.vllm_connector.pd_client import PDPair, prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TRANSFER = {"backend": "tcp", "checksum": True, "bootstrapTimeoutSeconds": 20}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-tcp")
    model = write_random_hf_dir(
        root / "model", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512
    )
    p_port, d_port, rogue_port = free_ports(3)
    engines = start_engines(
        {
            "prefill": {
                "model": str(model),
                "role": "kv_producer",
                # Its pod's uid on Kubernetes (PDCLUSTER_INCARNATION); given here.
                "extra": connector("kv_producer", p_port, TRANSFER, incarnation="prefill-a"),
            },
            "decode": {
                "model": str(model),
                "role": "kv_consumer",
                "failure_policy": "fail",
                "extra": connector(
                    "kv_consumer",
                    d_port,
                    TRANSFER,
                    prefillPeers=[f"127.0.0.1:{p_port}", f"127.0.0.1:{rogue_port}"],
                ),
            },
        },
        root,
    )
    state = {"engines": engines, "root": root, "rogue_port": rogue_port}
    yield state
    stop_all(state["engines"].values())


@pytest.fixture
def pair(cluster: dict[str, Any]) -> PDPair:
    engines = cluster["engines"]
    return PDPair(engines["prefill"], engines["decode"])


def test_pd_output_equals_colocated_token_for_token(pair: PDPair) -> None:
    # Shorter than a page, a page and a half, and several pages: vLLM's CPU
    # pages move whole, the last one once the prompt is computed.
    for prompt in prompts([5, 45, 100, 300], seed=1):
        want = pair.colocated(prompt, 10)
        got = pair.pd(prompt, 10)
        assert got["finish_reason"] == "length" and got["tokens"] == want
    pair.assert_clean()
    assert pair.decode_failures() == {}


def test_prompts_sharing_a_prefix_reuse_the_decodes_cache_and_move_fewer_bytes(
    pair: PDPair,
) -> None:
    (first,) = prompts([200], seed=2)
    (tail,) = prompts([40], seed=3)
    second = first[:160] + tail  # five whole pages in common
    before = pair.counters()
    assert pair.pd(first, 6)["tokens"] == pair.colocated(first, 6)
    middle = pair.counters()
    assert pair.pd(second, 6)["tokens"] == pair.colocated(second, 6)
    after = pair.counters()
    # vLLM's own cache held the shared pages: decode asked prefill for the rest only.
    assert middle["reused_tokens"] - before["reused_tokens"] == 0
    assert after["reused_tokens"] - middle["reused_tokens"] == 160
    assert after["loaded_tokens"] - middle["loaded_tokens"] == 40
    # and prefill moved a fifth of the bytes (whole pages: 2 of 7, then 7).
    first_bytes = middle["kv_sent_bytes"] - before["kv_sent_bytes"]
    second_bytes = after["kv_sent_bytes"] - middle["kv_sent_bytes"]
    assert 0 < second_bytes * 3 < first_bytes
    pair.assert_clean()


def test_a_client_leaving_ends_both_legs_and_no_room_or_block_is_left(pair: PDPair) -> None:
    (prompt,) = prompts([400], seed=4)
    # The decode leg waits for KV (its prefill leg comes late); the client leaves.
    room = pair.new_room()
    pair.decode.add("gone-d", prompt, 8, pair.params(room))
    wait_until(lambda: pair.decode_rooms(), 10, 0.05, "the decode's room to open")
    pair.decode.send(op="abort", id="gone-d")
    pair.decode.wait("aborted", rid="gone-d")
    # ... and a pair aborted on both legs right after they were sent.
    room = pair.new_room()
    pair.prefill.add("both-p", prompt, 1, pair.params(room))
    pair.decode.add("both-d", prompt, 8, pair.params(room))
    pair.prefill.send(op="abort", id="both-p")
    pair.decode.send(op="abort", id="both-d")
    pair.assert_clean()  # every block back, no room on either side
    failures = pair.decode_failures()
    assert failures.get("room_failed:aborted", 0) >= 1
    # The engines serve on.
    (after,) = prompts([60], seed=5)
    assert pair.pd(after, 6)["tokens"] == pair.colocated(after, 6)


def test_forged_layouts_wrong_tokens_and_garbage_are_refused_and_counted(
    pair: PDPair, cluster: dict[str, Any]
) -> None:
    side = pair.prefill.side
    instance = fetch_instance(("127.0.0.1", pair.prefill.side_port), TOKEN)
    (rank,) = instance.ranks
    real = instance.compat
    # The side port: wrong or missing token, garbage bodies.
    wrong = {"authorization": "Bearer nope"}
    assert side.put("/route", content=b"{", headers=wrong).status_code == 403
    assert side.put("/route", content=b"{not json").status_code == 400
    assert side.post("/admin/fail_peer", content=b"[1]").status_code == 422
    with httpx.Client(base_url=pair.decode.side_url, trust_env=False) as open_client:
        assert open_client.post("/admin/fail_peer", json={"peer": "x:1"}).status_code == 401
        assert open_client.get("/admin/rooms").status_code == 401
    # A decode rank of another engine registers a layout that does not fit
    # (our engine's NHD pages, another head size): refused, naming both.
    geometry = {"layer_end": real.num_layers, "head_end": real.num_kv_heads}
    mismatched = msgspec.structs.replace(real, kv_layout="NHD", head_dim=128)
    with RogueDecode(TOKEN, mismatched) as rogue:
        ack = rogue.register(rank.endpoint, **geometry)
        assert not ack.accepted
        assert "kv_layout mismatch" in (ack.reason or "")
        assert "head_dim mismatch" in (ack.reason or "")
    # One that does not hold the token cannot even be heard.
    with RogueDecode("wrong-token", real) as rogue:
        rogue.send(rank.endpoint, rogue.layout(**geometry))
        time.sleep(1.0)
        assert not any(isinstance(m, pdmsg.LayoutAck) for m in rogue.seen)
    # Garbage on the rank's ZMQ endpoint.
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, ROUTING_ID)
        sock.connect(rank.endpoint)
        # An insider's proof (it holds the token), so the rank's own decoder sees it.
        proof = prove(identity_key(TOKEN), ROUTING_ID, FAKE_SENDER)
        sock.send_multipart([b"C", FAKE_SENDER, proof, b"\x00garbage" * 8])
        sock.send_multipart([b"X", b"a", b"b"])
        time.sleep(0.2)
    finally:
        ctx.destroy(linger=0)
    wanted = ("reject:bad_magic", "endpoint:unknown_kind", "endpoint:bad_proof")
    wanted += ("dropped:incompatible",)

    def counted() -> dict[str, int] | None:
        # A rank's counters reach the scheduler with its steps: keep it stepping.
        pair.colocated([3, 4, 5], 1)
        stats = pair.prefill_stats()
        return stats if all(stats.get(k, 0) >= 1 for k in wanted) else None

    try:
        wait_until(counted, 30, 0.5, "the prefill rank to count what it refused")
    except AssertionError:
        raise AssertionError(f"counted so far: {pair.prefill_stats()}") from None
    # A decode room whose prefill publishes another layout fails at /route, naming it.
    other = msgspec.structs.replace(real, kv_layout="NHD")
    with RoguePrefill(TOKEN, other, port=cluster["rogue_port"]):
        (prompt,) = prompts([50], seed=6)
        params = pair.params(pair.new_room(), cluster["rogue_port"])
        assert pair.decode_alone(prompt, 4, params)["error"]
    assert pair.decode_failures().get("room_failed:incompatible") == 1
    # Nothing else was disturbed.
    (prompt,) = prompts([80], seed=7)
    assert pair.pd(prompt, 6)["tokens"] == pair.colocated(prompt, 6)
    pair.assert_clean()


def test_a_prefill_killed_while_decode_waits_fails_the_room_at_the_report(
    pair: PDPair, cluster: dict[str, Any]
) -> None:
    """kill -9 of the prefill; the operator's report naming the pod's incarnation
    ends the waiting decode leg with an error and frees its blocks, well
    before any timeout (bench/vllm_connectors.py times it), where a report
    about an incarnation the decode never saw there changed nothing; decode
    serves on, and once the prefill is back the next pair succeeds: no stale
    peer state."""
    (prompt,) = prompts([1500], seed=8)
    room = pair.new_room()
    pair.decode.add("waits", prompt, 8, pair.params(room))
    wait_until(lambda: pair.decode_rooms(), 10, 0.05, "the decode's room to open")
    pair.prefill.kill()
    peer = f"127.0.0.1:{pair.prefill.side_port}"
    # Reports reach every rank in order: the unseen one first, then the pod's.
    for reason, incarnation in (("unseen_start", "prefill-0"), ("prefill_pod_lost", "prefill-a")):
        resp = pair.decode.side.post(
            "/admin/fail_peer",
            json={"peer": peer, "reason": reason, "gone": True, "incarnation": incarnation},
        )
        assert resp.status_code == 200
    ended = pair.decode.wait("done", 10, rid="waits")
    assert ended["error"] and ended["tokens"] == []
    pair.assert_decode_clean()
    failures = pair.decode_failures()
    assert failures.get("room_failed:prefill_pod_lost") == 1
    assert "room_failed:unseen_start" not in failures
    (local,) = prompts([30], seed=9)
    assert not pair.decode.generate("local", local, 4)["error"]  # decode serves on
    # The prefill comes back (a new process, same side port): the next pair works.
    pair.prefill.config["extra"]["incarnation"] = "prefill-b"  # a new pod
    fresh = restart(pair.prefill, cluster["root"])
    cluster["engines"]["prefill"] = fresh
    # As the router does: the prefill is a candidate again once the decode no
    # longer reports it down (the report's verdict lasts the bootstrap
    # timeout); the idle decode's rank sends the change itself.
    wait_until(
        lambda: peer not in pair.decode.side.get("/get_server_info").json()["peers_down"],
        60,
        0.2,
        "the decode to stop reporting the prefill down",
    )
    back = PDPair(fresh, pair.decode)
    (prompt,) = prompts([120], seed=10)
    assert back.pd(prompt, 6)["tokens"] == back.colocated(prompt, 6)
    back.assert_clean()
