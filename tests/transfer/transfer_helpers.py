"""Shared helpers for the transfer tests: pools, page tables, a resolver, waits."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcluster.runtime.engine.kv_pool import DTYPES, KVPool, KVPoolShape, slots_for_positions
from pdcluster.runtime.spec import KVLayout
from pdcluster.runtime.transfer.endpoint import Endpoint
from pdcluster.runtime.transfer.frames import KVFrameHeader
from pdcluster.runtime.transfer.job import TransferJob
from pdcluster.runtime.transfer.sender import KVSender, SenderConfig, Transport
from pdcluster.runtime.transfer.tcp import KVReceiver

# Frames small enough that a few-page room travels as several of them.
SMALL_FRAMES = SenderConfig(max_frame_bytes=2048, min_frame_bytes=512)
_ids = itertools.count()


def next_id() -> int:
    """A number no other test of this run has used (notify keys, file names, rooms)."""
    return next(_ids)


def make_shape(
    *,
    num_layers: int = 3,
    num_pages: int = 32,
    page_size: int = 4,
    num_kv_heads: int = 4,
    head_dim: int = 8,
    dtype: str = "float32",
    layout: KVLayout = KVLayout.NHD,
) -> KVPoolShape:
    return KVPoolShape(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, layout)


def random_pool(shape: KVPoolShape, seed: int, shm_path: str | None = None) -> KVPool:
    pool = KVPool(shape, shm_path=shm_path)
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(shape.dims(), generator=gen).to(DTYPES[shape.dtype]))
    return pool


def random_table(num_pages: int, pool_pages: int, seed: int) -> list[int]:
    """A page table of `num_pages` distinct, shuffled pages of a pool."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(pool_pages, generator=gen)[:num_pages].tolist()


def slots(table: Sequence[int], start: int, end: int, page_size: int) -> list[int]:
    positions = torch.arange(start, end)
    return slots_for_positions(table, positions, page_size).tolist()


def whole_job(
    src_table, dst_table, peer: str, tag: str, *, page_size=4, tokens=(0, 30), **kw
) -> TransferJob:
    """A one-job room moving `tokens` over every layer and head of the test shape
    to `peer` (`tag` names the transport in the notification); `kw` overrides any
    field. No `dst_table`: no destination slots (tcp places frames on receipt)."""
    base = dict(
        room=21,
        generation=0,
        peer=peer,
        src_slots=slots(src_table, *tokens, page_size),
        dst_slots=None if dst_table is None else slots(dst_table, *tokens, page_size),
        token_start=tokens[0],
        token_end=tokens[1],
        src_layers=(0, 1, 2),
        dst_layers=(0, 1, 2),
        src_heads=(0, 4),
        dst_heads=(0, 4),
        notify=f"{tag}-done-{next_id()}".encode(),
        is_last=True,
    )
    base.update(kw)
    return TransferJob(**base)  # type: ignore[arg-type]


def send_one_job(
    link: Link, src: KVPool, transport: Transport, job: TransferJob, drain_s: float
) -> list[TransferJob]:
    """Send `job` in small frames from a fresh sender, wait for decode's notification
    and for the room to drain; the jobs the sender reported complete."""
    completed: list[TransferJob] = []
    sender = KVSender(src, transport, SMALL_FRAMES, on_complete=completed.append)
    sender.start()
    try:
        assert sender.submit(job)
        link.inbox.wait_for(job.notify)
        assert sender.drain(job.room, timeout=drain_s)
    finally:
        sender.close()
    return completed


def frame_header(
    room: int,
    generation: int,
    *,
    layers: tuple[int, ...],
    tokens: tuple[int, int],
    heads: tuple[int, int],
    head_dim: int,
    dtype: str = "float32",
) -> KVFrameHeader:
    """A KV frame header from rank 0 whose shape agrees with its layers, tokens and
    heads (`msgspec.structs.replace` it to build a wrong one)."""
    return KVFrameHeader(
        room=room,
        generation=generation,
        src_rank=0,
        layers=layers,
        token_start=tokens[0],
        token_end=tokens[1],
        head_start=heads[0],
        head_end=heads[1],
        dtype=dtype,
        shape=(len(layers), 2, tokens[1] - tokens[0], heads[1] - heads[0], head_dim),
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, so comparisons are bit-exact (NaN-proof)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def expected_pool(
    src: KVPool,
    dst: KVPool,
    src_slots: Sequence[int],
    dst_slots: Sequence[int],
    src_layers: Sequence[int],
    dst_layers: Sequence[int],
    src_heads: tuple[int, int],
    dst_heads: tuple[int, int],
) -> torch.Tensor:
    """The destination buffer after a correct transfer, computed with the pool's own API."""
    ref = KVPool(dst.shape)
    ref.buffer.copy_(dst.buffer)
    frame = src.gather_tokens(src_layers, torch.tensor(src_slots), slice(*src_heads))
    ref.scatter_tokens(dst_layers, torch.tensor(dst_slots), frame, slice(*dst_heads))
    return ref.buffer


@dataclass
class Rooms:
    """A stand-in control plane: which (room, generation) may receive where."""

    tables: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self, room: int, generation: int, table: list[int]) -> None:
        with self.lock:
            self.tables[room] = (generation, table)

    def clear(self, room: int) -> None:
        with self.lock:
            self.tables.pop(room, None)

    def __call__(self, room: int, generation: int) -> list[int] | None:
        with self.lock:
            entry = self.tables.get(room)
        if entry is None or entry[0] != generation:
            return None
        return entry[1]


class Inbox:
    """Collects control messages an endpoint received."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self.cond = threading.Condition()

    def __call__(self, sender: str, data: bytes) -> None:
        with self.cond:
            self.messages.append((sender, data))
            self.cond.notify_all()

    def wait_for(self, data: bytes, timeout: float = 10.0) -> str:
        with self.cond:
            ok = self.cond.wait_for(
                lambda: any(d == data for _, d in self.messages), timeout=timeout
            )
            assert ok, f"no control message {data!r} within {timeout}s: {self.messages}"
            return next(s for s, d in self.messages if d == data)


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


@dataclass
class Link:
    """A prefill-side and a decode-side endpoint on 127.0.0.1."""

    prefill: Endpoint
    decode: Endpoint
    inbox: Inbox

    @classmethod
    def open(cls) -> Link:
        inbox = Inbox()
        decode = Endpoint(on_control=inbox)
        prefill = Endpoint()
        decode.start()
        prefill.start()
        return cls(prefill, decode, inbox)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


def decode_rank_main(
    shape: KVPoolShape, shm_path: str, tables: dict[bytes, list[int]], queue: Any
) -> None:
    """A decode rank in its own process.

    Its pool lives in `shm_path`. It receives room 1 over tcp into
    `tables[b"tcp-done"]` and lets a peer write `tables[b"shm-done"]` directly;
    on each completion message it reports that table's bytes, then exits.
    """
    pool = KVPool(shape, shm_path=shm_path)
    rooms = Rooms()
    rooms.open(1, 0, tables[b"tcp-done"])
    receiver = KVReceiver(pool, rooms)
    pending = set(tables)
    finished = threading.Event()

    def on_control(sender: str, data: bytes) -> None:
        if data in pending:
            table = tables[data]
            n = len(table) * shape.page_size
            idx = torch.tensor(slots(table, 0, n, shape.page_size))
            queue.put(
                (data, bits(pool.gather_tokens(range(shape.num_layers), idx)).numpy().tobytes())
            )
            pending.discard(data)
            if not pending:
                finished.set()

    endpoint = Endpoint(on_control=on_control, on_kv=receiver.on_kv)
    endpoint.start()
    queue.put(endpoint.address)
    ok = finished.wait(60)
    endpoint.close()
    raise SystemExit(0 if ok else 1)
