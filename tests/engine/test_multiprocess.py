"""TP, PP, CP and DP over real processes (gloo on 127.0.0.1) give TP=1 tokens."""

from __future__ import annotations

import dataclasses

import pytest

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.parallel import spawn_ranks
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from pdcluster.runtime.engine.topology import ParallelConfig
from tests.engine.testing import generate, run_rank, sleep_rank

TOK = ByteTokenizer()
# float64: the all-reduce sums partial products in another order than one
# rank's matmul; in float64 that rounding cannot flip a token.
BASE = EngineConfig(
    compute_dtype="float64", kv_dtype="float64", page_size=4, num_pages=96,
    chunk_size=8, max_batch_tokens=24, max_running_requests=4,
)  # fmt: skip
REQUESTS = [
    EngineRequest("a", TOK.encode("Tensor parallel"), SamplingParams(max_tokens=8)),
    EngineRequest(
        "b", TOK.encode("Pipeline stages hand hidden states on"), SamplingParams(max_tokens=8)
    ),
    EngineRequest(
        "c",
        TOK.encode("seeded"),
        SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True),
    ),
]


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[list[int], str | None]]:
    return generate(LLMEngine(BASE), REQUESTS)


def _run(parallel: ParallelConfig, per_dp: list[list[EngineRequest]]) -> list[object]:
    config = dataclasses.replace(BASE, parallel=parallel)
    return spawn_ranks(run_rank, parallel.world_size, (config, per_dp), timeout_s=120)


@pytest.mark.parametrize("parallel", [ParallelConfig(tp=2), ParallelConfig(pp=2)], ids=str)
def test_two_ranks_match_one(parallel: ParallelConfig, reference: dict[str, object]) -> None:
    results = _run(parallel, [REQUESTS])
    assert results[0] == reference
    assert results[1] is None  # the follower served plans until shutdown, then exited


@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(tp=2, pp=2), ParallelConfig(tp=4), ParallelConfig(cp=2, pp=2)],
    ids=str,
)
def test_four_ranks_match_one(parallel: ParallelConfig, reference: dict[str, object]) -> None:
    results = _run(parallel, [REQUESTS])
    assert results[0] == reference
    assert results[1:] == [None, None, None]


def test_dp_groups_serve_their_own_requests(reference: dict[str, object]) -> None:
    par = ParallelConfig(dp=2, tp=2)
    results = _run(par, [REQUESTS[:1], REQUESTS[1:]])
    leaders = [results[par.rank_of(d, 0, 0, 0)] for d in range(2)]
    assert leaders[0] == {"a": reference["a"]}
    assert leaders[1] == {"b": reference["b"], "c": reference["c"]}


def test_a_failing_rank_is_reported_not_hung() -> None:
    bad = dataclasses.replace(BASE, parallel=ParallelConfig(tp=2), model="/nonexistent/model")
    with pytest.raises(RuntimeError, match="(?s)rank \\d failed.*does not exist"):
        spawn_ranks(run_rank, 2, (bad, [REQUESTS]), timeout_s=60)


def test_a_hanging_rank_times_out_and_every_rank_is_stopped() -> None:
    with pytest.raises(RuntimeError, match="did not finish within 1s"):
        spawn_ranks(sleep_rank, 2, (60.0,), timeout_s=1.0)
    assert spawn_ranks(sleep_rank, 2, (0.0,)) == [0, 1]
