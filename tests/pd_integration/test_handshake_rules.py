"""The two legs of a request must agree before a byte moves — real processes.

- dp group: `examples/pd-prefill-dp2.yaml` (prefill dp=2). A `data_parallel_rank`
  other than `room % 2` fails at once on both legs with a 400 naming both
  values (before, decode sent its metadata to the other group and both legs
  waited for the 30 s bootstrap timeout); an agreeing one is served, output
  equal to colocated; the router drops a client's field.
- prompt: legs holding different token ids fail at once on both sides with a
  reason naming both lengths, pages and rooms returned.
- tokenizer: a decode worker serving another tokenizer fails every request at
  its handshake, the fingerprint check naming the tokenizer as the difference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdcluster.runtime.local.launcher import LocalCluster
from tests.engine.testing import write_tokenizer_dir
from tests.faults.harness import (
    FaultCluster,
    LegResult,
    base_spec,
    gen_body,
    mint_rid,
    mint_room,
    post_leg,
    router_generate,
)
from tests.pd_integration.reference import colocated_outputs

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [11, 42, 7, 200, 5, 19, 88, 3, 64, 150, 9, 31]  # 12 tokens
MAX_TOKENS = 4
# Both legs must answer well inside the 30 s bootstrap timeout of the example.
FAST_S = 5.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    doc = yaml.safe_load((ROOT / "examples" / "pd-prefill-dp2.yaml").read_text())
    with FaultCluster(tmp_path_factory.mktemp("dp2"), "handshake-dp2", doc["spec"]) as cluster:
        yield cluster


def room_in_group(group: int, dp: int = 2) -> int:
    while True:
        room = mint_room()
        if room % dp == group:
            return room


def both_legs(
    cluster: FaultCluster, prefill_body: dict[str, Any], decode_body: dict[str, Any]
) -> tuple[LegResult, LegResult]:
    with ThreadPoolExecutor(2) as pool:
        pre = pool.submit(post_leg, cluster.url("prefill-0"), prefill_body, 60.0)
        dec = pool.submit(post_leg, cluster.url("decode-0"), decode_body, 60.0)
        return pre.result(), dec.result()


def body_for(cluster: FaultCluster, prompt: list[int], room: int, rid: str) -> dict[str, Any]:
    return gen_body(
        prompt, MAX_TOKENS, rid=rid, room=room, bootstrap=cluster.bootstrap("prefill-0")
    )


def test_a_disagreeing_data_parallel_rank_fails_at_once_on_both_legs(dp2: FaultCluster) -> None:
    room = room_in_group(0)
    body = {**body_for(dp2, PROMPT, room, mint_rid()), "data_parallel_rank": 1}
    pre, dec = both_legs(dp2, body, body)
    reason = "dp_rank_conflict: data_parallel_rank 1 != room % 2 = 0"
    for leg in (pre, dec):
        assert leg.status == 400, leg.body
        assert reason in leg.error
        assert leg.elapsed < FAST_S
    # Nothing was reserved or opened on either side.
    dp2.assert_clean(["prefill-0", "decode-0"], timeout=2.0)
    assert "room_failed:bootstrap_timeout" not in dp2.stats("decode-0")


@pytest.mark.parametrize("group", [0, 1])
def test_an_agreeing_data_parallel_rank_is_served_like_colocated(
    dp2: FaultCluster, group: int
) -> None:
    room = room_in_group(group)
    body = {**body_for(dp2, PROMPT, room, mint_rid()), "data_parallel_rank": group}
    pre, dec = both_legs(dp2, body, body)
    assert pre.ok and dec.ok, (pre.body, dec.body)
    assert dec.output_ids == colocated_outputs(dp2.manifest, [PROMPT], MAX_TOKENS)[0]
    dp2.assert_clean(["prefill-0", "decode-0"])


def test_the_router_drops_a_clients_data_parallel_rank(dp2: FaultCluster) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
        "data_parallel_rank": 1,
    }
    expected = colocated_outputs(dp2.manifest, [PROMPT], MAX_TOKENS)[0]
    # The router's rooms fall in both groups: forwarded, the field would
    # conflict with about half of them.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: post_leg(dp2.endpoint, body, 60.0), range(8)))
    for res in results:
        assert res.ok, res.body
        assert res.output_ids == expected


@pytest.mark.parametrize(
    ("decode_prompt", "reason"),
    [
        ([*PROMPT, 77], "prompt_mismatch: prefill has 12 tokens, decode 13"),
        (
            [42, 11, *PROMPT[2:]],
            "prompt_mismatch: prefill and decode both have 12 tokens but different token ids",
        ),
    ],
    ids=["lengths-differ", "ids-differ"],
)
def test_legs_with_different_prompts_fail_at_once_on_both_sides(
    dp2: FaultCluster, decode_prompt: list[int], reason: str
) -> None:
    room, rid = mint_room(), mint_rid()
    pre, dec = both_legs(
        dp2, body_for(dp2, PROMPT, room, rid), body_for(dp2, decode_prompt, room, rid)
    )
    for leg in (pre, dec):
        assert not leg.ok
        assert reason in leg.error, leg.body
        assert leg.elapsed < FAST_S
    dp2.assert_clean(["prefill-0", "decode-0"])


def test_a_decode_with_another_tokenizer_fails_at_the_handshake(tmp_path: Path) -> None:
    cluster = FaultCluster(tmp_path, "handshake-tok", base_spec())
    tokenizer = write_tokenizer_dir(tmp_path / "other-tokenizer")
    workers = tuple(
        dataclasses.replace(w, argv=(*w.argv, "--tokenizer", str(tokenizer)))
        if w.role == "decode"
        else w
        for w in cluster.plan.workers
    )
    cluster.plan = dataclasses.replace(cluster.plan, workers=workers)
    cluster.launcher = LocalCluster(cluster.plan, cluster.state_dir, token=cluster.token)
    with cluster:
        res = router_generate(cluster.endpoint, PROMPT, MAX_TOKENS, timeout=60.0)
        assert not res.ok
        assert "model_fingerprint mismatch" in res.error, res.body
        assert "(differs in: tokenizer)" in res.error
        assert res.elapsed < FAST_S
        cluster.assert_clean(cluster.workers())
