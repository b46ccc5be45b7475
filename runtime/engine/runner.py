"""Executes one step plan on one rank: its weight shard, its KV pool, its part
of the forward pass.

Per step, every rank of a dp group gets the same `StepPlan` (the leader
builds it from the scheduler's batch). The first pipeline stage embeds the
tokens, later stages receive hidden states from the stage before; the last
stage of the cp = 0, tp = 0 pipeline samples and hands the tokens to the
leader. A rank fires `on_prefill_chunk` once its own layers have written a
prefill chunk's KV — the moment the transfer engine may ship those pages. On
a GPU, "written" means queued on the device's stream: whatever reads the pool
outside that stream's order waits for it first (`transfer/sender.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from pdcluster.runtime.engine.attention import select_attention
from pdcluster.runtime.engine.cuda_graphs import DecodeGraphs
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.forward_batch import build_forward_batch
from pdcluster.runtime.engine.kv_pool import DTYPES, KVPool, KVPoolShape
from pdcluster.runtime.engine.model import LlamaModel
from pdcluster.runtime.engine.parallel import DistContext
from pdcluster.runtime.engine.pool_sizing import DEFAULT_CPU_PAGES, num_pages_for_device
from pdcluster.runtime.engine.sampler import SampledTokens, SampleSpec, TokenLogprobs, sample
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.step_plan import ChunkPlan, StepPlan
from pdcluster.runtime.engine.topology import ParallelConfig, RankInfo
from pdcluster.runtime.engine.weights import ShardSpec, ShardWeights, load_model
from pdcluster.runtime.spec import pages_for

__all__ = [
    "ChunkPlan",
    "ModelRunner",
    "PrefillChunkHook",
    "SampleSpec",
    "StepPlan",
    "StepResult",
    "run_follower",
]

log = logging.getLogger("pdcluster.engine")

# cb(rid, page_table, start, end): KV of tokens [start, end) is written on this rank.
PrefillChunkHook = Callable[[str, tuple[int, ...], int, int], None]


@dataclass(frozen=True)
class StepResult:
    """What one step sampled (the leader's view; empty on other ranks)."""

    tokens: dict[str, int] = field(default_factory=dict)  # rid -> token
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # rids that asked


class ModelRunner:
    """One rank's model shard and KV pool."""

    def __init__(
        self,
        config: EngineConfig,
        weights: ShardWeights,
        pool: KVPool,
        dist: DistContext | None = None,
    ) -> None:
        self.config = config
        self.weights = weights
        self.pool = pool
        self.dist = dist
        self.info: RankInfo = dist.info if dist is not None else ParallelConfig().rank_info(0)
        self.device = torch.device(config.device) if dist is None else dist.device
        all_reduce = dist.all_reduce_tp if dist is not None and dist.tp_group is not None else None
        max_len = config.scheduler_config(weights.config.max_position_embeddings).max_model_len
        self.model = LlamaModel(
            weights,
            all_reduce,
            max_positions=max_len,
            attention=select_attention(pool, weights.layers[0].qkv.dtype, weights.num_q_heads),
        )
        self.on_prefill_chunk: PrefillChunkHook | None = None
        self.graphs: DecodeGraphs | None = None
        one_rank = config.parallel.world_size // config.parallel.dp == 1
        if (
            config.cuda_graphs
            and self.device.type == "cuda"
            and one_rank
            and self.model.attention.needs_varlen
        ):
            graphs = DecodeGraphs(
                self.model, pool, max_batch=config.max_running_requests, max_model_len=max_len
            )
            self.graphs = graphs if graphs.capture() else None

    @classmethod
    def build(cls, config: EngineConfig, dist: DistContext | None = None) -> ModelRunner:
        """Load this rank's shard and allocate its KV pool."""
        parallel = config.parallel
        info = dist.info if dist is not None else parallel.rank_info(0)
        if dist is None and parallel.world_size > 1:
            raise ValueError(
                f"a {parallel.world_size}-rank instance needs a DistContext (init_distributed)"
            )
        model_cfg = config.model_config()
        layers = info.layer_range(model_cfg.num_layers)
        heads = info.kv_head_range(model_cfg.num_kv_heads)
        device = dist.device if dist is not None else torch.device(config.device)
        shard = ShardSpec(
            tp_size=parallel.tp,
            tp_rank=info.tp_rank,
            layer_start=layers.start,
            layer_end=layers.stop,
        )
        weights = load_model(
            config.model, shard, DTYPES[config.compute_dtype], device, seed=config.model_seed
        )
        shape = KVPoolShape(
            num_layers=len(layers),
            num_pages=config.num_pages or DEFAULT_CPU_PAGES,
            page_size=config.page_size,
            num_kv_heads=len(heads),
            head_dim=model_cfg.head_dim,
            dtype=config.kv_dtype,
            layout=config.kv_layout,
        )
        if config.num_pages is None:
            num_pages = shape.num_pages
            if device.type == "cuda":
                num_pages = _pages_for_free_memory(config, weights, shape, device)
            if dist is not None:
                # Ranks of one group may see different free memory; they share page tables.
                num_pages = dist.min_over_group(num_pages)
            shape = replace(shape, num_pages=num_pages)
            log.info("KV pool: %d pages of %d tokens", num_pages, shape.page_size)
        pool = KVPool(shape, device=device, shm_path=config.shm_path_for(info.rank))
        return cls(config, weights, pool, dist)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan's forward on this rank; the leader gets what was sampled."""
        if not plan.chunks:
            return StepResult()
        info, dist = self.info, self.dist
        chunks = [(c.token_ids, c.start_pos, c.page_table) for c in plan.chunks]
        graphs = self.graphs
        if graphs is not None and graphs.can_run(chunks):
            # A decode-only step (every chunk samples): replay its graph.
            specs = [c.sample for c in plan.chunks if c.sample is not None]
            if len(specs) == len(chunks):
                return _result(plan, sample(graphs.run(chunks), specs))
        batch = build_forward_batch(
            chunks,
            self.config.page_size,
            self.device,
            samples=[c.sample is not None for c in plan.chunks],
            varlen=self.model.attention.needs_varlen,
        )
        if info.is_first_stage:
            hidden = self.model.embed(batch.token_ids)  # [T, hidden]
        else:
            assert dist is not None
            shape = (batch.num_tokens, self.weights.config.hidden_size)
            hidden = dist.recv_hidden(shape, self.model.dtype)  # [T, hidden]
        hidden = self.model.forward(batch, self.pool, hidden)
        if not info.is_last_stage:
            assert dist is not None
            dist.send_hidden(hidden)
        self._fire_prefill_hooks(plan)

        sampling = [c for c in plan.chunks if c.sample is not None]
        specs = [c.sample for c in sampling if c.sample is not None]
        sampled = None
        if info.returns_tokens and specs:
            logits = self.model.logits(hidden[batch.sample_rows])  # [S, vocab]
            sampled = sample(logits, specs)
            if not info.is_leader:
                assert dist is not None
                dist.send_sampled(sampled)
        if not info.is_leader or not specs:
            return StepResult()
        if sampled is None:
            assert dist is not None
            sampled = dist.recv_sampled()
        return _result(plan, sampled)

    def _fire_prefill_hooks(self, plan: StepPlan) -> None:
        hook = self.on_prefill_chunk
        if hook is None:
            return
        for c in plan.chunks:
            if c.is_prefill:
                hook(c.rid, c.page_table, c.start_pos, c.start_pos + len(c.token_ids))


def _result(plan: StepPlan, sampled: SampledTokens) -> StepResult:
    """The leader's view of a step: each sampling chunk's token and logprobs."""
    rids = [c.rid for c in plan.chunks if c.sample is not None]
    logprobs = {rid: lp for rid, lp in zip(rids, sampled.logprobs, strict=True) if lp is not None}
    return StepResult(dict(zip(rids, sampled.tokens, strict=True)), logprobs)


def _pages_for_free_memory(
    config: EngineConfig, weights: ShardWeights, shape: KVPoolShape, device: torch.device
) -> int:
    """Pages of `shape` that fit this rank's share of a CUDA device (`pool_sizing.py`)."""
    peak = _profile_step_bytes(config, weights, shape, device)
    free, total = torch.cuda.mem_get_info(device)
    bytes_per_page = shape.nbytes // shape.num_pages
    return num_pages_for_device(
        total_bytes=total,
        in_use_bytes=total - free,
        utilization=config.gpu_memory_utilization,
        peak_step_bytes=peak,
        bytes_per_page=bytes_per_page,
    )


def _profile_step_bytes(
    config: EngineConfig, weights: ShardWeights, shape: KVPoolShape, device: torch.device
) -> int:
    """Temporary device memory of the largest step: `max_batch_tokens` prompt tokens in
    chunks, then logits and sampling for `max_running_requests` rows. Runs this rank's
    layers alone (no collective: the sizes are what count, not the values)."""
    chunk = min(config.chunk_size, config.max_batch_tokens)
    lengths = [chunk] * (config.max_batch_tokens // chunk)
    if config.max_batch_tokens % chunk:
        lengths.append(config.max_batch_tokens % chunk)
    per_chunk = pages_for(chunk, shape.page_size)
    scratch = KVPool(replace(shape, num_pages=per_chunk * len(lengths)), device=device)
    model = LlamaModel(weights, None, max_positions=chunk)
    chunks = [
        ([0] * n, 0, list(range(i * per_chunk, (i + 1) * per_chunk))) for i, n in enumerate(lengths)
    ]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        batch = build_forward_batch(chunks, shape.page_size, device)
        hidden = torch.zeros(
            batch.num_tokens, weights.config.hidden_size, dtype=model.dtype, device=device
        )
        hidden = model.forward(batch, scratch, hidden)
        if model.is_last_stage:
            rows = min(config.max_running_requests, batch.num_tokens)
            logits = model.logits(hidden[:rows])
            spec = SampleSpec(SamplingParams(temperature=1.0, top_p=0.9), 0, 0)
            sample(logits, [spec] * rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch
    torch.cuda.empty_cache()
    return int(peak)


def run_follower(runner: ModelRunner) -> None:
    """Loop of a non-leader rank: receive each step plan and run it, until shutdown."""
    dist = runner.dist
    if dist is None or dist.info.is_leader:
        raise ValueError("run_follower() is for non-leader ranks of a multi-rank instance")
    while True:
        plan = dist.broadcast_plan(None)
        if plan.shutdown:
            return
        runner.execute(plan)
