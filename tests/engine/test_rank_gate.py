"""The token gate in front of torch.distributed (engine/rendezvous.py), with real
rank processes meeting at a real TCP store on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from pdcluster.runtime.engine.parallel import dial_store, host_store, spawn_ranks
from pdcluster.runtime.engine.rendezvous import RankGate, pass_gate
from pdcluster.runtime.engine.topology import ParallelConfig
from pdcluster.runtime.pod_rendezvous import (
    NONCE_KEY,
    VERDICT_KEY,
    RankIdentity,
    RendezvousError,
    proof_key,
)
from pdcluster.runtime.ports import free_port

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


# ------------------------------------------------ replays and impostors, real TCP stores


def _gate(token: str = "tok") -> RankGate:
    return RankGate(token, WHO)


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as err:  # the test reads it
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _rendezvous_of_two(token: str = "tok") -> str:
    """Two honest ranks meet at a fresh store; what rank 1 left there, as anyone reads it."""
    port = free_port()
    store, listener = host_store("127.0.0.1", port, 20)
    try:
        peer = dial_store("127.0.0.1", port, 20)
        leader, out = _in_thread(lambda: pass_gate(store, _gate(token), 0, 2, 20))
        pass_gate(peer, _gate(token), 1, 2, 20)
        leader.join(20)
        assert "error" not in out, out
        return str(peer.get(proof_key(1)).decode())
    finally:
        assert listener.fileno() == -1  # the store owns (and closes) its descriptor


def test_a_proof_read_in_one_rendezvous_is_refused_in_the_next() -> None:
    """Anyone who reaches the store port reads the proofs in it; copied into the
    next rendezvous (without the token), one must not admit its writer."""
    copied = _rendezvous_of_two()
    port = free_port()
    store, listener = host_store("127.0.0.1", port, 20)
    try:
        impostor = dial_store("127.0.0.1", port, 20)
        leader, out = _in_thread(lambda: pass_gate(store, _gate(), 0, 2, 20))
        impostor.set(proof_key(1), copied)
        leader.join(30)
        assert isinstance(out.get("error"), RendezvousError), out
        assert "rank 1 did not prove" in str(out["error"])
        assert not impostor.get(VERDICT_KEY).decode().startswith("ok")
    finally:
        assert listener.fileno() == -1  # the store owns (and closes) its descriptor


def test_a_verdict_written_without_the_token_admits_no_rank() -> None:
    """The store is not the leader's alone: an "ok" anyone wrote must not let a
    rank join a world it was never admitted to."""
    port = free_port()
    store, listener = host_store("127.0.0.1", port, 20)
    try:
        store.set(NONCE_KEY, "0" * 32)  # an impostor hosting the store plays the leader
        rank, out = _in_thread(
            lambda: pass_gate(dial_store("127.0.0.1", port, 20), _gate(), 1, 2, 5)
        )
        deadline = time.monotonic() + 10
        while not store.check([proof_key(1)]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        store.set(VERDICT_KEY, "ok")
        rank.join(20)
        assert isinstance(out.get("error"), RendezvousError), out
        assert "not signed" in str(out["error"])
    finally:
        assert listener.fileno() == -1  # the store owns (and closes) its descriptor


def exchanged_endpoints(rank: int, world_size: int, port: int) -> list[str]:
    from pdcluster.runtime.engine.parallel import init_distributed
    from pdcluster.runtime.pd_worker.startup import exchange_endpoints

    ctx = init_distributed(ParallelConfig(tp=world_size), rank, "127.0.0.1", port)
    try:
        return exchange_endpoints(ctx, f"tcp://127.0.0.1:{7000 + rank}")
    finally:
        ctx.close()


def test_ranks_learn_each_others_endpoints_without_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    got = spawn_ranks(exchanged_endpoints, 2, timeout_s=120)
    assert got == [["tcp://127.0.0.1:7000", "tcp://127.0.0.1:7001"]] * 2


def test_a_hosted_store_alone_closes_its_descriptor() -> None:
    """The store takes the bound socket's descriptor over and closes it when it goes:
    the socket object must never close that number again (it may be another file's
    by then: a ZMQ context's, a pipe's)."""
    import gc
    import os

    store, listener = host_store("127.0.0.1", free_port(), 10)
    assert listener.fileno() == -1
    read, write = os.pipe()
    try:
        del store
        gc.collect()
        listener.close()  # a no-op: it owns nothing
        os.write(write, b"x")
        assert os.read(read, 1) == b"x"
    finally:
        os.close(read)
        os.close(write)
