"""A prefill declared dead by the heartbeat that answers again is used at once.

The heartbeat runs slowly here (5 s × 2) so that its next regular probe is
seconds away: requests sent right after the prefill resumes must succeed
through the one probe their rooms wait for, long before that regular probe
would have revived the prefill. Before this, they failed with 502
`prefill_unreachable` although the prefill was healthy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import FaultCluster, PDClient, base_spec, make_prompts, wait_until
from tests.pd_integration.reference import colocated_outputs

INTERVAL_S, THRESHOLD = 5.0, 2
PROBE_TIMEOUT_S = 1.0  # min(interval / 2, 1 s)
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def slow_heartbeat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    spec = base_spec(heartbeat={"intervalSeconds": INTERVAL_S, "failureThreshold": THRESHOLD})
    tmp: Path = tmp_path_factory.mktemp("slow-heartbeat")
    with FaultCluster(tmp, "faults-slow-hb", spec) as cluster:
        yield cluster


@pytest.mark.slow
def test_resumed_prefill_serves_new_requests_without_waiting_for_the_next_probe(
    slow_heartbeat: FaultCluster, client: PDClient
) -> None:
    pd = slow_heartbeat
    prompts = make_prompts(3, seed=71, lo=1, hi=300)
    expected = colocated_outputs(pd.manifest, prompts, MAX_TOKENS)

    first = client.pair(pd, "prefill-0", "decode-0", prompts[0], MAX_TOKENS)
    assert first.decode.ok, first.decode.error  # decode now watches the prefill
    peer = pd.peer("prefill-0")
    dead_before = pd.stats("decode-0").get("peer_dead", 0)
    held_before = pd.stats("decode-0").get("room_held_for_probe", 0)

    pd.hang("prefill-0")
    try:
        wait_until(
            lambda: peer in pd.info("decode-0")["peers_down"],
            THRESHOLD * INTERVAL_S + PROBE_TIMEOUT_S + 2,
            0.02,
            "the heartbeat verdict on the hung prefill",
        )
        declared_at = time.monotonic()
    finally:
        pd.cont("prefill-0")
    # The verdict's probe started a probe timeout before it: the next regular
    # probe is due INTERVAL_S after that start, i.e. at least this much later.
    next_regular = declared_at - 0.1 + INTERVAL_S - PROBE_TIMEOUT_S

    results = client.many(
        [lambda p=p: client.pair(pd, "prefill-0", "decode-0", p, MAX_TOKENS) for p in prompts]
    )
    for res, want in zip(results, expected, strict=True):
        assert res.decode.ok, f"{res.decode.status} {res.decode.error}"
        assert res.decode.output_ids == want
        assert res.decode.ended_at < next_regular - 1.0, (
            f"served {res.decode.ended_at - declared_at:.2f}s after the verdict: "
            "it waited for the regular probe"
        )
    stats = pd.stats("decode-0")
    assert stats.get("peer_dead", 0) == dead_before + 1
    # They went through the hold (the verdict stood when they arrived), not around it.
    assert stats.get("room_held_for_probe", 0) > held_before
    assert peer not in pd.info("decode-0")["peers_down"]
    assert pd.failures("decode-0").get("prefill_unreachable", 0) == 0
    pd.assert_clean()
