"""The token gate in front of torch.distributed (engine/rendezvous.py), with real
rank processes meeting at a real TCP store on loopback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pdcluster.runtime.engine.parallel import spawn_ranks
from pdcluster.runtime.engine.rendezvous import RankGate
from pdcluster.runtime.engine.topology import ParallelConfig
from pdcluster.runtime.pod_rendezvous import RankIdentity

WHO = RankIdentity("demo", "prefill", 0)


def gated_rank(rank: int, world_size: int, port: int, tokens: list[str]) -> float:
    from pdcluster.runtime.engine.parallel import init_distributed

    ctx = init_distributed(
        ParallelConfig(tp=world_size), rank, "127.0.0.1", port, gate=RankGate(tokens[rank], WHO)
    )
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=ctx.tp_group)
        return float(t.item())
    finally:
        ctx.close()


def test_ranks_proving_the_token_form_the_world() -> None:
    assert spawn_ranks(gated_rank, 2, (["tok", "tok"],), timeout_s=120) == [3.0, 3.0]


def test_a_rank_without_the_token_is_refused_before_any_collective() -> None:
    with pytest.raises(RuntimeError, match="refused"):
        spawn_ranks(gated_rank, 2, (["tok", "not-the-token"],), timeout_s=120)


def store_reachable_at(rank: int, world_size: int, port: int, other_host: str) -> tuple[bool, bool]:
    import socket

    from pdcluster.runtime.engine.parallel import init_distributed

    ctx = init_distributed(ParallelConfig(), rank, "127.0.0.1", port)
    try:
        reached = []
        for host in ("127.0.0.1", other_host):
            with socket.socket() as sock:
                reached.append(sock.connect_ex((host, port)) == 0)
        return reached[0], reached[1]
    finally:
        ctx.close()


def test_the_store_listens_on_the_address_it_was_given_only() -> None:
    # 127.0.0.2 is this host too: a store on every interface would answer there.
    assert spawn_ranks(store_reachable_at, 1, ("127.0.0.2",), timeout_s=120) == [(True, False)]
