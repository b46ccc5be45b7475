"""Sampling parameters and the token sampler.

Reproducibility rule: the token at output position i of a seeded request is
drawn with a generator seeded from (seed, i) alone. Which process samples it
(a prefill instance samples position 0, a decode instance the rest), how the
batch was composed, or whether the request was preempted and recomputed does
not change the draw. Sampling always runs on the CPU in float64 so the draw
does not depend on the device's kernels either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

_MASK64 = (1 << 64) - 1


class SamplingError(ValueError):
    """A sampling parameter is invalid; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"sampling_params.{field_name}: {message}")
        self.field = field_name


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, int | float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature == 0 means greedy (top_p/top_k/seed unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter
    seed: int | None = None  # None: the engine draws one per request
    max_tokens: int = 16
    stop: Sequence[str] = field(default=())  # text-level stops, applied by the detokenizer
    stop_token_ids: Sequence[int] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not (
            math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise SamplingError(
                "temperature", f"must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise SamplingError("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MASK64):
            raise SamplingError("seed", f"must be an integer in [0, 2**64), got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or any(not isinstance(s, str) or not s for s in stop):
            raise SamplingError("stop", f"must be a list of non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, Sequence) or isinstance(ids, str):
            raise SamplingError("stop_token_ids", f"must be a list of token ids, got {ids!r}")
        if any(not _is_int(i) or i < 0 for i in ids):
            raise SamplingError("stop_token_ids", f"must hold non-negative integers, got {ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        # Frozen and hashable: store the sequences as tuples.
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SamplingParams:
        """Build from a request body's `sampling_params` (SGLang names accepted).

        `max_new_tokens` is an alias of `max_tokens`; unknown keys are an error
        naming them, so a typo never silently falls back to a default.
        """
        if not isinstance(raw, Mapping):
            raise SamplingError("<root>", f"must be an object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        values = dict(raw)
        if "max_new_tokens" in values:
            if "max_tokens" in values:
                raise SamplingError("max_new_tokens", "give max_tokens or max_new_tokens, not both")
            values["max_tokens"] = values.pop("max_new_tokens")
        unknown = sorted(set(values) - known)
        if unknown:
            raise SamplingError(unknown[0], f"unknown field(s) {unknown}; known: {sorted(known)}")
        values = {k: v for k, v in values.items() if v is not None or k == "seed"}
        return cls(**values)


def position_seed(seed: int, index: int) -> int:
    """Seed of the generator for output position `index` (a splitmix64 mix)."""
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int, index: int) -> int:
    """Pick one token from logits [vocab] for output position `index`."""
    row = logits.detach().to("cpu", torch.float64)  # [vocab]
    if params.is_greedy:
        return int(row.argmax())
    probs, order = torch.sort(
        torch.softmax(row / params.temperature, dim=-1), descending=True, stable=True
    )  # each [vocab]
    if params.top_k > 0:
        probs, order = probs[: params.top_k], order[: params.top_k]
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least one).
        before = torch.cumsum(probs, dim=0) - probs
        keep = int((before < params.top_p).sum())
        probs, order = probs[: max(keep, 1)], order[: max(keep, 1)]
    cdf = torch.cumsum(probs, dim=0)  # [k]
    gen = torch.Generator().manual_seed(position_seed(seed, index))
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    pick = min(int(torch.searchsorted(cdf, u, right=True)), int(order.shape[0]) - 1)
    return int(order[pick])


def sample(logits: torch.Tensor, requests: Sequence[tuple[SamplingParams, int, int]]) -> list[int]:
    """logits: [N, vocab]; requests: (params, seed, output index) per row → N token ids."""
    if logits.shape[0] != len(requests):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
    greedy = [i for i, (p, _, _) in enumerate(requests) if p.is_greedy]
    out = [0] * len(requests)
    if greedy:
        picks = logits[greedy].argmax(dim=-1).tolist()  # one transfer for every greedy row
        for row, token in zip(greedy, picks, strict=True):
            out[row] = int(token)
    for row, (params, seed, index) in enumerate(requests):
        if not params.is_greedy:
            out[row] = sample_row(logits[row], params, seed, index)
    return out
