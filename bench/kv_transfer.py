"""KV transfer throughput: each transport next to its raw limit, in one run.

    .venv/bin/python bench/kv_transfer.py [--sizes 1,16,256] [--repeats 5] [--threads 1] [--curve]

For every size (MiB of KV moved for one request):
- raw pyzmq: DEALER -> ROUTER on 127.0.0.1, zero-copy, the same number and
  size of frames our sender would use; nothing else (no gather, no scatter);
- tcp: KVSender (gather from shuffled pages into staging) -> Endpoint ->
  KVReceiver (scatter into shuffled pages), timed from submit to the arrival
  of the completion message, which travels behind the last frame;
- memcpy: one torch copy of the same number of contiguous bytes, on the
  pools' device (`--device cuda`: a device-to-device copy);
- shm: KVSender (gather) -> ShmTransport (scatter into the peer's pool file),
  timed from submit to completion;
- nixl (when the `nixl` extra imports): KVSender -> NixlTransport, NIXL
  WRITEs straight from the shuffled source pages into the shuffled
  destination pages of a pool that a second process owns and registered
  with its own agent (as a decode rank does), timed from submit to the
  completion message, which the sender sends only after every WRITE handle
  reported done;
- nixl to DONE: the same, timed from submit until the sender reports the
  job complete (every WRITE handle DONE, the point where prefill's control
  plane takes over), without a completion message: where raw NIXL stops;
- raw NIXL: the same two processes and the same descriptors (the page units
  of lists prepared once, per-frame descriptors for partial pages, per frame
  the sender would cut), made and posted directly by the agent, all in
  flight at once, until every handle is DONE (no sender, no control plane);
  nixl to DONE / raw NIXL is our plumbing's cost (sender thread, planner,
  posted-WRITE bookkeeping), nixl / raw NIXL that plus the completion
  message through two endpoints. Both are checked to land the right
  bytes in the other process's pool. The UCX transports that carried the
  bytes are printed (from UCX's info logs of both processes);
- tcp+curve (`--curve`): the tcp path again between two endpoints running
  CURVE (`spec.auth.zmqCurve`, keys from a fixed token), taking turns with
  the plain one; curve / tcp is its cost.
Each cell is the median of `--repeats` runs after one warm-up; ratio = the
transport's GiB/s over its raw limit's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import msgspec
import torch
import zmq

from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape, slots_for_positions
from pdcluster.runtime.pd.messages import NixlRegion
from pdcluster.runtime.spec import KVLayout, pages_for
from pdcluster.runtime.transfer.curve import cluster_keys
from pdcluster.runtime.transfer.endpoint import Endpoint, EndpointConfig
from pdcluster.runtime.transfer.frames import MiB
from pdcluster.runtime.transfer.job import TransferJob
from pdcluster.runtime.transfer.sender import KVSender, SenderConfig, plan_job_frames
from pdcluster.runtime.transfer.shm import ShmTransport
from pdcluster.runtime.transfer.tcp import KVReceiver, TcpTransport

GiB = float(1 << 30)


@dataclass
class Row:
    size_mib: int
    frames: int
    raw_zmq_gibs: float
    tcp_gibs: float
    tcp_ratio: float
    memcpy_gibs: float
    shm_gibs: float
    shm_ratio: float
    raw_zmq_cpu_s_per_gib: float
    tcp_cpu_s_per_gib: float
    nixl_gibs: float | None = None  # the nixl extra imports
    raw_nixl_gibs: float | None = None
    nixl_over_raw: float | None = None
    nixl_done_gibs: float | None = None
    nixl_done_over_raw: float | None = None
    nixl_over_tcp: float | None = None
    ucx_transports: str | None = None
    curve_gibs: float | None = None  # --curve: the tcp path under CURVE
    curve_over_tcp: float | None = None
    curve_cpu_s_per_gib: float | None = None


Timed = Callable[[], float]  # runs once, returns wall seconds


@dataclass
class Rate:
    gibs: float  # GiB/s, median over repeats
    cpu_s_per_gib: float  # CPU seconds of this process (all threads) per GiB moved


def measure(nbytes: int, runs: dict[str, Timed], repeats: int) -> dict[str, Rate]:
    """Median wall-clock rate of each runner, and its CPU cost per GiB.

    Runners take turns within every repeat, so a host whose load drifts
    (other jobs on a shared machine) treats them alike. CPU seconds per GiB
    (this process, all threads) is distorted less by such load than GiB/s.
    """
    for run in runs.values():
        run()  # warm-up: connections, staging buffers, page faults
    walls: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            cpu = time.process_time()
            walls[name].append(run())
            cpus[name].append(time.process_time() - cpu)
    gib = nbytes / GiB
    return {
        name: Rate(gib / statistics.median(walls[name]), statistics.median(cpus[name]) / gib)
        for name in runs
    }


# ---- raw limits -------------------------------------------------------------


def raw_zmq(frame_bytes: list[int]) -> Timed:
    """Seconds to push these frames DEALER -> ROUTER and receive them all.

    Two contexts, as two ranks have: each side gets its own libzmq I/O thread.
    """
    rx_ctx: zmq.Context[Any] = zmq.Context()
    tx_ctx: zmq.Context[Any] = zmq.Context()
    router = rx_ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = tx_ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payloads = [torch.randn(n // 4).view(torch.uint8).numpy() for n in frame_bytes]

    def run() -> float:
        done = threading.Event()

        def receive() -> None:
            for _ in payloads:
                router.recv_multipart(copy=False)
            done.set()

        thread = threading.Thread(target=receive)
        thread.start()
        start = time.perf_counter()
        for payload in payloads:
            dealer.send_multipart([b"K", b"h", payload], copy=False)
        done.wait()
        elapsed = time.perf_counter() - start
        thread.join()
        return elapsed

    def close() -> None:
        dealer.close(0)
        router.close(0)
        tx_ctx.term()
        rx_ctx.term()

    run.close = close  # type: ignore[attr-defined]
    return run


def memcpy(nbytes: int, device: str) -> Timed:
    """One copy of `nbytes` contiguous bytes on `device` (device to device on a GPU)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)

    def run() -> float:
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        return time.perf_counter() - start

    return run


# ---- our transports ---------------------------------------------------------


class Bench:
    """One prefill pool and one decode pool (in a shared-memory file), both shuffled."""

    def __init__(
        self,
        shape: KVPoolShape,
        num_tokens: int,
        config: SenderConfig,
        device: str,
        curve: bool = False,
    ) -> None:
        self.shape, self.num_tokens, self.config = shape, num_tokens, config
        self.tmp = tempfile.TemporaryDirectory(
            dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
        self.src = KVPool(shape, device=device)
        self.src.buffer.copy_(torch.randn(shape.dims()).to(self.src.dtype))
        # tcp lands in a pool on the same kind of device; shm always in a host file.
        self.dst_tcp = KVPool(shape, device=device)
        self.dst_shm = KVPool(shape, shm_path=os.path.join(self.tmp.name, "decode.pool"))
        pages = pages_for(num_tokens, shape.page_size)
        gen = torch.Generator().manual_seed(0)
        self.src_table = torch.randperm(shape.num_pages, generator=gen)[:pages].tolist()
        self.dst_table = torch.randperm(shape.num_pages, generator=gen)[:pages].tolist()
        positions = torch.arange(num_tokens)
        self.src_slots = slots_for_positions(self.src_table, positions, shape.page_size).tolist()
        self.dst_slots = slots_for_positions(self.dst_table, positions, shape.page_size).tolist()
        self.arrived = threading.Condition()
        self.notes: set[bytes] = set()
        self.decode = Endpoint(on_control=self._on_control)
        self.prefill = Endpoint()
        self.decode.start()
        self.prefill.start()
        self.receiver = KVReceiver(self.dst_tcp, lambda room, gen: self.dst_table)
        self.decode.on_kv = self.receiver.on_kv
        self.counter = 0
        self.decode_curve: Endpoint | None = None
        self.prefill_curve: Endpoint | None = None
        if curve:
            keyed = EndpointConfig(curve=cluster_keys("bench-token"), token="bench-token")
            self.decode_curve = Endpoint(keyed, on_control=self._on_control)
            self.prefill_curve = Endpoint(keyed)
            self.decode_curve.start()
            self.prefill_curve.start()
            self.decode_curve.on_kv = self.receiver.on_kv

    def _on_control(self, sender: str, data: bytes) -> None:
        with self.arrived:
            self.notes.add(data)
            self.arrived.notify_all()

    def job(self, one_sided: bool, peer: str | None = None) -> TransferJob:
        self.counter += 1
        layers = tuple(range(self.shape.num_layers))
        return TransferJob(
            room=self.counter,
            generation=0,
            peer=peer or self.decode.address,
            src_slots=self.src_slots,
            dst_slots=self.dst_slots if one_sided else None,
            token_start=0,
            token_end=self.num_tokens,
            src_layers=layers,
            dst_layers=layers,
            src_heads=(0, self.shape.num_kv_heads),
            dst_heads=(0, self.shape.num_kv_heads),
            is_last=True,
            notify=b"done-%d" % self.counter,
        )

    def timed(self, sender: KVSender, one_sided: bool, peer: str | None = None) -> Timed:
        def run() -> float:
            job = self.job(one_sided, peer)
            start = time.perf_counter()
            sender.submit(job)
            with self.arrived:
                assert self.arrived.wait_for(lambda: job.notify in self.notes, timeout=120)
            return time.perf_counter() - start

        return run

    def check(self, dst: KVPool) -> None:
        """The last transfer really landed: the decode pages equal the prefill pages."""
        layers = range(self.shape.num_layers)
        got = dst.gather_tokens(layers, torch.tensor(self.dst_slots, device=dst.device))
        want = self.src.gather_tokens(layers, torch.tensor(self.src_slots, device=self.src.device))
        if not torch.equal(got.cpu(), want.cpu()):
            raise SystemExit("transfer corrupted the KV: benchmark numbers are void")

    def close(self) -> None:
        for endpoint in (self.prefill_curve, self.decode_curve, self.prefill, self.decode):
            if endpoint is not None:
                endpoint.close()
        self.tmp.cleanup()


class NixlPair:
    """Our nixl transport and a raw NIXL baseline, both writing into a decode pool
    that another process owns (its own agent, as a decode rank has)."""

    def __init__(self, bench: Bench, config: SenderConfig) -> None:
        import multiprocessing

        from pdcluster.runtime.transfer.nixl import NixlTransport
        from pdcluster.runtime.transfer.nixl_agent import NixlAgent

        self.bench = bench
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        shape = bench.shape
        self.decode = ctx.Process(
            target=decode_process,
            args=(child, msgspec.to_builtins(asdict(shape)), str(bench.src.device)),
            daemon=True,
        )
        self.decode.start()
        child.close()
        self.region = msgspec.msgpack.decode(self.conn.recv_bytes(), type=NixlRegion)
        self.src_agent = NixlAgent("bench-prefill", bench.src, progress_thread=False)
        self.transport = NixlTransport(bench.prefill, self.src_agent)
        self.transport.register_peer(bench.decode.address, self.region, shape)
        self.completed = threading.Condition()
        self.completed_rooms: set[int] = set()
        self.sender = KVSender(bench.src, self.transport, config, on_complete=self._on_complete)
        self.sender.start()
        self._prepare_raw(config)

    def _on_complete(self, job: TransferJob) -> None:
        with self.completed:
            self.completed_rooms.add(job.room)
            self.completed.notify_all()

    def to_done(self) -> float:
        """Seconds from submit until the sender reports every WRITE of the job DONE
        (no completion message: the end point raw NIXL has)."""
        job = replace(self.bench.job(one_sided=True), notify=None)
        start = time.perf_counter()
        self.sender.submit(job)
        with self.completed:
            assert self.completed.wait_for(lambda: job.room in self.completed_rooms, timeout=120)
            elapsed = time.perf_counter() - start
            self.completed_rooms.discard(job.room)
        return elapsed

    def _prepare_raw(self, config: SenderConfig) -> None:
        """The raw baseline's WRITEs: per frame the sender cuts, the page units and
        per-frame descriptors `nixl_plan` gives, on lists prepared here (untimed)."""
        import numpy as np

        from pdcluster.runtime.transfer.nixl_agent import geometry_of
        from pdcluster.runtime.transfer.nixl_plan import (
            can_use_page_units,
            page_unit_grid,
            page_units,
            plan_descriptors,
            split_runs,
        )
        from pdcluster.runtime.transfer.shm import copy_runs

        b, nx, agent = self.bench, self.src_agent.agent, self.src_agent
        geo = geometry_of(b.shape)
        self.remote = nx.add_remote_agent(self.region.agent_metadata)
        if isinstance(self.remote, bytes):
            self.remote = self.remote.decode()
        units = page_units(geo)

        def descs(table: Any, base: int) -> Any:
            zeros = np.zeros(len(table), dtype=np.int64)
            return np.stack([table[:, 0] + base, table[:, 1], zeros], axis=1)

        self.local_units = nx.prep_xfer_dlist(
            "NIXL_INIT_AGENT", descs(units, agent.base_address), agent.mem_type
        )
        self.remote_units = nx.prep_xfer_dlist(
            self.remote, descs(units, self.region.base_address), self.region.mem_type
        )
        layers = [(i, i) for i in range(b.shape.num_layers)]
        heads = (0, b.shape.num_kv_heads)
        assert can_use_page_units(geo, geo, heads, heads)
        self.frames: list[tuple[Any, Any]] = []
        for s, e in plan_job_frames(b.job(one_sided=True), b.shape, config):
            runs = copy_runs(
                np.asarray(b.src_slots[s:e]), np.asarray(b.dst_slots[s:e]),
                b.shape.page_size, b.shape.page_size,
            )  # fmt: skip
            pages, rest = split_runs(runs, b.shape.page_size)
            indices = None
            if len(pages):
                grid = page_unit_grid(geo, geo, pages, layers, heads, heads)
                indices = (grid[0].ravel(), grid[1].ravel())
            rest_descs = None
            if rest:
                t = plan_descriptors(geo, geo, rest, layers, heads, heads)
                rest_descs = (
                    nx.get_xfer_descs(descs(t[:, [0, 2]], agent.base_address), agent.mem_type),
                    nx.get_xfer_descs(
                        descs(t[:, [1, 2]], self.region.base_address), self.region.mem_type
                    ),
                )
            self.frames.append((indices, rest_descs))

    def raw(self) -> float:
        """Seconds to make, post and finish every frame's WRITEs (all in flight at once)."""
        nx = self.src_agent.agent
        start = time.perf_counter()
        handles = []
        for indices, rest in self.frames:
            if indices is not None:
                handles.append(
                    nx.make_prepped_xfer(
                        "WRITE", self.local_units, indices[0], self.remote_units, indices[1]
                    )
                )
            if rest is not None:
                handles.append(nx.initialize_xfer("WRITE", rest[0], rest[1], self.remote))
        for h in handles:
            if nx.transfer(h) == "ERR":
                raise SystemExit("raw NIXL WRITE failed")
        for h in handles:
            while (state := nx.check_xfer_state(h)) == "PROC":
                pass
            if state != "DONE":
                raise SystemExit("raw NIXL WRITE failed")
            nx.release_xfer_handle(h)
        return time.perf_counter() - start

    def ask(self, command: str, *args: Any) -> Any:
        self.conn.send((command, args))
        return self.conn.recv()

    def check(self, run: Timed) -> None:
        """One run of `run` lands the right bytes in the decode process's pool."""
        self.ask("clear")
        run()
        layers = range(self.bench.shape.num_layers)
        src = self.bench.src.gather_tokens(
            layers, torch.tensor(self.bench.src_slots, device=self.bench.src.device)
        )
        want = zlib.crc32(src.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        if self.ask("crc", self.bench.dst_slots) != want:
            raise SystemExit("a NIXL WRITE corrupted the KV: benchmark numbers are void")

    def transports(self) -> str:
        """The UCX transports of the lanes that carried the bytes (both processes' logs)."""
        ours = self.src_agent.report()["ucx_transports"]
        theirs = self.ask("transports")
        return ",".join(sorted(set(ours) | set(theirs))) or "?"

    def close(self) -> None:
        self.sender.close()
        self.transport.close()
        self.ask("stop")
        self.decode.join(10)
        self.src_agent.close()


def decode_process(conn: Any, shape_fields: dict[str, Any], device: str) -> None:
    """The decode side of the nixl columns: a pool, its agent, and answers to the parent."""
    from pdcluster.runtime.transfer.nixl_agent import NixlAgent

    fields = dict(shape_fields, layout=KVLayout(shape_fields["layout"]))
    pool = KVPool(KVPoolShape(**fields), device=device)
    agent = NixlAgent("bench-decode", pool)  # a WRITE target keeps NIXL's progress thread
    conn.send_bytes(msgspec.msgpack.encode(agent.region()))
    while True:
        command, args = conn.recv()
        if command == "clear":
            pool.buffer.zero_()
            conn.send(None)
        elif command == "crc":
            layers = range(pool.shape.num_layers)
            got = pool.gather_tokens(layers, torch.tensor(args[0], device=pool.device))
            conn.send(zlib.crc32(got.cpu().contiguous().view(torch.uint8).numpy().tobytes()))
        elif command == "transports":
            conn.send(agent.report()["ucx_transports"])
        else:
            conn.send(None)
            agent.close()
            return


def run_size(size_mib: int, args: argparse.Namespace) -> Row:
    dtype_bytes = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    bytes_per_token = args.layers * 2 * args.heads * args.head_dim * dtype_bytes
    num_tokens = size_mib * MiB // bytes_per_token
    nbytes = num_tokens * bytes_per_token
    pages = pages_for(num_tokens, args.page_size) + 8
    shape = KVPoolShape(
        args.layers, pages, args.page_size, args.heads, args.head_dim, args.dtype,
        KVLayout(args.layout),
    )  # fmt: skip
    config = SenderConfig(max_frame_bytes=args.max_frame_mib * MiB, checksum=args.checksum)
    repeats = args.repeats if size_mib < 256 else max(2, args.repeats // 2)

    bench = Bench(shape, num_tokens, config, args.device, curve=args.curve)
    plan = plan_job_frames(bench.job(one_sided=False), shape, config)  # what the sender will cut
    raw = raw_zmq([(e - s) * bytes_per_token for s, e in plan])
    tcp = KVSender(bench.src, TcpTransport(bench.prefill), config)
    shm_transport = ShmTransport(bench.prefill)
    shm_transport.register_peer(bench.decode.address, bench.dst_shm.shm_path or "", shape)
    shm = KVSender(bench.src, shm_transport, config)
    pair = NixlPair(bench, config) if args.nixl else None
    curved: KVSender | None = None
    if bench.prefill_curve is not None and bench.decode_curve is not None:
        curved = KVSender(bench.src, TcpTransport(bench.prefill_curve), config)
    try:
        tcp.start()
        shm.start()
        runs = {
            "raw": raw,
            "tcp": bench.timed(tcp, one_sided=False),
            "memcpy": memcpy(nbytes, args.device),
            "shm": bench.timed(shm, one_sided=True),
        }
        if pair is not None:
            runs["nixl"] = bench.timed(pair.sender, one_sided=True)
            runs["nixl_done"] = pair.to_done
            runs["raw_nixl"] = pair.raw
            pair.check(runs["nixl"])
            pair.check(runs["nixl_done"])
            pair.check(runs["raw_nixl"])
        if curved is not None:
            assert bench.decode_curve is not None
            curved.start()
            runs["curve"] = bench.timed(curved, one_sided=False, peer=bench.decode_curve.address)
        rates = measure(nbytes, runs, repeats)
        bench.check(bench.dst_tcp)
        bench.check(bench.dst_shm)
        transports = pair.transports() if pair is not None else None
    finally:
        if pair is not None:
            pair.close()
        tcp.close()
        shm.close()
        if curved is not None:
            curved.close()
        bench.close()
        raw.close()  # type: ignore[attr-defined]
    return Row(
        size_mib=size_mib,
        frames=len(plan),
        raw_zmq_gibs=round(rates["raw"].gibs, 2),
        tcp_gibs=round(rates["tcp"].gibs, 2),
        tcp_ratio=round(rates["tcp"].gibs / rates["raw"].gibs, 2),
        memcpy_gibs=round(rates["memcpy"].gibs, 2),
        shm_gibs=round(rates["shm"].gibs, 2),
        shm_ratio=round(rates["shm"].gibs / rates["memcpy"].gibs, 2),
        raw_zmq_cpu_s_per_gib=round(rates["raw"].cpu_s_per_gib, 3),
        tcp_cpu_s_per_gib=round(rates["tcp"].cpu_s_per_gib, 3),
        nixl_gibs=round(rates["nixl"].gibs, 2) if "nixl" in rates else None,
        raw_nixl_gibs=round(rates["raw_nixl"].gibs, 2) if "nixl" in rates else None,
        nixl_over_raw=(
            round(rates["nixl"].gibs / rates["raw_nixl"].gibs, 2) if "nixl" in rates else None
        ),
        nixl_over_tcp=round(rates["nixl"].gibs / rates["tcp"].gibs, 2) if "nixl" in rates else None,
        nixl_done_gibs=round(rates["nixl_done"].gibs, 2) if "nixl" in rates else None,
        nixl_done_over_raw=(
            round(rates["nixl_done"].gibs / rates["raw_nixl"].gibs, 2) if "nixl" in rates else None
        ),
        ucx_transports=transports,
        curve_gibs=round(rates["curve"].gibs, 2) if "curve" in rates else None,
        curve_over_tcp=(
            round(rates["curve"].gibs / rates["tcp"].gibs, 2) if "curve" in rates else None
        ),
        curve_cpu_s_per_gib=(round(rates["curve"].cpu_s_per_gib, 3) if "curve" in rates else None),
    )


# Each table: (header, cell as a format of the row `r`, markdown alignment).
Column = tuple[str, str, str]
RIGHT, LEFT = "---:", "---"
SIZE: Column = ("KV size", "{r.size_mib} MiB", RIGHT)
TCP: Column = ("tcp GiB/s", "{r.tcp_gibs:.2f}", RIGHT)
TCP_CPU: Column = ("CPU s/GiB tcp", "{r.tcp_cpu_s_per_gib:.3f}", RIGHT)

BASE_TABLE: list[Column] = [
    SIZE,
    ("frames", "{r.frames}", RIGHT),
    ("raw pyzmq GiB/s", "{r.raw_zmq_gibs:.2f}", RIGHT),
    TCP,
    ("tcp / raw", "{r.tcp_ratio:.2f}", RIGHT),
    ("memcpy GiB/s", "{r.memcpy_gibs:.2f}", RIGHT),
    ("shm GiB/s", "{r.shm_gibs:.2f}", RIGHT),
    ("shm / memcpy", "{r.shm_ratio:.2f}", RIGHT),
    ("CPU s/GiB raw", "{r.raw_zmq_cpu_s_per_gib:.3f}", RIGHT),
    TCP_CPU,
]
NIXL_TABLE: list[Column] = [
    SIZE,
    TCP,
    ("raw NIXL GiB/s", "{r.raw_nixl_gibs:.2f}", RIGHT),
    ("nixl GiB/s", "{r.nixl_gibs:.2f}", RIGHT),
    ("nixl / raw NIXL", "{r.nixl_over_raw:.2f}", RIGHT),
    ("nixl to DONE GiB/s", "{r.nixl_done_gibs:.2f}", RIGHT),
    ("to DONE / raw NIXL", "{r.nixl_done_over_raw:.2f}", RIGHT),
    ("nixl / tcp", "{r.nixl_over_tcp:.2f}", RIGHT),
    ("UCX transports", "{r.ucx_transports}", LEFT),
]
CURVE_TABLE: list[Column] = [
    SIZE,
    TCP,
    ("tcp+curve GiB/s", "{r.curve_gibs:.2f}", RIGHT),
    ("curve / tcp", "{r.curve_over_tcp:.2f}", RIGHT),
    TCP_CPU,
    ("CPU s/GiB tcp+curve", "{r.curve_cpu_s_per_gib:.3f}", RIGHT),
]


def table(columns: list[Column], rows: list[Row]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return [
        line([header for header, _, _ in columns]),
        line([align for _, _, align in columns]),
        *(line([cell.format(r=r) for _, cell, _ in columns]) for r in rows),
    ]


def markdown(rows: list[Row]) -> str:
    lines = table(BASE_TABLE, rows)
    # The nixl and curve tables only when every size was measured with them.
    if all(r.nixl_gibs is not None for r in rows):
        lines += ["", *table(NIXL_TABLE, rows)]
    if all(r.curve_gibs is not None for r in rows):
        lines += ["", *table(CURVE_TABLE, rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,256", help="MiB of KV per transfer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8, help="kv heads on this rank")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--layout", default="NHD", choices=["NHD", "HND"])
    parser.add_argument("--max-frame-mib", type=int, default=16)
    parser.add_argument("--checksum", action="store_true", help="stamp and verify CRC-32")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the prefill pool (and the tcp decode pool) live; shm always writes a host pool",
    )
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--curve", action="store_true", help="also time the tcp path under CURVE (zmqCurve)"
    )
    parser.add_argument(
        "--no-nixl", dest="nixl", action="store_false", help="skip the nixl and raw NIXL columns"
    )
    args = parser.parse_args(argv)
    if args.nixl:
        from pdcluster.runtime.spec import UcxSpec
        from pdcluster.runtime.transfer.nixl_support import apply_ucx_env, nixl_import_error

        problem = nixl_import_error()
        if problem is not None:
            raise SystemExit(f"nixl does not import ({problem}); install the extra or --no-nixl")
        apply_ucx_env(UcxSpec())  # UCX logs the transports it selects
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# {args.layers} layers x {args.heads} kv heads x {args.head_dim} ({args.dtype}, "
        f"{args.layout}, page {args.page_size}, pools on {args.device}); "
        f"torch threads {torch.get_num_threads()}, "
        f"cpus {os.cpu_count()}",
        flush=True,
    )
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        rows.append(run_size(size, args))
        print(f"# {asdict(rows[-1])}", file=sys.stderr, flush=True)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
