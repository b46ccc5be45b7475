"""Build and start the PD agent of one rank (leader or follower)."""

from __future__ import annotations

import logging
import os
from typing import Any

from pdcluster.runtime.engine.tokenizer import load_tokenizer
from pdcluster.runtime.pd.bootstrap_registry import INCARNATION_ENV
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.messages import PROTOCOL_VERSION
from pdcluster.runtime.pd.peer_address import BootstrapAddress
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd.topology import shape_of
from pdcluster.runtime.pd_worker.agent import AgentContext, RankAgent, model_fingerprint
from pdcluster.runtime.pd_worker.group import (
    ENDPOINT_FRAME_BYTES,
    pack_endpoint,
    unpack_endpoints,
)
from pdcluster.runtime.spec import Role

log = logging.getLogger("pdcluster.pd")


def agent_context(settings: Any, runner: Any, dp_rank: int) -> AgentContext:
    spec = settings.manifest.spec
    topo = settings.role_spec.topology
    info = runner.info
    model = runner.weights.config
    layers = info.layer_range(model.num_layers)
    heads = info.kv_head_range(model.num_kv_heads)
    cfg = runner.config
    # The tokenizer this worker serves with (worker_main loads the same one).
    tokenizer = load_tokenizer(settings.tokenizer or cfg.model, model.eos_token_id)
    compat = CompatInfo(
        page_size=cfg.page_size,
        kv_dtype=str(cfg.kv_dtype),
        kv_layout=str(cfg.kv_layout),
        allocation_policy=str(spec.transfer.allocation_policy),
        model_fingerprint=model_fingerprint(
            spec.model.name,
            spec.model.seed,
            model,
            tokenizer.fingerprint,
            tokenizer.chat_template_fingerprint,
        ),
        transfer_backend=str(spec.transfer.backend),
        protocol_version=PROTOCOL_VERSION,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
    )
    return AgentContext(
        role=settings.role,
        cluster=settings.manifest.metadata.name,
        instance=settings.instance,
        coord=RankCoord(dp=dp_rank, cp=info.cp_rank, tp=info.tp_rank, pp=info.pp_rank),
        group_rank=info.rank,
        group_size=topo.cp * topo.tp * topo.pp,
        shape=shape_of(topo),
        compat=compat,
        token=settings.token,
        room_settings=RoomSettings.from_spec(
            spec.transfer,
            prefill_wait_s=spec.transfer.prefill_wait_timeout_seconds,
            # A queued prefill leg's room already lives on decode and in the
            # prefill tables (decode's metadata): the tables hold both.
            max_rooms=spec.transfer.max_rooms + spec.transfer.room_queue_limit,
        ),
        transfer=spec.transfer,
        layers=(layers.start, layers.stop),
        heads=(heads.start, heads.stop),
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        page_size=cfg.page_size,
        num_pages=runner.pool.shape.num_pages,  # sized at start when the manifest gives none
        host=settings.host,
        advertise_host=settings.advertise_host,
        # Every pod's ranks register with the leader pod's bootstrap server.
        bootstrap_address=BootstrapAddress(
            f"{settings.leader_advertise_host}:{settings.bootstrap_port}"
        ),
        curve=bool(spec.auth.zmq_curve),
        incarnation=os.environ.get(INCARNATION_ENV) or None,
    )


def start_rank_agent(
    settings: Any, runner: Any, dp_rank: int, group_rank: int, leader: bool
) -> RankAgent:
    ctx = agent_context(settings, runner, dp_rank)
    agent: Any
    if settings.role is Role.prefill:
        from pdcluster.runtime.pd_worker.prefill_agent import PrefillAgent

        agent = PrefillAgent(ctx, runner.pool, is_leader=leader)
        runner.on_prefill_chunk = agent.on_chunk
    else:
        from pdcluster.runtime.pd_worker.decode_agent import DecodeAgent

        agent = DecodeAgent(ctx, runner.pool, runner.pool.shm_path)
    _exchange_addresses(agent, runner, leader)
    agent.start()
    if settings.role is Role.prefill:
        agent.register()
    log.info("rank %s (%s) endpoint %s", ctx.coord, settings.role, agent.address)
    started: RankAgent = agent
    return started


def _exchange_addresses(agent: Any, runner: Any, leader: bool) -> None:
    """Every rank learns the group's endpoints (gloo all-gather, once at start-up)."""
    dist_ctx = runner.dist
    if dist_ctx is None:
        return
    addresses = exchange_endpoints(dist_ctx, agent.address)
    if leader:
        agent.follower_addresses = [a for i, a in enumerate(addresses) if i != runner.info.rank]
    else:
        agent.leader_address = addresses[runner.info.leader_rank]


def exchange_endpoints(dist_ctx: Any, address: str) -> list[str]:
    """Every rank's control endpoint, in rank order, as typed fixed-size frames
    (group.py): nothing gathered here is unpickled."""
    import torch
    import torch.distributed as dist

    mine = torch.frombuffer(
        bytearray(pack_endpoint(dist_ctx.info.rank, address)), dtype=torch.uint8
    )
    frames = [
        torch.empty(ENDPOINT_FRAME_BYTES, dtype=torch.uint8) for _ in range(dist_ctx.world_size)
    ]
    dist.all_gather(frames, mine, group=dist_ctx.control_group)
    return unpack_endpoints([bytes(f.numpy().tobytes()) for f in frames])
