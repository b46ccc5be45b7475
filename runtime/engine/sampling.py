"""Sampling parameters, and the one random number each sampled token uses.

Reproducibility rule: the token at output position i of a seeded request is
a function of (seed, i) and that row's logits alone: `uniform_for(seed, i)`
is the only randomness it sees, and the sampler (`sampler.py`) treats every
row on its own. Which process samples it (a prefill instance samples
position 0, a decode instance the rest), how the batch was composed, or
whether the request was preempted and recomputed does not change the token.

Pure module: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

_MASK64 = (1 << 64) - 1
MAX_LOGPROBS = 20  # alternatives a request may ask for at each position
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0


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
    """How to pick tokens. temperature == 0 means greedy (top_p/top_k/seed unused).

    Penalties change the logits before anything else (greedy rows too):
    `repetition_penalty` divides a positive logit (multiplies a negative one)
    of every token already in the prompt or the output; `frequency_penalty`
    subtracts itself once per occurrence of a token in the output,
    `presence_penalty` once if it occurs there at all. `logprobs`: return the
    log-probability of each sampled token and of this many most likely
    alternatives (None: none), from the model's own distribution (the logits
    before penalties, temperature and filters).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter
    seed: int | None = None  # None: the engine draws one per request
    max_tokens: int = 16
    stop: Sequence[str] = field(default=())  # text-level stops, applied by the detokenizer
    stop_token_ids: Sequence[int] = field(default=())
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise SamplingError(
                    name, f"must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        rep = self.repetition_penalty
        if not _is_number(rep) or not 0 < rep <= MAX_REPETITION_PENALTY:
            raise SamplingError(
                "repetition_penalty",
                f"must be a number in (0, {MAX_REPETITION_PENALTY}], got {rep!r}",
            )
        object.__setattr__(self, "repetition_penalty", float(rep))
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise SamplingError(
                "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        # Frozen and hashable: store the sequences as tuples.
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def needs_filter(self) -> bool:
        """True when top-k or top-p removes tokens before a random draw."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)

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


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one output position, under the model's own distribution."""

    logprob: float  # of the token that was sampled
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the most likely, best first


def position_seed(seed: int, index: int) -> int:
    """A 63-bit mix of (seed, index) (splitmix64): the key of output position `index`."""
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def uniform_for(seed: int, index: int) -> float:
    """The draw of output position `index`: a float in [0, 1) with 53 random bits."""
    return (position_seed(seed, index) >> 10) * 2.0**-53
