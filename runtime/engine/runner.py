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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.kv_pool import DTYPES, KVPool, KVPoolShape
from pdcluster.runtime.engine.model import LlamaModel, build_forward_batch
from pdcluster.runtime.engine.parallel import DistContext
from pdcluster.runtime.engine.sampling import SamplingParams, sample
from pdcluster.runtime.engine.topology import ParallelConfig, RankInfo
from pdcluster.runtime.engine.weights import ShardSpec, ShardWeights, load_model

# cb(rid, page_table, start, end): KV of tokens [start, end) is written on this rank.
PrefillChunkHook = Callable[[str, tuple[int, ...], int, int], None]


@dataclass(frozen=True)
class SampleSpec:
    params: SamplingParams
    seed: int  # the request's seed (drawn by the engine when the request gave none)
    index: int  # output position of the token sampled now


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
        self.model = LlamaModel(weights, all_reduce)
        self.on_prefill_chunk: PrefillChunkHook | None = None

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
        pool = KVPool(
            KVPoolShape(
                num_layers=len(layers),
                num_pages=config.num_pages,
                page_size=config.page_size,
                num_kv_heads=len(heads),
                head_dim=model_cfg.head_dim,
                dtype=config.kv_dtype,
                layout=config.kv_layout,
            ),
            device=device,
            shm_path=config.shm_path_for(info.rank),
        )
        return cls(config, weights, pool, dist)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Run the plan's forward on this rank; the leader gets {rid: sampled token}."""
        if not plan.chunks:
            return {}
        info, dist = self.info, self.dist
        batch = build_forward_batch(
            [(c.token_ids, c.start_pos, c.page_table) for c in plan.chunks],
            self.config.page_size,
            self.device,
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

        sampled = [i for i, c in enumerate(plan.chunks) if c.sample is not None]
        tokens: list[int] = []
        if info.returns_tokens and sampled:
            rows = batch.last_rows[sampled]  # [S]
            logits = self.model.logits(hidden[rows])  # [S, vocab]
            specs = [plan.chunks[i].sample for i in sampled]
            tokens = sample(logits, [(s.params, s.seed, s.index) for s in specs if s is not None])
            if not info.is_leader:
                assert dist is not None
                dist.send_tokens(tokens)
        if not info.is_leader:
            return {}
        if not info.returns_tokens and sampled:
            assert dist is not None
            tokens = dist.recv_tokens(len(sampled))
        return {plan.chunks[i].rid: t for i, t in zip(sampled, tokens, strict=True)}

    def _fire_prefill_hooks(self, plan: StepPlan) -> None:
        hook = self.on_prefill_chunk
        if hook is None:
            return
        for c in plan.chunks:
            if c.is_prefill:
                hook(c.rid, c.page_table, c.start_pos, c.start_pos + len(c.token_ids))


def run_follower(runner: ModelRunner) -> None:
    """Loop of a non-leader rank: receive each step plan and run it, until shutdown."""
    dist = runner.dist
    if dist is None or dist.info.is_leader:
        raise ValueError("run_follower() is for non-leader ranks of a multi-rank instance")
    while True:
        plan = dist.broadcast_plan(None, StepPlan)
        if plan.shutdown:
            return
        runner.execute(plan)
