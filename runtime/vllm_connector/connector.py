"""`PDClusterConnector`: our KV transfer engine and control plane inside vLLM.

Selected like any external vLLM connector:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PDClusterConnector",
        "kv_connector_module_path": "pdcluster.runtime.vllm_connector.connector",
        "kv_role": "kv_producer" | "kv_consumer",
        "kv_connector_extra_config": {"sidePort": 8998, ...}}'      (settings.py)

This class only forwards each hook to its half: the scheduler half
(`scheduler.py`: the room book, the side port) or the worker half
(`worker.py`: our rank agent on vLLM's KV cache). Which hook is which step of
our protocol is in `docs/vllm-connector.md`.

The only module of ours that imports vLLM: the halves read plain numbers.
It imports nothing that needs our own torch pin, FastAPI version or the
operator, so vLLM's interpreter loads it with its own packages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from pdcluster.runtime.cluster_token import read_cluster_token
from pdcluster.runtime.pd_worker.agent import model_fingerprint
from pdcluster.runtime.spec import Role
from pdcluster.runtime.spec.base import SpecError
from pdcluster.runtime.vllm_connector.commands import RankNews, StepCommands
from pdcluster.runtime.vllm_connector.rank import EngineFacts
from pdcluster.runtime.vllm_connector.settings import load_settings, role_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class PDClusterMetadata(KVConnectorMetadata):
    """Scheduler → every rank, before a step's forward."""

    step: int
    commands: StepCommands
    # The step computes nothing: vLLM runs it only to poll loads and sends.
    idle: bool = False


@dataclass
class PDClusterWorkerMeta(KVConnectorWorkerMetadata):
    """Every rank → scheduler, after a step (vLLM folds the ranks' with `aggregate`)."""

    news: RankNews

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, PDClusterWorkerMeta):
            return self
        return PDClusterWorkerMeta(self.news.merged(other.news))


def _facts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, role: Role) -> EngineFacts:
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    from pdcluster.runtime.vllm_connector.worker import dtype_name

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise SpecError(
            f"the model has {len(groups)} KV cache groups: the PDCluster connector moves one "
            "(attention layers of one kind)"
        )
    spec = groups[0].kv_cache_spec
    config_json = model.hf_config.to_json_string(use_diff=False)
    return EngineFacts(
        role=role,
        tp_size=get_tensor_model_parallel_world_size(),
        tp_rank=get_tensor_model_parallel_rank(),
        num_layers=len(groups[0].layer_names),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        block_size=vllm_config.cache_config.block_size,
        kv_dtype=dtype_name(spec.dtype),
        model_fingerprint=model_fingerprint(
            str(model.model), 0, config_json, str(model.tokenizer), str(model.tokenizer_revision)
        ),
        pp_size=parallel.pipeline_parallel_size,
        dcp_size=parallel.decode_context_parallel_size,
        pcp_size=parallel.prefill_context_parallel_size,
        dp_size=parallel.data_parallel_size,
    )


def _attention_backend(vllm_config: VllmConfig) -> tuple[str, str | None]:
    """The attention backend's name, and its kernel variant where the backend picks
    one per engine (CPU_ATTN: the ISA its kernels lay pages out for)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention)
    found = {
        (layer.get_attn_backend().get_name(), getattr(layer, "isa", None))
        for layer in layers.values()
    }
    if len(found) != 1:
        raise SpecError(f"the model's attention layers use {sorted(found)}: one backend needed")
    return found.pop()


class PDClusterConnector(KVConnectorBase_V1):
    """Rooms, the bootstrap registry, KVPoll machines, ABORT/ACK, heartbeats and
    our transfer engine (tcp, nixl) behind vLLM's KV connector API."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        settings = load_settings(transfer.kv_connector_extra_config, os.environ)
        our_role = role_of(transfer.kv_role)
        token = read_cluster_token(os.environ, who="PDClusterConnector")
        self._scheduler: Any = None
        self._worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            from pdcluster.runtime.vllm_connector.scheduler import ConnectorScheduler

            self._scheduler = ConnectorScheduler(
                settings,
                our_role,
                vllm_config.cache_config.block_size,
                vllm_config.parallel_config.tensor_parallel_size,
                token,
            )
        else:
            from pdcluster.runtime.vllm_connector.worker import ConnectorWorker

            facts = _facts(vllm_config, kv_cache_config, our_role)
            self._worker = ConnectorWorker(settings, facts, token, f"{our_role}-tp{facts.tp_rank}")

    # ------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(
            request.request_id, request.kv_transfer_params, request.prompt_token_ids or []
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        result: tuple[int, bool] = self._scheduler.matched_tokens(
            request.request_id, num_computed_tokens
        )
        return result

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._scheduler.allocated(request.request_id, block_ids, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled: list[tuple[str, list[int], int]] = []
        tokens = scheduler_output.num_scheduled_tokens
        manager = self._kv_cache_manager
        if manager is not None:
            new = scheduler_output.scheduled_new_reqs
            cached = scheduler_output.scheduled_cached_reqs
            computed = {r.req_id: r.num_computed_tokens for r in new}
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
            for req_id, before in computed.items():
                if req_id in tokens:
                    scheduled.append(
                        (req_id, manager.get_block_ids(req_id)[0], before + tokens[req_id])
                    )
        step, commands = self._scheduler.step_commands(
            scheduled, scheduler_output.preempted_req_ids or ()
        )
        return PDClusterMetadata(step, commands, scheduler_output.total_num_scheduled_tokens == 0)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        news = meta.news if isinstance(meta, PDClusterWorkerMeta) else None
        self._scheduler.on_output(
            connector_output.finished_recving or (), connector_output.finished_sending or (), news
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        aborted = request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
        return self._scheduler.finished(request.request_id, aborted=aborted), None

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and bool(self._scheduler.has_pending_work())

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches, *_attention_backend(self._vllm_config))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._apply(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._apply(self._get_connector_metadata())

    def _apply(self, meta: KVConnectorMetadata) -> None:
        if isinstance(meta, PDClusterMetadata):
            self._worker.apply(meta.step, meta.commands, idle=meta.idle)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only once all of its KV landed."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: a step's chunk leaves in `wait_for_save` (see the docs)."""

    def wait_for_save(self) -> None:
        self._worker.after_forward()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done = self._worker.finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(done.sending),
            finished_recving=set(done.recving),
            failed_recving=set(done.failed_recving),
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self.get_transfer_results(finished_req_ids)
        return done.finished_sending, done.finished_recving

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        news = self._worker.news()
        return PDClusterWorkerMeta(news) if news else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
