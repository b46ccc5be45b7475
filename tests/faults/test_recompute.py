"""`failurePolicy: recompute` and the KV checksum under faults, workers and router.

The `recompute` cluster of this module runs tcp with `failurePolicy:
recompute` and `checksum: true`: a corrupted KV frame or a prefill killed
in the middle of its transfers still ends in the colocated output — straight
at the workers and through the router, streaming or not, because under this
policy the router leaves a failed prefill leg to decode instead of aborting
it. The shared `fail` cluster (`pd`) shows the contrast: the same loss is a
fast, readable 502 there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.transfer.checksum import compute_checksum
from tests.faults.harness import (
    FaultCluster,
    PDClient,
    PDResult,
    base_spec,
    heartbeat_bound,
    make_prompts,
    parse_counter,
    run_all_equal_colocated,
    wait_until,
)
from tests.faults.rogue import Background, RoguePrefill, fetch_instance
from tests.pd_integration.reference import colocated_outputs

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def recompute(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    tmp: Path = tmp_path_factory.mktemp("recompute")
    spec = base_spec(failurePolicy="recompute", checksum=True)
    with FaultCluster(tmp, "faults-recompute", spec) as cluster:
        yield cluster


def test_checksummed_transfers_equal_colocated(recompute: FaultCluster, client: PDClient) -> None:
    prompts = make_prompts(6, seed=121, lo=1, hi=1500)
    run_all_equal_colocated(recompute, client, prompts, MAX_TOKENS)
    stats = recompute.info("decode-0")["kv_receive_stats"]
    assert stats.get("accepted", 0) >= len(prompts)
    assert not any("checksum" in k for k in stats)
    pd_stats = recompute.stats("decode-0")
    assert not any("checksum" in k for k in pd_stats), pd_stats
    # The transfer is visible in both workers' metrics, and no room failed (this
    # cluster's first scenario: nothing failed before it either).
    for name, direction in (("decode-0", "in"), ("prefill-0", "out")):
        text = recompute.http.get(recompute.url(name) + "/metrics").text
        moved = parse_counter(text, "pdcluster_transfer_bytes", "direction")
        assert moved.get(direction, 0) > 0, text
        assert "pdcluster_transfer_seconds_count" in text
        assert 'pdcluster_rooms{state="failed"} 0.0' in text
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
        assert recompute.abort("decode-0", meta.rid)["found"] is True
        res: PDResult = leg.result(10)
        assert not res.decode.ok or res.decode.body["meta_info"]["finish_reason"]["type"] == "abort"
        assert recompute.failures("decode-0").get("recomputed", 0) == before
        rogue.expect(pdmsg.Abort, meta.room)
        rogue.ack(meta.decode_endpoint, meta.room, meta.generation)
        recompute.assert_clean(["decode-0"])
    finally:
        rogue.close()


# ------------------------------------------------------------------ through the router


@dataclass
class RouterAnswer:
    # HTTP status; for a stream that began, the code of its error event (if any).
    status: int
    text: str
    output_ids: list[int]
    error: str
    ended_at: float

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def via_router(endpoint: str, prompt: list[int], stream: bool, timeout: float = 60) -> RouterAnswer:
    """One greedy /generate through the router, as a client sees it."""
    body = {
        "input_ids": prompt,
        "stream": stream,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
    }
    with httpx.Client(timeout=timeout, trust_env=False) as http:
        if not stream:
            resp = http.post(endpoint + "/generate", json=body)
            data = resp.json()
            error = data.get("error") or {}
            return RouterAnswer(
                resp.status_code,
                data.get("text", ""),
                data.get("output_ids", []),
                str(error.get("message", "")) if error else "",
                time.monotonic(),
            )
        with http.stream("POST", endpoint + "/generate", json=body) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
            status = resp.status_code
        if status != 200:
            return RouterAnswer(status, "", [], " ".join(lines) or "no body", time.monotonic())
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
        events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        errors = [e["error"]["message"] for e in events if "error" in e]
        codes = [int(e["error"].get("code", 502)) for e in events if "error" in e]
        last = events[-1]
        return RouterAnswer(
            codes[0] if codes else 200,
            last.get("text", ""),
            last.get("output_ids", []),
            "; ".join(errors),
            time.monotonic(),
        )


def router_counter(cluster: FaultCluster, metric: str, label: str) -> dict[str, float]:
    return parse_counter(httpx.get(cluster.endpoint + "/metrics").text, metric, label)


def wait_transfers_from(cluster: FaultCluster, prefill: str) -> None:
    """Until a decode receives KV from `prefill` while another of its rooms still waits."""
    peer = cluster.peer(prefill)

    def busy() -> bool:
        for decode in cluster.workers("decode"):
            rooms = [r for r in cluster.rooms(decode) if peer in r["peers"]]
            live = [r for r in rooms if r["state"] != "Failed"]
            if len(live) >= 2 and any(r["state"] == "Transferring" for r in live):
                return True
        return False

    wait_until(busy, 30, 0.01, f"transfers from {prefill} in flight")


@pytest.mark.slow
def test_killed_prefill_is_recomputed_through_the_router(recompute: FaultCluster) -> None:
    prompts = make_prompts(6, seed=123, lo=2500, hi=4000)
    expected = colocated_outputs(recompute.manifest, prompts, MAX_TOKENS)
    streams = [i % 2 == 1 for i in range(len(prompts))]
    before = recompute.failures("decode-0")
    decode_aborts = router_counter(recompute, "pdcluster_router_aborts_sent", "role").get(
        "decode", 0
    )
    traffic = [
        Background(via_router, recompute.endpoint, p, s)
        for p, s in zip(prompts, streams, strict=True)
    ]
    wait_transfers_from(recompute, "prefill-0")
    recompute.kill("prefill-0")
    answers: list[RouterAnswer] = [t.result(90) for t in traffic]
    tokenizer = ByteTokenizer()
    for i, (answer, want) in enumerate(zip(answers, expected, strict=True)):
        kind = "stream" if streams[i] else "non-stream"
        assert answer.ok, f"{kind} request {i}: {answer.status} {answer.error}"
        assert answer.output_ids == want, f"{kind} request {i}: output != colocated"
        assert answer.text == tokenizer.decode(want), f"{kind} request {i}: text != colocated"
    # Decode detected the loss, recomputed those rooms, and the router let it.
    failures = recompute.failures("decode-0")
    lost = failures.get("prefill_unreachable", 0) - before.get("prefill_unreachable", 0)
    assert lost >= 1
    recomputed = failures.get("recomputed", 0) - before.get("recomputed", 0)
    assert recomputed >= lost
    legs = router_counter(recompute, "pdcluster_router_leg_failures", "role")
    assert legs.get("prefill", 0) >= 1
    aborts = router_counter(recompute, "pdcluster_router_aborts_sent", "role")
    assert aborts.get("decode", 0) == decode_aborts
    recompute.assert_clean(["decode-0"])


@pytest.mark.slow
def test_killed_prefill_fails_fast_through_the_router_under_fail(pd: FaultCluster) -> None:
    prompts = make_prompts(8, seed=124, lo=2500, hi=4000)
    expected = colocated_outputs(pd.manifest, prompts, MAX_TOKENS)
    streams = [i % 2 == 1 for i in range(len(prompts))]
    traffic = [
        Background(via_router, pd.endpoint, p, s) for p, s in zip(prompts, streams, strict=True)
    ]
    wait_transfers_from(pd, "prefill-1")
    killed_at = time.monotonic()
    pd.kill("prefill-1")
    answers: list[RouterAnswer] = [t.result(90) for t in traffic]
    by_router = 0
    for i, (answer, want) in enumerate(zip(answers, expected, strict=True)):
        if answer.ok:
            assert answer.output_ids == want, f"request {i}: output != colocated"
            continue
        # The HTTP status, or the code of the stream's error event.
        assert answer.status == 502, f"request {i}: {answer.status} {answer.error}"
        # Mostly the router's own verdict on the broken prefill leg; a request
        # whose prefill leg had already answered fails at decode, by name.
        assert "prefill worker failed" in answer.error or "kv transfer failed" in answer.error
        by_router += "prefill worker failed" in answer.error
        # The router's prefill leg sees the connection drop at once; a room past
        # its prefill leg fails by decode's heartbeat: either well before the
        # room timeouts.
        took = answer.ended_at - killed_at
        assert took <= heartbeat_bound(pd), f"request {i} failed {took:.2f}s after the kill"
    assert by_router >= 1, "no request was on the killed prefill"
    pd.assert_clean(["prefill-0", "decode-0", "decode-1"])
