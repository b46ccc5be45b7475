"""Continuous batching with chunked prefill, FIFO admission and preemption.

The scheduler decides which tokens of which sequences run in the next
forward step and owns every page it hands them. The caller drives it:
``schedule()`` -> run the batch -> ``on_step_done(sampled)``; every
``schedule()`` that returns chunks must be closed by ``on_step_done`` (or
``fail_step``) before the next one.

One step, in this order:
1. ``prefilled`` sequences queued for a running slot are promoted, oldest
   first, while ``num_running < max_running_requests``.
2. Decode: every running sequence past its prefill gets one token, oldest
   first. ``max_batch_tokens >= max_running_requests`` so decodes always fit.
3. Prefill: running sequences still prefilling get their next chunk, oldest
   first; then waiting sequences are admitted in arrival order. A chunk is at
   most ``chunk_size`` tokens and never exceeds the token budget left.
   Head-of-line blocking: the first sequence whose chunk cannot get its pages,
   or the first waiting one that finds no running slot, ends this phase; a
   step that preempted anyone admits no waiting sequence.

Pages are allocated when a chunk is scheduled, enough for that chunk. A
running sequence that needs pages when too few are free preempts page
holders (running, or ``prefilled`` queued) that arrived *after* it, youngest
first, only if that frees enough; otherwise it waits this step, keeping its
pages. A waiting sequence never preempts anyone.

Invariants (asserted by the property tests):
- every page the scheduler holds belongs to exactly one live sequence, or to
  a sequence that ended while its batch was in flight (those pages return at
  ``on_step_done``, because the runner may still be writing them); every way
  out — finish, abort, release, preemption — gives pages back, so when all
  requests end the allocator is back to its initial free count;
- the waiting queue is ordered by arrival and admits only from its head;
- ``num_running <= max_running_requests``; a batch holds at most one chunk per
  sequence and at most ``max_batch_tokens`` tokens;
- a ``prefill_only`` sequence takes all its prompt pages on admission and is
  never preempted: a KV transfer may be reading its pages at any time;
- the oldest running sequence is never preempted, so it always progresses
  unless pages are held outside the scheduler (HELD sequences, PD
  reservations); an admissible request alone always fits the pool;
- a preempted sequence recomputes prompt + generated tokens and keeps them:
  no generated token is sampled twice;
- a rejected call (``RequestRejected``, ``SchedulerError``) changes nothing.

Prefix cache (when the allocator is a `CachingPageAllocator` with the cache
on; otherwise none of this happens and the scheduler behaves as without it):
- on admission a sequence looks up its longest cached run of leading full
  pages, over its known tokens but the last (one token is always computed so
  there is a token to sample); it takes a reference on each, they open its
  page table, and its first chunk starts at the first uncached token. The
  admission check counts the hit pages that were evictable (they stop being
  free once referenced) and needs no new page for them;
- once a prefill chunk has computed full prompt pages they are inserted into
  the cache (the sequence's reference moves with them); only prompt pages are
  cached, and a page is never written after it is full, so a cached page is
  read-only;
- every way out (finish, abort, release, preemption, a failed step) gives a
  cached page back by releasing the sequence's reference, an owned page by
  freeing it: a cached page is never freed, and it is evicted only when the
  allocator needs pages and nobody references it;
- several sequences may hold one cached page, so a victim of preemption
  counts as freeing only the pages whose last reference it holds;
- a ``prefilled`` sequence (decode: KV received from prefill) may open its
  page table with cached pages the caller referenced for it (their
  references pass to the sequence), and on ``add`` its full prompt pages are
  inserted into the cache like computed ones.

Pure module: no I/O, no torch.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from pdcluster.runtime.engine.caching_allocator import CachingPageAllocator
from pdcluster.runtime.engine.page_allocator import PageAllocator
from pdcluster.runtime.engine.sequence import (
    MODES,
    FinishReason,
    Sequence,
    SequenceMode,
    SequenceStatus,
)
from pdcluster.runtime.engine.token_ids import first_bad_token, is_token
from pdcluster.runtime.spec import pages_for

__all__ = [
    "EXTERNAL_FINISH_REASONS",
    "RequestRejected",
    "ScheduledBatch",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
]

# Reasons a caller may give finish(); "prefill_done" is the scheduler's own.
_EXTERNAL_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
EXTERNAL_FINISH_REASONS: frozenset[str] = frozenset(_EXTERNAL_REASONS)

_S = SequenceStatus


class RequestRejected(ValueError):
    """A request the engine will not take; nothing was reserved."""


class SchedulerError(RuntimeError):
    """A call out of protocol (unknown rid, wrong state, bad step result)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits of one engine (one dp group). Counts are tokens unless named."""

    page_size: int  # tokens per KV page
    max_running_requests: int  # sequences admitted at once (prefilling or decoding)
    max_batch_tokens: int  # tokens fed to one forward step, all sequences together
    chunk_size: int  # prefill tokens per sequence per step
    max_prompt_tokens: int  # longest prompt accepted
    max_model_len: int  # prompt + generated tokens must fit

    def __post_init__(self) -> None:
        # Every field is a limit: a positive integer.
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"SchedulerConfig.{f.name} must be a positive integer, got {value!r}"
                )
        if self.max_batch_tokens < self.max_running_requests:
            raise ValueError(
                f"SchedulerConfig.max_batch_tokens ({self.max_batch_tokens}) must be >= "
                f"max_running_requests ({self.max_running_requests}) so every decode fits a step"
            )


@dataclass(frozen=True)
class ScheduledChunk:
    rid: str
    token_ids: tuple[int, ...]  # tokens fed this step
    start_pos: int  # position of token_ids[0]
    page_table: tuple[int, ...]  # the sequence's page table, covering start_pos + len(token_ids)
    is_prefill: bool
    sample: bool  # True when the last token's logits must be sampled this step

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class ScheduledBatch:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]  # rids preempted this step (pages freed, requeued for recompute)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class _Plan:
    """What one ``schedule()`` call has decided so far: rid -> (seq, start, end)."""

    budget: int
    chunks: dict[str, tuple[Sequence, int, int]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)


def _arrival(seq: Sequence) -> int:
    return seq.arrival


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self._live: dict[str, Sequence] = {}  # every sequence not FINISHED
        self._waiting: list[Sequence] = []  # need (re)compute; sorted by arrival
        self._ready: deque[Sequence] = deque()  # prefilled, waiting for a running slot
        self._running: list[Sequence] = []  # sorted by arrival
        self._held: dict[str, Sequence] = {}
        # page -> holders (live sequences, or deferred page lists); above 1
        # only for a cached page several sequences reference.
        self._owned: Counter[int] = Counter()
        self._deferred_free: list[list[int]] = []  # page tables of sequences that ended mid-step
        self._cache: CachingPageAllocator | None = (
            allocator
            if isinstance(allocator, CachingPageAllocator) and allocator.is_enabled
            else None
        )
        # Prefix cache counters (tokens, since start): known tokens of admitted
        # sequences, and how many of them the cache served.
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0
        self._in_flight: dict[str, tuple[ScheduledChunk, Sequence]] | None = None
        self._reports: list[Sequence] = []  # finished on add; reported by on_step_done
        self._next_arrival = 0

    # ---- queries ---------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._ready)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Known tokens still to compute before their sequence samples (waiting or prefilling)."""
        pending = (s for s in (*self._waiting, *self._running) if s.is_prefilling)
        return sum(s.num_prefill_tokens - s.num_computed_tokens for s in pending)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def is_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def has_work(self) -> bool:
        """True while a step could compute something or has a result to report."""
        return bool(self._waiting or self._ready or self._running or self._reports)

    def get(self, rid: str) -> Sequence | None:
        return self._live.get(rid)

    # ---- admission ------------------------------------------------------

    def check_admissible(
        self, prompt_len: int, max_tokens: int, *, prefill_only: bool = False
    ) -> None:
        """Raise RequestRejected if this request could never be served here.

        ``prefill_only`` requests keep only the prompt's KV, so only the prompt
        must fit the pool; the request as a whole must still fit the model.
        """
        cfg = self.config
        if prompt_len < 1:
            raise RequestRejected("empty prompt: at least one prompt token is required")
        if max_tokens < 1:
            raise RequestRejected(f"max_tokens must be >= 1, got {max_tokens}")
        if prompt_len > cfg.max_prompt_tokens:
            raise RequestRejected(
                f"prompt has {prompt_len} tokens, "
                f"more than max_prompt_tokens={cfg.max_prompt_tokens}"
            )
        if prompt_len + max_tokens > cfg.max_model_len:
            raise RequestRejected(
                f"prompt ({prompt_len}) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                f"tokens exceeds max_model_len={cfg.max_model_len}"
            )
        # The last sampled token is never fed, so its KV is never stored.
        kv_tokens = prompt_len if prefill_only else prompt_len + max_tokens - 1
        pages = pages_for(kv_tokens, cfg.page_size)
        if pages > self.allocator.num_total:
            raise RequestRejected(
                f"request needs {pages} KV pages ({kv_tokens} tokens of {cfg.page_size} per page) "
                f"but the pool only has {self.allocator.num_total}"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, or reject it (RequestRejected) with nothing changed.

        ``normal`` and ``prefill_only`` sequences join the waiting queue.
        ``prefilled`` ones arrive with their KV in ``page_table`` (pages
        allocated from this allocator; ownership moves here),
        ``num_computed_tokens == len(prompt)`` and ``output_token_ids ==
        [first_token]``; they start decoding at once when a running slot is
        free, else wait for one holding their pages. If the first token
        already ends such a sequence (max_tokens == 1, eos, stop id), it is
        FINISHED here, its pages freed, and the next ``on_step_done`` reports it.
        """
        self._validate_new(seq)
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        self._live[seq.rid] = seq
        seq.num_prefill_tokens = seq.num_prompt_tokens
        if seq.mode != SequenceMode.prefilled:
            self._waiting.append(seq)  # newest arrival: the end keeps the order
            return
        self._owned.update(seq.page_table)
        # Its full prompt pages join the cache like computed ones (decode-side
        # reuse: a later prompt with this prefix needs them sent no more).
        self._insert_computed(seq)
        reason = seq.stop_reason()
        if reason is not None:
            self._end(seq, reason)
            self._reports.append(seq)
        elif not self._ready and len(self._running) < self.config.max_running_requests:
            seq.transition(_S.RUNNING)
            self._running.append(seq)  # newest arrival
        else:
            self._ready.append(seq)

    def _validate_new(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise RequestRejected(f"expected a Sequence, got {type(seq).__name__}")
        if not isinstance(seq.rid, str) or not seq.rid:
            raise RequestRejected(f"rid must be a non-empty string, got {seq.rid!r}")
        if seq.rid in self._live:
            raise RequestRejected(f"rid {seq.rid!r} is already in use")
        if seq.mode not in MODES:
            raise RequestRejected(f"mode must be one of {sorted(MODES)}, got {seq.mode!r}")
        if not isinstance(seq.max_tokens, int) or isinstance(seq.max_tokens, bool):
            raise RequestRejected(f"max_tokens must be an integer, got {seq.max_tokens!r}")
        if not isinstance(seq.prompt_token_ids, list) or not isinstance(seq.output_token_ids, list):
            raise RequestRejected("prompt_token_ids and output_token_ids must be lists")
        bad = first_bad_token(seq.prompt_token_ids)
        if bad is not None:
            raise RequestRejected(
                f"prompt token ids must be non-negative integers, got {seq.prompt_token_ids[bad]!r}"
            )
        if seq.status is not _S.WAITING or seq.finish_reason is not None:
            raise RequestRejected(f"sequence {seq.rid!r} is not new (status {seq.status.name})")
        self.check_admissible(
            len(seq.prompt_token_ids),
            seq.max_tokens,
            prefill_only=seq.mode == SequenceMode.prefill_only,
        )
        if seq.mode != SequenceMode.prefilled:
            if seq.output_token_ids or seq.page_table or seq.num_computed_tokens:
                raise RequestRejected(
                    f"{seq.mode} sequence {seq.rid!r} must start with no output, pages or progress"
                )
            return
        self._validate_prefilled(seq)

    def _validate_prefilled(self, seq: Sequence) -> None:
        if len(seq.output_token_ids) != 1 or not is_token(seq.output_token_ids[0]):
            raise RequestRejected(
                f"prefilled sequence {seq.rid!r} needs exactly one first token, "
                f"got {seq.output_token_ids!r}"
            )
        if seq.num_computed_tokens != seq.num_prompt_tokens:
            raise RequestRejected(
                f"prefilled sequence {seq.rid!r} must have num_computed_tokens == prompt length "
                f"({seq.num_prompt_tokens}), got {seq.num_computed_tokens}"
            )
        needed = pages_for(seq.num_prompt_tokens, self.config.page_size)
        if len(seq.page_table) < needed:
            raise RequestRejected(
                f"prefilled sequence {seq.rid!r} has {len(seq.page_table)} pages, "
                f"its prompt needs {needed}"
            )
        if len(set(seq.page_table)) != len(seq.page_table):
            raise RequestRejected(f"prefilled sequence {seq.rid!r} lists a page twice")
        cache = self._cache
        for page in seq.page_table:
            if not isinstance(page, int) or not 0 <= page < self.allocator.num_total:
                raise RequestRejected(f"prefilled sequence {seq.rid!r}: unknown page {page!r}")
            if cache is not None and cache.is_cached(page):
                # A reused prefix page: shared with other sequences, and the
                # caller passes its reference with the sequence.
                if cache.refcount(page) < 1:
                    raise RequestRejected(
                        f"prefilled sequence {seq.rid!r}: cached page {page} holds no reference"
                    )
                continue
            if not self.allocator.is_allocated(page):
                raise RequestRejected(
                    f"prefilled sequence {seq.rid!r}: page {page} was not allocated"
                )
            if page in self._owned:
                raise RequestRejected(
                    f"prefilled sequence {seq.rid!r}: page {page} belongs to another sequence"
                )

    # ---- one step -------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        if self._in_flight is not None:
            raise SchedulerError("schedule() called before on_step_done() closed the last batch")
        self._promote_ready()
        plan = _Plan(budget=self.config.max_batch_tokens)
        self._schedule_decodes(plan)
        blocked = self._schedule_prefill_chunks(plan)
        # A step that preempted admits nobody: the pool is tight, and taking a
        # victim straight back would only make it recompute again.
        if not blocked and not plan.preempted:
            self._admit_waiting(plan)
        return self._seal(plan)

    def _schedule_decodes(self, plan: _Plan) -> None:
        """Phase 1: one token for every running sequence past its prefill, oldest first."""
        for seq in list(self._running):
            # A sequence preempted earlier in this loop is no longer RUNNING.
            if seq.status is _S.RUNNING and not seq.is_prefilling:
                start = seq.num_computed_tokens
                if self._reserve(seq, start + 1, plan):
                    plan.chunks[seq.rid] = (seq, start, start + 1)
                    plan.budget -= 1

    def _schedule_prefill_chunks(self, plan: _Plan) -> bool:
        """Phase 2: the next chunk of every running sequence still prefilling, oldest
        first; True when one was blocked (out of budget or pages)."""
        cfg = self.config
        blocked = False
        for seq in list(self._running):
            if seq.status is not _S.RUNNING or not seq.is_prefilling:
                continue
            if plan.budget == 0:
                return True
            start = seq.num_computed_tokens
            end = start + min(cfg.chunk_size, seq.num_prefill_tokens - start, plan.budget)
            if blocked and seq.num_new_pages_for(end, cfg.page_size) > 0:
                # Head-of-line: nobody behind a blocked sequence takes pages, but
                # one that already holds its pages (prefill_only) still runs.
                continue
            if not self._reserve(seq, end, plan):
                blocked = True
                continue
            plan.chunks[seq.rid] = (seq, start, end)
            plan.budget -= end - start
        return blocked

    def _admit_waiting(self, plan: _Plan) -> None:
        """Phase 3: admit waiting sequences in arrival order while a running slot,
        the budget and the pages allow; the first that does not fit stops it."""
        cfg = self.config
        while plan.budget > 0 and self._waiting:
            if len(self._running) >= cfg.max_running_requests:
                break
            seq = self._waiting[0]
            hit = self._lookup(seq)
            start = len(hit) * cfg.page_size
            end = start + min(cfg.chunk_size, seq.num_prefill_tokens - start, plan.budget)
            # A prefill_only sequence streams its KV out while it computes, so
            # its pages must never move: it takes the whole prompt's pages now
            # (all or nothing) and is never preempted.
            upto = seq.num_prefill_tokens if seq.mode == SequenceMode.prefill_only else end
            need = pages_for(upto, cfg.page_size) - len(hit)
            if need + self._num_evictable(hit) > self.allocator.num_free:
                break
            self._waiting.pop(0)
            self._take_hit(seq, hit)
            self._take_pages(seq, need)
            seq.transition(_S.RUNNING)
            bisect.insort(self._running, seq, key=_arrival)
            plan.chunks[seq.rid] = (seq, start, end)
            plan.budget -= end - start

    def _seal(self, plan: _Plan) -> ScheduledBatch:
        """Build the step's chunks and mark them in flight until on_step_done."""
        chunks = tuple(
            self._build_chunk(seq, start, end) for seq, start, end in plan.chunks.values()
        )
        if chunks:
            self._in_flight = {
                c.rid: (c, seq) for c, (seq, _, _) in zip(chunks, plan.chunks.values(), strict=True)
            }
        return ScheduledBatch(chunks=chunks, preempted=tuple(plan.preempted))

    def _build_chunk(self, seq: Sequence, start: int, end: int) -> ScheduledChunk:
        is_prefill = start < seq.num_prefill_tokens
        return ScheduledChunk(
            rid=seq.rid,
            token_ids=seq.token_slice(start, end),
            start_pos=start,
            page_table=tuple(seq.page_table),
            is_prefill=is_prefill,
            sample=not is_prefill or end == seq.num_prefill_tokens,
        )

    def _promote_ready(self) -> None:
        while self._ready and len(self._running) < self.config.max_running_requests:
            seq = self._ready.popleft()
            seq.transition(_S.RUNNING)
            bisect.insort(self._running, seq, key=_arrival)

    def _reserve(self, seq: Sequence, num_tokens: int, plan: _Plan) -> bool:
        """Give ``seq`` pages for ``num_tokens`` tokens, preempting younger holders if
        that is enough; False (nothing changed) when it is not."""
        need = seq.num_new_pages_for(num_tokens, self.config.page_size)
        shortfall = need - self.allocator.num_free
        if shortfall > 0:
            victims: list[Sequence] = []
            released: Counter[int] = Counter()  # references the victims so far give back
            for cand in sorted([*self._running, *self._ready], key=_arrival, reverse=True):
                if cand.arrival <= seq.arrival or shortfall <= 0:
                    break
                if cand.mode == SequenceMode.prefill_only:
                    continue  # a transfer may be reading its pages: never move them
                victims.append(cand)
                shortfall -= self._num_freed_by(cand, released)
            if shortfall > 0:
                return False
            for victim in victims:
                self._preempt(victim, plan)
        self._take_pages(seq, need)
        return True

    def _preempt(self, seq: Sequence, plan: _Plan) -> None:
        planned = plan.chunks.pop(seq.rid, None)
        if planned is not None:
            plan.budget += planned[2] - planned[1]
        if seq.status is _S.RUNNING:
            self._running.remove(seq)
        else:
            self._ready.remove(seq)
        self._give_back(seq.page_table)
        seq.page_table = []
        seq.num_computed_tokens = 0
        seq.num_keyed_pages = 0
        seq.num_prefill_tokens = seq.num_tokens
        seq.num_preemptions += 1
        seq.transition(_S.PREEMPTED)
        bisect.insort(self._waiting, seq, key=_arrival)
        plan.preempted.append(seq.rid)

    def on_step_done(self, sampled: Mapping[str, int]) -> list[Sequence]:
        """Apply the results of the batch in flight.

        ``sampled`` maps the rid of every chunk with ``sample=True`` to its
        token (entries for sequences aborted mid-step are optional and
        ignored). Returns the sequences that got a token or finished, in batch
        order, after those finished on add. A bad ``sampled`` raises
        SchedulerError and leaves the batch in flight.
        """
        in_flight = self._in_flight
        if in_flight is None:
            if sampled:
                raise SchedulerError("on_step_done() got tokens but no batch is in flight")
            return self._drain_reports()
        for rid, token in sampled.items():
            entry = in_flight.get(rid)
            if entry is None or not entry[0].sample:
                raise SchedulerError(f"sampled token for {rid!r}, which was not sampled this step")
            if not is_token(token):
                raise SchedulerError(
                    f"sampled token for {rid!r} must be an int >= 0, got {token!r}"
                )
        for rid, (chunk, seq) in in_flight.items():
            if chunk.sample and seq.status is _S.RUNNING and rid not in sampled:
                raise SchedulerError(f"no sampled token for {rid!r}")

        changed = self._drain_reports()
        for rid, (chunk, seq) in in_flight.items():
            if seq.status is not _S.RUNNING:  # ended mid-step; its pages are deferred
                continue
            seq.num_computed_tokens = chunk.end_pos
            if chunk.is_prefill:
                self._insert_computed(seq)
            if not chunk.sample:
                continue
            seq.output_token_ids.append(sampled[rid])
            reason = seq.stop_reason()
            if reason is not None:
                self._end(seq, reason)
            changed.append(seq)
        self._close_step()
        return changed

    def fail_step(self) -> list[Sequence]:
        """Abort every sequence of the batch in flight (the runner failed) and
        close the step; returns the aborted sequences."""
        if self._in_flight is None:
            raise SchedulerError("fail_step() called but no batch is in flight")
        aborted = [seq for _, seq in self._in_flight.values() if seq.status is _S.RUNNING]
        for seq in aborted:
            self._end(seq, "abort")
        self._close_step()
        return aborted

    def _close_step(self) -> None:
        self._in_flight = None
        deferred, self._deferred_free = self._deferred_free, []
        for pages in deferred:
            self._give_back(pages)

    # ---- ending requests -----------------------------------------------

    def abort(self, rid: str) -> Sequence | None:
        """End the live sequence with exactly this rid (HELD included) and free
        its pages; None if no such sequence."""
        seq = self._live.get(rid)
        if seq is None:
            return None
        self._end(seq, "abort")
        return seq

    def release(self, rid: str) -> None:
        """Free the pages of a HELD sequence (its KV was transferred)."""
        seq = self._live.get(rid)
        if seq is None or seq.status is not _S.HELD:
            state = "unknown" if seq is None else seq.status.name
            raise SchedulerError(f"release({rid!r}): no HELD sequence with that rid ({state})")
        self._end(seq, seq.finish_reason or "prefill_done")

    def finish(self, rid: str, reason: str) -> None:
        """End a live, not yet finished sequence for a reason found outside
        the scheduler (e.g. a stop string matched in the detokenized text)."""
        if reason not in EXTERNAL_FINISH_REASONS:
            raise SchedulerError(
                f"finish reason must be one of {sorted(EXTERNAL_FINISH_REASONS)}, got {reason!r}"
            )
        seq = self._live.get(rid)
        if seq is None or seq.status is _S.HELD:
            state = "unknown" if seq is None else "HELD; use release()"
            raise SchedulerError(f"finish({rid!r}): no unfinished sequence with that rid ({state})")
        self._end(seq, _EXTERNAL_REASONS[reason])

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        """Move a live sequence to FINISHED (or HELD for prefill_done) and
        return or keep its pages accordingly."""
        status = seq.status
        if status is _S.RUNNING:
            self._running.remove(seq)
        elif status is _S.HELD:
            del self._held[seq.rid]
        elif seq in self._ready:
            self._ready.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        seq.finish_reason = reason
        if reason == "prefill_done" and status is _S.RUNNING:
            seq.transition(_S.HELD)
            self._held[seq.rid] = seq
            return
        seq.transition(_S.FINISHED)
        del self._live[seq.rid]
        pages, seq.page_table = seq.page_table, []
        in_flight = self._in_flight
        if in_flight is not None and in_flight.get(seq.rid, (None, None))[1] is seq:
            # The runner may still be writing these pages; reusing them before
            # on_step_done would let this step's writes land in another request.
            self._deferred_free.append(pages)
        else:
            self._give_back(pages)

    def _drain_reports(self) -> list[Sequence]:
        reports, self._reports = self._reports, []
        return reports

    # ---- pages ----------------------------------------------------------

    def _take_pages(self, seq: Sequence, n: int) -> None:
        if n:
            pages = self.allocator.allocate(n)
            self._owned.update(pages)
            seq.page_table.extend(pages)

    def _give_back(self, pages: list[int]) -> None:
        """Return one sequence's pages: release its reference on cached ones,
        free owned ones."""
        if not pages:
            return
        cache = self._cache
        if cache is None:
            self.allocator.free(pages)
        else:
            cached = [p for p in pages if cache.is_cached(p)]
            cache.release(cached)  # the last page first in the LRU: tails go first
            self.allocator.free([p for p in pages if not cache.is_cached(p)])
        owned = self._owned
        for page in pages:
            owned[page] -= 1
            if owned[page] <= 0:
                del owned[page]

    # ---- prefix cache ---------------------------------------------------

    def _lookup(self, seq: Sequence) -> tuple[int, ...]:
        """Cached pages of ``seq``'s leading full pages; one token is always left
        to compute. Takes nothing: ``_take_hit`` does once admission is sure."""
        if self._cache is None:
            return ()
        tokens = seq.token_slice(0, seq.num_prefill_tokens - 1)
        return self._cache.match(tokens, record=False).pages

    def _num_evictable(self, pages: tuple[int, ...]) -> int:
        """Of these cached pages, those now counted free (nobody references them)."""
        cache = self._cache
        if cache is None:
            return 0
        return sum(1 for p in pages if cache.refcount(p) == 0)

    def _take_hit(self, seq: Sequence, hit: tuple[int, ...]) -> None:
        cache = self._cache
        if cache is None:
            return
        self.num_lookup_tokens += seq.num_prefill_tokens
        self.num_hit_tokens += len(hit) * self.config.page_size
        if hit:
            cache.acquire(hit)
            self._owned.update(hit)
            seq.page_table = list(hit)
            seq.num_computed_tokens = len(hit) * self.config.page_size
        seq.num_keyed_pages = len(hit)

    def _insert_computed(self, seq: Sequence) -> None:
        """Offer the full prompt pages computed since the last offer to the cache."""
        cache = self._cache
        if cache is None:
            return
        size = self.config.page_size
        num_full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // size
        first = seq.num_keyed_pages
        if num_full <= first:
            return
        keys = cache.keys_for(seq.prompt_token_ids[: num_full * size])
        # Pages whose key another page already holds stay this sequence's own.
        cache.insert(keys[first:], seq.page_table[first:num_full])
        seq.num_keyed_pages = num_full

    def _num_freed_by(self, victim: Sequence, released: Counter[int]) -> int:
        """Pages preempting ``victim`` makes free, given the references earlier
        victims of the same step give back (counted into ``released``)."""
        cache = self._cache
        if cache is None:
            return len(victim.page_table)
        freed = 0
        for page in victim.page_table:
            if not cache.is_cached(page):
                freed += 1
                continue
            released[page] += 1
            if cache.refcount(page) == released[page]:
                freed += 1
        return freed
