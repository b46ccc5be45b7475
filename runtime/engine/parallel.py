"""torch.distributed plumbing for one instance: groups, step-plan broadcast,
pipeline hand-offs, and a helper that starts one process per rank.

Two kinds of traffic, two kinds of groups:
- tensors of the forward pass (tp all-reduce, pp hidden states) use the
  main backend: gloo on CPU, nccl on CUDA;
- control traffic (the leader's step plan, sampled tokens back to the
  leader, as msgpack bytes: `step_plan.py`) always uses gloo groups on CPU,
  so the plan never makes a GPU round trip and the leader can block on it
  without holding a stream. A follower decodes only a `StepPlan` (never a
  pickle) and executes nothing else it receives.

`torch.distributed.new_group` must be called by every process in the same
order, even for groups it is not in, so groups are created from the fixed
lists of `ParallelConfig`.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from pdcluster.runtime.engine.rendezvous import RankGate, pass_gate
from pdcluster.runtime.engine.sampler import SampledTokens
from pdcluster.runtime.engine.step_plan import (
    StepPlan,
    decode_plan,
    decode_sampled,
    encode_plan,
    encode_sampled,
)
from pdcluster.runtime.engine.topology import ParallelConfig, RankInfo, TopologyError
from pdcluster.runtime.ports import free_port

# A step plan's bytes at most (a 4M-token chunk's ids and page table take ~40 MB).
MAX_PLAN_BYTES = 256 << 20

__all__ = [
    "DistContext",
    "ParallelConfig",
    "RankInfo",
    "TopologyError",
    "free_port",
    "init_distributed",
    "spawn_ranks",
]


@dataclass
class DistContext:
    """This process's place in the instance and the groups it talks over."""

    info: RankInfo
    device: torch.device
    tp_group: Any  # ProcessGroup of this rank's tp group (main backend), None when tp == 1
    control_group: Any  # gloo ProcessGroup of this rank's dp group
    store_listener: Any = None  # rank 0: the socket its TCP store serves on

    @property
    def world_size(self) -> int:
        size: int = self.info.parallel.world_size
        return size

    def all_reduce_tp(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place over the tp group."""
        if self.tp_group is not None:
            dist.all_reduce(tensor, group=self.tp_group)

    def broadcast_plan(self, plan: StepPlan | None) -> StepPlan:
        """Leader: send `plan` to its dp group. Others: pass None, get the plan
        (its size first, then its bytes; one over `MAX_PLAN_BYTES` or not a
        `StepPlan` raises, and the rank stops)."""
        if self.info.is_leader:
            if plan is None:
                raise ValueError("the leader must pass the plan it broadcasts")
            if self.info.parallel.group_size > 1:
                self._broadcast_bytes(encode_plan(plan))
            return plan
        data = self._broadcast_bytes(None)
        try:
            return decode_plan(data)
        except msgspec.DecodeError as err:
            raise RuntimeError(f"the leader's step plan is not a StepPlan: {err}") from None

    def _broadcast_bytes(self, data: bytes | None) -> bytes:
        """Leader: send `data` over the control group; others receive it."""
        src, group = self.info.leader_rank, self.control_group
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=src, group=group)
        if data is not None:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src, group)
            return data
        n = int(size[0])
        if not 0 < n <= MAX_PLAN_BYTES:
            raise RuntimeError(f"the leader's step plan is {n} bytes (limit {MAX_PLAN_BYTES})")
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=group)
        return buf.numpy().tobytes()

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """To the next pipeline stage of this rank's pipeline."""
        dist.send(hidden.contiguous(), dst=self.info.stage_rank(self.info.pp_rank + 1))

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src=self.info.stage_rank(self.info.pp_rank - 1))
        return out

    def send_sampled(self, sampled: SampledTokens) -> None:
        """Sampler rank → leader, over the control group."""
        data = torch.frombuffer(bytearray(encode_sampled(sampled)), dtype=torch.uint8)
        group = self.control_group
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), self.info.leader_rank, group)
        dist.send(data, dst=self.info.leader_rank, group=group)

    def recv_sampled(self) -> SampledTokens:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=self.info.sampler_rank, group=self.control_group)
        data = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.recv(data, src=self.info.sampler_rank, group=self.control_group)
        return decode_sampled(data.numpy().tobytes())

    def min_over_group(self, value: int) -> int:
        """The smallest of every rank's `value` in this dp group (control group)."""
        t = torch.tensor([value], dtype=torch.int64)
        if self.info.parallel.group_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t[0])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _resolve_device(device: str, info: RankInfo) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        count = torch.cuda.device_count()
        if count == 0:
            raise RuntimeError("device 'cuda' was requested but no CUDA device is visible")
        dev = torch.device("cuda", info.rank % count)
    return dev


def init_distributed(
    parallel: ParallelConfig,
    rank: int,
    master_addr: str,
    master_port: int,
    device: str = "cpu",
    timeout_s: float = 120.0,
    gate: RankGate | None = None,
    store: Any = None,
) -> DistContext:
    """Join the instance's process group and build this rank's groups.

    Every rank of the instance calls this with the same `parallel`,
    `master_addr` and `master_port`. Backend: nccl for CUDA, gloo otherwise.
    With `gate`, every rank proves the cluster token through the store
    first and rank 0 admits the world or refuses it (engine/rendezvous.py).
    """
    info = parallel.rank_info(rank)
    dev = _resolve_device(device, info)
    if master_addr.startswith("127.") or master_addr == "localhost":
        # Gloo binds the address its host name resolves to unless told
        # otherwise; keep single-host instances on the loopback interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    # Rank 0 hosts the store. Left to itself the store listens on every
    # interface; it is handed a socket bound to `master_addr` only (loopback
    # for a one-pod instance, the leader pod's IP for a multi-pod one).
    # `store` (rank 0 only): one this process hosts already (a multi-pod
    # instance's address directory shares dp group 0's store).
    listener = _bound_listener(master_addr, master_port) if rank == 0 and store is None else None
    if store is None:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            master_addr,
            master_port,
            parallel.world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.fileno() if listener is not None else None,
        )
        if listener is not None:
            # The store owns the descriptor now and closes it when it goes; the
            # socket object must not close it again (by then the number may be
            # another file's: a ZMQ context's, a pipe's).
            listener.detach()
    if gate is not None:
        pass_gate(store, gate, rank, parallel.world_size, timeout_s)
    dist.init_process_group(
        backend=backend,
        store=store,
        world_size=parallel.world_size,
        rank=rank,
        timeout=timeout,
    )
    tp_group = None
    for ranks in parallel.tp_groups():
        group = dist.new_group(ranks) if parallel.tp > 1 else None
        if rank in ranks:
            tp_group = group
    control_group = None
    for ranks in parallel.dp_groups():
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            control_group = group
    ctx = DistContext(info=info, device=dev, tp_group=tp_group, control_group=control_group)
    ctx.store_listener = listener  # detached: the store serves on (and owns) its descriptor
    return ctx


def host_store(host: str, port: int, timeout_s: float) -> tuple[Any, socket.socket]:
    """A TCP store served on `host:port` only, and the socket it was bound with
    (detached: the store owns its descriptor and closes it when it goes)."""
    listener = _bound_listener(host, port)
    store = _tcp_store(host, port, timeout_s, listen_fd=listener.fileno())
    listener.detach()  # the store owns (and closes) the descriptor from here on
    return store, listener


def dial_store(host: str, port: int, timeout_s: float) -> Any:
    """A client of the TCP store on `host:port` (retries until it answers or `timeout_s`)."""
    return _tcp_store(host, port, timeout_s)


def _tcp_store(host: str, port: int, timeout_s: float, listen_fd: int | None = None) -> Any:
    """The store's server on `listen_fd` (a socket bound to `host:port`), or a client of it."""
    return dist.TCPStore(  # type: ignore[attr-defined]
        host,
        port,
        None,
        is_master=listen_fd is not None,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def _bound_listener(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot bind the torch store to {host}:{port}: {err}") from err
    return sock


def _rank_main(
    target: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: Any,
    num_threads: int,
) -> None:
    torch.set_num_threads(num_threads)
    try:
        value = target(rank, world_size, port, *args)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    results.put((rank, True, value))


def _collect(
    procs: list[Any], results: Any, values: dict[int, Any], deadline: float, timeout_s: float
) -> str | None:
    """Gather every rank's result into `values`; the first failure as text, or None."""
    dead_since: float | None = None
    while len(values) < len(procs):
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            now = time.monotonic()
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            # A rank that raised puts its traceback on the queue before it
            # exits; give that report a moment to arrive before settling for
            # the bare exit code.
            if dead and dead_since is None:
                dead_since = now
            if dead_since is not None and now - dead_since > 1.0:
                return f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}"
            if now > deadline:
                return f"ranks did not finish within {timeout_s:.0f}s"
            continue
        if not ok:
            return f"rank {rank} failed:\n{value}"
        values[rank] = value
    return None


def spawn_ranks(
    target: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
    num_threads: int = 1,
) -> list[Any]:
    """Run `target(rank, world_size, master_port, *args)` in one process per rank.

    Returns every rank's return value (index = rank). If any rank fails, dies
    or the timeout passes, all ranks are stopped and RuntimeError carries the
    first failure. `target` must be importable (module level) and its return
    value picklable.
    """
    # A fork server that imported torch once hands out children in
    # milliseconds instead of a fresh interpreter importing torch per rank;
    # it never runs torch ops itself, so forking it is safe.
    ctx = multiprocessing.get_context("forkserver")
    preload = ["torch"] + ([target.__module__] if target.__module__ != "__main__" else [])
    ctx.set_forkserver_preload(preload)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(target, rank, world_size, port, args, results, num_threads),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    error: str | None = None
    try:
        error = _collect(procs, results, values, time.monotonic() + timeout_s, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=5.0 if error is None else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    if error is not None:
        raise RuntimeError(error)
    return [values[r] for r in range(world_size)]
