"""Sampling parameters and the sampler."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.engine.sampling import (
    SamplingError,
    SamplingParams,
    position_seed,
    sample,
    sample_row,
)


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
    # In a batch next to other rows, a row draws exactly what it draws alone.
    batch = torch.stack([LOGITS.flip(0), LOGITS, LOGITS * 2])
    reqs = [(SamplingParams(), 0, 0), (params, 7, 3), (SamplingParams(temperature=1.0), 1, 1)]
    assert sample(batch, reqs)[1] == tokens[3]
    assert sample(batch, reqs)[0] == int(LOGITS.flip(0).argmax())


def test_sample_rejects_a_row_count_mismatch() -> None:
    with pytest.raises(ValueError, match="2 logit rows for 1 requests"):
        sample(torch.zeros(2, 4), [(SamplingParams(), 0, 0)])


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
