"""KV checksums over the pages themselves, not over the bytes on the wire.

A per-frame CRC (`checksum.py`) only proves the wire carried what the
sender's staging buffer held. It says nothing when the sender read the wrong
source page, or the receiver wrote into the wrong destination page — and
`shm` has no wire at all. So, with `transfer.checksum` on, prefill computes a
CRC-32 of the KV it owes each decode rank from its *source pages* (located by
the request's own page table, not by the transfer job), and decode computes
the same over its *destination pages* (located by the room's page table)
once every source reported Success; a difference fails the room with
`checksum_mismatch`.

Both sides must hash the same bytes in the same order, whatever their pools'
layouts and page tables: token-major, one token's [layers, K/V, heads,
head_dim] after another, over the slice one prefill rank sends one decode
rank (its layers and heads in common, its cp token range). The CRC runs on,
so prefill can feed it chunk by chunk in token order (`crc` = the value so far).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from pdcluster.runtime.engine.kv_pool import KVPool


def token_slots(page_table: Sequence[int], start: int, end: int, page_size: int) -> list[int]:
    """Pool slots of tokens [start, end) of a request with this page table."""
    return [page_table[t // page_size] * page_size + t % page_size for t in range(start, end)]


def compute_kv_checksum(
    pool: KVPool,
    layers: Sequence[int],  # pool-local layer ids, ascending global order
    slots: Sequence[int],  # pool slots, in token order
    heads: tuple[int, int],  # pool-local kv heads [start, end)
    crc: int = 0,
) -> int:
    """CRC-32 of the tokens' KV, token-major, continuing from `crc`."""
    if not slots:
        return crc
    index = torch.tensor(list(slots), dtype=torch.int64, device=pool.device)
    frame = pool.gather_tokens(list(layers), index, slice(*heads))  # [L, 2, n, h, D]
    tokens = frame.permute(2, 0, 1, 3, 4).contiguous().cpu()  # [n, L, 2, h, D]
    data = tokens.reshape(-1).view(torch.uint8).numpy().tobytes()
    return zlib.crc32(data, crc) & 0xFFFFFFFF
