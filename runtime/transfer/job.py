"""What a sender is asked to move: one `TransferJob` (pure).

A job moves the K/V of the destination token positions
`[token_start, token_end)` for a set of layers and one head slice, from
slots of the local pool to a destination rank. Layer ids and heads are given
on both sides because tp and pp may differ between prefill and decode:
`src_layers[i]` lands in `dst_layers[i]`, local heads `src_heads` land in
the destination's `dst_heads`.

`dst_slots` is only used by one-sided transports (`shm`), which write the
destination pool directly; `tcp` leaves placement to the receiver, which
maps token positions through the room's page table, so a frame can never be
aimed at pages the receiver did not hand out for that room.

Invariant: `check_job` accepts exactly the jobs a sender can execute
without touching memory outside the named slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdcluster.runtime.transfer.frames import MAX_ROOM, PoolGeometry


@dataclass(frozen=True)
class TransferJob:
    room: int
    generation: int
    peer: str  # destination rank's endpoint address, e.g. "tcp://127.0.0.1:5555"
    src_slots: Sequence[int]  # local slots of the tokens, in token order
    token_start: int  # destination token positions [token_start, token_end)
    token_end: int
    src_layers: tuple[int, ...]
    dst_layers: tuple[int, ...]
    src_heads: tuple[int, int]  # [start, end) of local kv heads
    dst_heads: tuple[int, int]  # [start, end) of the destination's kv heads
    dst_slots: Sequence[int] | None = None  # one-sided transports: destination slots
    is_last: bool = False  # the sender's last job for this room
    notify: bytes | None = None  # control message sent to `peer` once the data is out

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def num_heads(self) -> int:
        return self.src_heads[1] - self.src_heads[0]


def check_job(job: TransferJob, src: PoolGeometry, dst: PoolGeometry | None = None) -> None:
    """Raise ValueError naming the first reason `job` cannot run; None if it can.

    `dst` (the destination geometry) is known to one-sided transports only.
    """
    if not 0 <= job.room <= MAX_ROOM:
        raise ValueError(f"room {job.room} is not a positive int64")
    if job.generation < 0:
        raise ValueError(f"generation must be >= 0, got {job.generation}")
    if not job.peer.startswith("tcp://"):
        raise ValueError(f"peer must be a tcp:// endpoint address, got {job.peer!r}")
    if not 0 <= job.token_start < job.token_end:
        raise ValueError(f"token range [{job.token_start}, {job.token_end}) is empty")
    if len(job.src_slots) != job.num_tokens:
        raise ValueError(f"{len(job.src_slots)} src_slots for {job.num_tokens} tokens")
    _check_slots("src_slots", job.src_slots, src)
    _check_layers("src_layers", job.src_layers, src.num_layers)
    _check_layers("dst_layers", job.dst_layers, dst.num_layers if dst else None)
    if len(job.src_layers) != len(job.dst_layers):
        raise ValueError(f"{len(job.src_layers)} src_layers but {len(job.dst_layers)} dst_layers")
    _check_heads("src_heads", job.src_heads, src.num_kv_heads)
    _check_heads("dst_heads", job.dst_heads, dst.num_kv_heads if dst else None)
    if job.dst_heads[1] - job.dst_heads[0] != job.num_heads:
        raise ValueError(f"src_heads {job.src_heads} and dst_heads {job.dst_heads} differ in size")
    if dst is not None:
        if dst.dtype != src.dtype:
            raise ValueError(f"destination dtype {dst.dtype!r} != local dtype {src.dtype!r}")
        if dst.head_dim != src.head_dim:
            raise ValueError(f"destination head_dim {dst.head_dim} != local {src.head_dim}")
        if job.dst_slots is None:
            raise ValueError("a one-sided transport needs dst_slots")
        if len(job.dst_slots) != job.num_tokens:
            raise ValueError(f"{len(job.dst_slots)} dst_slots for {job.num_tokens} tokens")
        _check_slots("dst_slots", job.dst_slots, dst)


def _check_slots(name: str, slots: Sequence[int], pool: PoolGeometry) -> None:
    num_slots = pool.num_pages * pool.page_size
    if len(slots) and (min(slots) < 0 or max(slots) >= num_slots):
        raise ValueError(f"{name} outside the pool's 0..{num_slots - 1}")
    if len(set(slots)) != len(slots):
        raise ValueError(f"{name} repeats a slot")


def _check_layers(name: str, layers: tuple[int, ...], num_layers: int | None) -> None:
    if not layers:
        raise ValueError(f"{name} is empty")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name} repeats a layer: {list(layers)}")
    if min(layers) < 0:
        raise ValueError(f"{name} {list(layers)} holds a negative layer id")
    if num_layers is not None and max(layers) >= num_layers:
        raise ValueError(f"{name} {list(layers)} outside 0..{num_layers - 1}")


def _check_heads(name: str, heads: tuple[int, int], num_heads: int | None) -> None:
    start, end = heads
    if not 0 <= start < end:
        raise ValueError(f"{name} [{start}, {end}) is empty or negative")
    if num_heads is not None and end > num_heads:
        raise ValueError(f"{name} [{start}, {end}) exceeds the pool's {num_heads} kv heads")
