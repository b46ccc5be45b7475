"""`LLMEngine`: the scheduler, the model runner and the request table glued together.

`step()` is: schedule → broadcast the plan to the group → run it → hand the
sampled tokens back to the scheduler → report what changed. The engine is
single-threaded: the caller serialises `add_request`, `abort`, `release` and
`step` (the worker server runs them on one thread).

Only the leader of a dp group (cp = tp = pp = 0) builds an LLMEngine; the
other ranks run `run_follower` with their own runner. With one rank there is
no torch.distributed at all.

Seeds: a request without a seed gets one drawn here, once, so all its tokens
follow the per-position rule of `sampling.py`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from pdcluster.runtime.engine.caching_allocator import CachingPageAllocator
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.page_allocator import PageAllocator
from pdcluster.runtime.engine.parallel import DistContext
from pdcluster.runtime.engine.runner import (
    ChunkPlan,
    ModelRunner,
    PrefillChunkHook,
    SampleSpec,
    StepPlan,
    StepResult,
    run_follower,
)
from pdcluster.runtime.engine.sampler import TokenLogprobs
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.scheduler import RequestRejected, ScheduledBatch, Scheduler
from pdcluster.runtime.engine.sequence import Sequence, SequenceMode, SequenceStatus
from pdcluster.runtime.engine.token_ids import first_bad_token, is_token
from pdcluster.runtime.engine.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "EngineRequest",
    "LLMEngine",
    "PrefixCacheStats",
    "RequestRejected",
    "StepOutput",
    "TokenLogprobs",
    "run_follower",
]


@dataclass(frozen=True)
class EngineRequest:
    rid: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mode: SequenceMode = SequenceMode.normal
    page_table: list[int] | None = None  # mode="prefilled": pages already filled
    first_token: int | None = None  # mode="prefilled": sampled by prefill
    # mode="prefilled", when the request asks for logprobs: the first token's,
    # computed where it was sampled.
    first_logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class StepOutput:
    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefill_done"
    # One per new token when the request asked for logprobs (else empty); None
    # where they are unknown (a prefilled request's first token sent without them).
    new_logprobs: tuple[TokenLogprobs | None, ...] = ()


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix cache counters (since start) and gauge (now) of one engine."""

    lookup_tokens: int  # known tokens of admitted sequences (each admission counts)
    hit_tokens: int  # of those, tokens whose KV came from the cache
    cached_pages: int  # gauge: pages in the cache, referenced or evictable
    evicted_pages: int  # cached pages taken back for new allocations


@dataclass
class _Request:
    params: SamplingParams
    seed: int
    num_reported: int = 0
    detok: IncrementalDetokenizer | None = None
    # Output position -> logprobs (only when the request asks for them).
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner | None = None,
        dist: DistContext | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """`runner`: built from `config` when omitted. `dist`: required when the
        instance has more than one rank (then this must be a leader rank).
        `tokenizer`: enables text stop strings (`SamplingParams.stop`)."""
        if runner is not None and dist is not None and runner.dist is not dist:
            raise ValueError("pass the DistContext the runner was built with")
        if dist is not None and not dist.info.is_leader:
            raise ValueError("LLMEngine runs on the leader rank; other ranks use run_follower()")
        self.config = config
        self.runner = runner if runner is not None else ModelRunner.build(config, dist)
        self.dist = self.runner.dist
        self.model_config = self.runner.weights.config
        self.tokenizer = tokenizer
        # With the prefix cache off the allocator is the plain one: nothing changes.
        num_pages = self.runner.pool.shape.num_pages  # sized at start when the config says None
        self.allocator: PageAllocator = (
            CachingPageAllocator(
                num_pages,
                page_size=config.page_size,
                salt=config.prefix_cache_salt(self.model_config),
                enabled=True,
            )
            if config.prefix_cache
            else PageAllocator(num_pages)
        )
        self.scheduler = Scheduler(
            config.scheduler_config(self.model_config.max_position_embeddings), self.allocator
        )
        self._requests: dict[str, _Request] = {}
        self._closed = False

    # ---- the contract ---------------------------------------------------

    @property
    def on_prefill_chunk(self) -> PrefillChunkHook | None:
        return self.runner.on_prefill_chunk

    @on_prefill_chunk.setter
    def on_prefill_chunk(self, hook: PrefillChunkHook | None) -> None:
        self.runner.on_prefill_chunk = hook

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def num_total_pages(self) -> int:
        return self.allocator.num_total

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """What the prefix cache reused and holds (all zero when it is off)."""
        alloc = self.allocator
        cached = evicted = 0
        if isinstance(alloc, CachingPageAllocator):
            m = alloc.metrics()
            cached, evicted = m.cached_pages, m.evicted_pages
        return PrefixCacheStats(
            lookup_tokens=self.scheduler.num_lookup_tokens,
            hit_tokens=self.scheduler.num_hit_tokens,
            cached_pages=cached,
            evicted_pages=evicted,
        )

    def check_admissible(
        self, prompt_len: int, max_tokens: int, prefill_only: bool = False
    ) -> None:
        """Raise RequestRejected if such a request could never run here."""
        if max_tokens > self.config.max_new_tokens:
            raise RequestRejected(
                f"max_tokens ({max_tokens}) exceeds this engine's max_new_tokens "
                f"({self.config.max_new_tokens})"
            )
        self.scheduler.check_admissible(prompt_len, max_tokens, prefill_only=prefill_only)

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request, or raise RequestRejected with nothing reserved or changed.

        For `prefilled`, the pages in `req.page_table` come from `self.allocator`
        and pass to the engine on success; on rejection they stay the caller's.
        """
        self._check_open()
        if not isinstance(req, EngineRequest):
            raise RequestRejected(f"expected an EngineRequest, got {type(req).__name__}")
        if not isinstance(req.sampling, SamplingParams):
            raise RequestRejected("sampling must be a SamplingParams")
        vocab = self.model_config.vocab_size
        ids = req.prompt_token_ids
        if not isinstance(ids, list):
            raise RequestRejected("prompt_token_ids must be a list of token ids")
        bad = first_bad_token(ids, vocab)
        if bad is not None:
            raise RequestRejected(
                f"prompt token id {ids[bad]!r} is outside the vocabulary [0, {vocab})"
            )
        if req.mode == SequenceMode.prefilled:
            if req.page_table is None or req.first_token is None:
                raise RequestRejected("a prefilled request needs page_table and first_token")
            if not is_token(req.first_token) or req.first_token >= vocab:
                raise RequestRejected(f"first_token {req.first_token!r} is outside the vocabulary")
        elif req.page_table is not None or req.first_token is not None:
            raise RequestRejected("page_table and first_token are only for mode 'prefilled'")
        if req.first_logprobs is not None and req.mode != SequenceMode.prefilled:
            raise RequestRejected("first_logprobs is only for mode 'prefilled'")
        params = req.sampling
        self.check_admissible(
            len(ids), params.max_tokens, prefill_only=req.mode == SequenceMode.prefill_only
        )
        eos = None if params.ignore_eos else self.model_config.eos_token_id
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += [i for i in self.model_config.eos_token_ids if i != eos]
        seq = Sequence(
            rid=req.rid,
            prompt_token_ids=list(ids),
            max_tokens=params.max_tokens,
            stop_token_ids=stop_ids,
            eos_token_id=eos,
            ignore_eos=params.ignore_eos,
            mode=req.mode,
        )
        if req.mode == SequenceMode.prefilled:
            assert req.page_table is not None and req.first_token is not None
            seq.page_table = list(req.page_table)
            seq.output_token_ids = [req.first_token]
            seq.num_computed_tokens = len(ids)
        detok = None
        if params.stop and self.tokenizer is not None and req.mode != SequenceMode.prefill_only:
            detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.scheduler.add(seq)  # raises RequestRejected with nothing changed
        entry = _Request(params=params, seed=seed, detok=detok)
        if req.first_logprobs is not None and params.logprobs is not None:
            entry.logprobs[0] = req.first_logprobs
        self._requests[req.rid] = entry

    def report_first_token(self, rid: str) -> list[StepOutput]:
        """The output for a just-added `prefilled` request's first token, reported now.

        That token was sampled by prefill, so it needs no forward step: without
        this, it would wait for the request's first decode step and leave with
        the second token. Reported the way a step reports it (stop strings
        included), exactly once. Empty for any other request, and for one that
        already finished on add (its end is reported by the next step).
        """
        seq = self.scheduler.get(rid)
        req = self._requests.get(rid)
        if seq is None or req is None or seq.mode != "prefilled" or seq.is_finished:
            return []
        if req.num_reported:
            return []
        return self._outputs([seq])

    def abort(self, rid: str) -> bool:
        """End the request with exactly this rid and free its pages.

        A finished prefill_only request keeps its pages (a transfer may still
        read them) until `release(rid)`; aborting it returns True and frees
        nothing. False when no request has this rid.
        """
        seq = self.scheduler.get(rid)
        if seq is None:
            return False
        if seq.status is SequenceStatus.HELD:
            return True
        self.scheduler.abort(rid)
        self._requests.pop(rid, None)
        return True

    def release(self, rid: str) -> None:
        """Free the pages of a finished prefill_only request (its KV was sent)."""
        self.scheduler.release(rid)
        self._requests.pop(rid, None)

    def has_work(self) -> bool:
        busy: bool = self.scheduler.has_work()
        return busy

    def step(self) -> list[StepOutput]:
        """Run one forward step; report every request that got tokens or ended."""
        self._check_open()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return self._outputs(self.scheduler.on_step_done({}))
        try:
            plan = self._plan(batch)
            if self.dist is not None:
                self.dist.broadcast_plan(plan)
            result = self.runner.execute(plan)
        except BaseException as err:
            failed = [seq.rid for seq in self.scheduler.fail_step()]
            for rid in failed:
                self._requests.pop(rid, None)
            if isinstance(err, Exception):
                raise StepFailed(tuple(failed), err) from err
            raise
        self._keep_logprobs(result)
        return self._outputs(self.scheduler.on_step_done(result.tokens))

    def shutdown(self) -> None:
        """Stop the followers of this group (multi-rank) and refuse further work."""
        if self._closed:
            return
        self._closed = True
        if self.dist is not None:
            self.dist.broadcast_plan(StepPlan(shutdown=True))

    # ---- internals ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine was shut down")

    def _plan(self, batch: ScheduledBatch) -> StepPlan:
        chunks = []
        for c in batch.chunks:
            spec = None
            if c.sample:
                seq = self.scheduler.get(c.rid)
                req = self._requests[c.rid]
                assert seq is not None
                spec = SampleSpec(req.params, req.seed, seq.num_output_tokens)
                if req.params.has_penalties:
                    spec = SampleSpec(
                        req.params,
                        req.seed,
                        seq.num_output_tokens,
                        tuple(seq.prompt_token_ids),
                        tuple(seq.output_token_ids),
                    )
            chunks.append(
                ChunkPlan(c.rid, c.token_ids, c.start_pos, c.page_table, c.is_prefill, spec)
            )
        return StepPlan(chunks=tuple(chunks))

    def _keep_logprobs(self, result: StepResult) -> None:
        """File each sampled token's logprobs under its output position."""
        for rid, lp in result.logprobs.items():
            seq, req = self.scheduler.get(rid), self._requests.get(rid)
            if seq is not None and req is not None:
                req.logprobs[seq.num_output_tokens] = lp

    def _outputs(self, changed: list[Sequence]) -> list[StepOutput]:
        outputs = []
        for seq in changed:
            req = self._requests.get(seq.rid)
            if req is None:
                continue
            first = req.num_reported
            new = seq.output_token_ids[first:]
            req.num_reported = seq.num_output_tokens
            lps: tuple[TokenLogprobs | None, ...] = ()
            if req.params.logprobs is not None:
                lps = tuple(req.logprobs.pop(i, None) for i in range(first, first + len(new)))
            if req.detok is not None and not seq.is_finished:
                req.detok.push(new)
                if req.detok.stopped:
                    self.scheduler.finish(seq.rid, "stop")
            finished = seq.is_finished
            outputs.append(StepOutput(seq.rid, new, finished, seq.finish_reason, lps))
            if finished and seq.status is not SequenceStatus.HELD:
                del self._requests[seq.rid]
        return outputs


class StepFailed(RuntimeError):
    """A forward step raised; `rids` are the requests it dropped (the engine stays usable)."""

    def __init__(self, rids: tuple[str, ...], cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.rids = rids
        self.cause = cause
