"""Sampling parameters and the batched sampler."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.engine.sampler import SampleSpec, penalise, sample
from pdcluster.runtime.engine.sampling import (
    SamplingError,
    SamplingParams,
    position_seed,
    uniform_for,
)


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int, index: int) -> int:
    """One row sampled alone."""
    return sample(logits.unsqueeze(0), [SampleSpec(params, seed, index)]).tokens[0]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -5}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "0.1"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_invalid_parameters_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(SamplingError, match=rf"sampling_params\.{field}:") as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_from_dict_accepts_sglang_names_and_rejects_unknown_keys() -> None:
    params = SamplingParams.from_dict(
        {"max_new_tokens": 5, "stop": "END", "temperature": 0.5, "top_p": None}
    )
    assert params.max_tokens == 5 and params.stop == ("END",) and params.top_p == 1.0
    with pytest.raises(SamplingError, match="not both"):
        SamplingParams.from_dict({"max_new_tokens": 5, "max_tokens": 6})
    with pytest.raises(SamplingError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(SamplingError, match="must be an object"):
        not_a_mapping: Any = [1, 2]
        SamplingParams.from_dict(not_a_mapping)


LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 0.5, 2.9], dtype=torch.float64)


def test_greedy_and_top_k_one_pick_the_argmax() -> None:
    assert sample_row(LOGITS, SamplingParams(), 0, 0) == 1
    hot_top1 = SamplingParams(temperature=5.0, top_k=1)
    assert {sample_row(LOGITS, hot_top1, seed, 0) for seed in range(50)} == {1}


def test_top_k_draws_only_from_the_k_best() -> None:
    params = SamplingParams(temperature=10.0, top_k=3)
    drawn = {sample_row(LOGITS, params, seed, i) for seed in range(40) for i in range(5)}
    assert drawn == {1, 5, 2}  # the three largest logits, each reached


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.6, 0.25, 0.1, 0.05], dtype=torch.float64))

    def draws(top_p: float) -> set[int]:
        params = SamplingParams(temperature=1.0, top_p=top_p)
        return {sample_row(logits, params, seed, 0) for seed in range(200)}

    assert draws(0.5) == {0}
    assert draws(0.8) == {0, 1}
    assert draws(0.9) == {0, 1, 2}
    assert draws(1.0) == {0, 1, 2, 3}


def test_temperature_sampling_follows_the_softmax() -> None:
    params = SamplingParams(temperature=2.0)
    n = 4000
    counts = torch.zeros(6)
    for i in range(n):
        counts[sample_row(LOGITS, params, 99, i)] += 1
    expected = torch.softmax(LOGITS / 2.0, -1).float()
    assert (counts / n - expected).abs().max().item() < 0.03


def test_a_draw_depends_only_on_seed_and_position() -> None:
    params = SamplingParams(temperature=1.5)
    tokens = [sample_row(LOGITS, params, 7, i) for i in range(30)]
    assert tokens == [sample_row(LOGITS, params, 7, i) for i in range(30)]
    assert tokens != [sample_row(LOGITS, params, 8, i) for i in range(30)]
    assert len({position_seed(7, i) for i in range(1000)}) == 1000
    assert all(0 <= uniform_for(7, i) < 1 for i in range(1000))
    # In a batch next to other rows, a row draws exactly what it draws alone.
    batch = torch.stack([LOGITS.flip(0), LOGITS, LOGITS * 2])
    reqs = [
        SampleSpec(SamplingParams(), 0, 0),
        SampleSpec(params, 7, 3),
        SampleSpec(SamplingParams(temperature=1.0, top_p=0.5), 1, 1),
    ]
    assert sample(batch, reqs).tokens[1] == tokens[3]
    assert sample(batch, reqs).tokens[0] == int(LOGITS.flip(0).argmax())


def test_sample_rejects_a_row_count_mismatch() -> None:
    with pytest.raises(ValueError, match="2 logit rows for 1 requests"):
        sample(torch.zeros(2, 4), [SampleSpec(SamplingParams(), 0, 0)])


_ROW_PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    top_k=st.sampled_from([-1, 1, 5]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    frequency_penalty=st.sampled_from([0.0, 0.5]),
    logprobs=st.sampled_from([None, 0, 3]),
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(_ROW_PARAMS, st.integers(0, 2**63 - 1), st.integers(0, 500)),
        min_size=1,
        max_size=8,
    ),
    data_seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_a_row_samples_the_same_alone_or_in_any_batch(
    rows: list[tuple[SamplingParams, int, int]], data_seed: int, dtype: torch.dtype
) -> None:
    """The token and logprobs of a row depend on its logits, seed, position and
    history only: never on the rows batched with it or their order (what makes
    PD equal colocated, and a preempted request resume unchanged)."""
    gen = torch.Generator().manual_seed(data_seed)
    logits = (torch.randn(len(rows), 97, generator=gen, dtype=torch.float64) * 3).to(dtype)
    specs = [
        SampleSpec(p, seed, index, (1, 2, 3), (4, 4, 9)[: index % 4]) for p, seed, index in rows
    ]
    together = sample(logits, specs)
    order = list(reversed(range(len(rows))))
    reversed_batch = sample(logits[order], [specs[i] for i in order])
    for i, spec in enumerate(specs):
        alone = sample(logits[i : i + 1], [spec])
        assert together.tokens[i] == alone.tokens[0] == reversed_batch.tokens[order.index(i)]
        assert together.logprobs[i] == alone.logprobs[0]
        assert (together.logprobs[i] is None) == (spec.params.logprobs is None)


def test_sampling_follows_the_distribution_after_top_k_and_top_p() -> None:
    """Over many positions, each token's frequency is its renormalised probability
    among the tokens the filters keep."""
    logits = torch.log(torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04], dtype=torch.float64))
    n = 6000
    cases = [
        (SamplingParams(temperature=1.0), [0.35, 0.25, 0.2, 0.1, 0.06, 0.04]),
        (SamplingParams(temperature=1.0, top_k=3), [0.35 / 0.8, 0.25 / 0.8, 0.2 / 0.8, 0, 0, 0]),
        (SamplingParams(temperature=1.0, top_p=0.7), [0.35 / 0.8, 0.25 / 0.8, 0.2 / 0.8, 0, 0, 0]),
    ]
    for params, expected in cases:
        specs = [SampleSpec(params, 11, i) for i in range(n)]
        tokens = sample(logits.expand(n, -1), specs).tokens
        freq = torch.bincount(torch.tensor(tokens), minlength=6).double() / n
        assert (freq - torch.tensor(expected, dtype=torch.float64)).abs().max() < 0.025, params


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 3.0]], dtype=torch.float64)
    prompt, output = (3,), (0, 0, 2)  # token 0 twice and token 2 once in the output

    def penalised(**kw: float) -> list[float]:
        spec = SampleSpec(SamplingParams(**kw), 0, len(output), prompt, output)  # type: ignore[arg-type]
        return penalise(logits, [spec])[0].tolist()

    assert penalised(frequency_penalty=0.5) == [1.0, 1.0, -1.5, 0.5, 3.0]
    assert penalised(presence_penalty=0.5) == [1.5, 1.0, -1.5, 0.5, 3.0]
    # Repetition counts the prompt too: positive logits divide, negative multiply.
    assert penalised(repetition_penalty=2.0) == [1.0, 1.0, -2.0, 0.25, 3.0]
    assert penalised(repetition_penalty=2.0, presence_penalty=1.0) == [0.0, 1.0, -3.0, 0.25, 3.0]
    # Greedy rows see them too: token 4 stays best, token 0 falls behind token 1.
    spec = SampleSpec(SamplingParams(frequency_penalty=2.0), 0, 3, prompt, output)
    drop_best = logits.clone()
    drop_best[0, 4] = -9.0
    assert sample(drop_best, [spec]).tokens == [1]
    assert sample(drop_best, [SampleSpec(SamplingParams(), 0, 3)]).tokens == [0]


def test_logprobs_are_the_model_distribution_of_the_sampled_token() -> None:
    logits = torch.randn(3, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    specs = [
        SampleSpec(SamplingParams(temperature=0.0, logprobs=5), 1, 0),
        SampleSpec(SamplingParams(temperature=3.0, top_k=4, logprobs=2), 1, 0),
        SampleSpec(SamplingParams(temperature=1.0), 1, 0),
    ]
    out = sample(logits, specs)
    want = torch.log_softmax(logits, -1)
    for row in (0, 1):
        lp = out.logprobs[row]
        assert lp is not None
        assert lp.logprob == pytest.approx(float(want[row, out.tokens[row]]), abs=1e-12)
        k = specs[row].params.logprobs or 0
        best = want[row].topk(k)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(best.values.tolist(), abs=1e-12)
    assert out.logprobs[2] is None


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=2, max_size=40),
    temperature=st.floats(0.05, 5.0),
    top_k=st.one_of(st.just(-1), st.integers(1, 40)),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**64 - 1),
    index=st.integers(0, 10_000),
)
def test_a_sampled_token_always_survives_the_filters(
    logits: list[float], temperature: float, top_k: int, top_p: float, seed: int, index: int
) -> None:
    row = torch.tensor(logits, dtype=torch.float64)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    token = sample_row(row, params, seed, index)
    probs = torch.softmax(row / temperature, -1)
    # Strictly more likely tokens than the pick: fewer than k, and their mass below top_p.
    better = probs > probs[token]
    if top_k > 0:
        assert int(better.sum()) < top_k
    assert float(probs[better].sum()) < top_p + 1e-9
