"""What every rank of a dp group runs in one step, and its wire form.

The leader builds a `StepPlan` from the scheduler's batch and broadcasts it
to the other ranks of its group every step; the rank that samples sends
the `SampledTokens` back. Both travel as msgpack (a schema of plain
dataclasses, never a pickle): decoding builds only these types, and costs
about half of what unpickling the same plan did.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pdcluster.runtime.engine.sampler import SampledTokens, SampleSpec

__all__ = [
    "ChunkPlan",
    "StepPlan",
    "decode_plan",
    "decode_sampled",
    "encode_plan",
    "encode_sampled",
]


@dataclass(frozen=True)
class ChunkPlan:
    rid: str
    token_ids: tuple[int, ...]
    start_pos: int
    page_table: tuple[int, ...]
    is_prefill: bool
    sample: SampleSpec | None  # None: no token is sampled from this chunk


@dataclass(frozen=True)
class StepPlan:
    """What every rank of a dp group runs in one step (broadcast by the leader)."""

    chunks: tuple[ChunkPlan, ...] = ()
    shutdown: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)
_sampled_decoder = msgspec.msgpack.Decoder(SampledTokens)


def encode_plan(plan: StepPlan) -> bytes:
    return _encoder.encode(plan)


def decode_plan(data: bytes) -> StepPlan:
    """The plan in `data`; msgspec.ValidationError when it is not one."""
    return _plan_decoder.decode(data)


def encode_sampled(sampled: SampledTokens) -> bytes:
    return _encoder.encode(sampled)


def decode_sampled(data: bytes) -> SampledTokens:
    return _sampled_decoder.decode(data)
