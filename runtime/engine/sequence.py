"""Per-request state inside the engine: tokens, page table, progress, status.

Token positions: a sequence's tokens are ``prompt_token_ids +
output_token_ids``; ``num_computed_tokens`` leading tokens have their KV
written into ``page_table``. The newest sampled token is never computed yet:
feeding it is the next decode step.

Phases of a RUNNING sequence:
- *prefill* while ``num_computed_tokens < num_prefill_tokens``: chunks of the
  known tokens are computed; the chunk that reaches ``num_prefill_tokens``
  samples the next token. ``num_prefill_tokens`` is the prompt length on
  admission, and every known token (prompt + generated) after a preemption,
  so a recompute rebuilds the KV without sampling any generated token again;
- *decode* afterwards: ``num_computed_tokens == num_tokens - 1`` and each
  step feeds one token and samples one.

Status transitions are table-driven (``TRANSITIONS``); any other raises
``IllegalTransition``:

    WAITING   -> RUNNING | PREEMPTED | FINISHED
    RUNNING   -> PREEMPTED | HELD | FINISHED
    PREEMPTED -> RUNNING | FINISHED
    HELD      -> FINISHED
    FINISHED  -> (none)

WAITING -> PREEMPTED happens to a ``prefilled`` sequence queued for a
running slot whose pages are taken back. HELD is a finished ``prefill_only``
sequence whose pages stay allocated until the PD layer releases them.

Pure module: no I/O, no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, get_args

from pdcluster.runtime.spec import pages_for

__all__ = [
    "FINISH_REASONS",
    "MODES",
    "SequenceMode",
    "TRANSITIONS",
    "FinishReason",
    "IllegalTransition",
    "Sequence",
    "SequenceStatus",
]


class SequenceMode(enum.StrEnum):
    normal = "normal"  # computes its prompt, then generates
    prefill_only = "prefill_only"  # PD prefill: computes the prompt, samples one token, HELD
    prefilled = "prefilled"  # PD decode: arrives with its prompt's KV and first token


FinishReason = Literal["stop", "length", "abort", "prefill_done"]
MODES: frozenset[str] = frozenset(m.value for m in SequenceMode)
FINISH_REASONS: frozenset[str] = frozenset(get_args(FinishReason))


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages unless mode == "prefilled"
    RUNNING = "running"  # admitted: scheduled each step until it ends
    PREEMPTED = "preempted"  # pages taken back; queued to recompute its tokens
    HELD = "held"  # prefill_only done; pages kept until released
    FINISHED = "finished"  # terminal; holds no pages


TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    SequenceStatus.WAITING: frozenset(
        {SequenceStatus.RUNNING, SequenceStatus.PREEMPTED, SequenceStatus.FINISHED}
    ),
    SequenceStatus.RUNNING: frozenset(
        {SequenceStatus.PREEMPTED, SequenceStatus.HELD, SequenceStatus.FINISHED}
    ),
    SequenceStatus.PREEMPTED: frozenset({SequenceStatus.RUNNING, SequenceStatus.FINISHED}),
    SequenceStatus.HELD: frozenset({SequenceStatus.FINISHED}),
    SequenceStatus.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A status change the transition table does not allow."""


@dataclass(eq=False)  # identity semantics: two requests are never "equal"
class Sequence:
    rid: str
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    ignore_eos: bool = False
    mode: SequenceMode = SequenceMode.normal
    page_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # Assigned by the scheduler on add: a strictly increasing counter. FIFO
    # admission and preemption order (youngest first) both read it.
    arrival: int = -1
    num_prefill_tokens: int = 0
    num_preemptions: int = 0
    # Prefix cache: leading full prompt pages of ``page_table`` already looked
    # up or offered to the cache (0 when the cache is off).
    num_keyed_pages: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Total length: prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens at positions ``[start, end)`` without copying the whole sequence."""
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"slice [{start}, {end}) outside a sequence of {self.num_tokens}")
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return tuple(self.prompt_token_ids[start:end])
        if start >= n_prompt:
            return tuple(self.output_token_ids[start - n_prompt : end - n_prompt])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids[: end - n_prompt])

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def is_finished(self) -> bool:
        """True once no further token will be produced (FINISHED or HELD)."""
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.HELD)

    def num_new_pages_for(self, num_tokens: int, page_size: int) -> int:
        """Pages to add to the page table so it covers ``num_tokens`` tokens."""
        return max(0, pages_for(num_tokens, page_size) - len(self.page_table))

    def stop_reason(self) -> FinishReason | None:
        """Why the newest sampled token ends the sequence, or None if it goes on."""
        if not self.output_token_ids:
            return None
        if self.mode == SequenceMode.prefill_only:
            return "prefill_done"
        last = self.output_token_ids[-1]
        if not self.ignore_eos and self.eos_token_id is not None and last == self.eos_token_id:
            return "stop"
        if last in self.stop_token_ids:
            return "stop"
        if len(self.output_token_ids) >= self.max_tokens:
            return "length"
        return None

    def transition(self, new: SequenceStatus) -> None:
        if new not in TRANSITIONS[self.status]:
            raise IllegalTransition(
                f"sequence {self.rid!r}: {self.status.name} -> {new.name} is not allowed"
            )
        self.status = new
