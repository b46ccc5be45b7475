"""One forward step's inputs: the flattened tokens and where their context lives.

A step feeds chunks of several sequences at once: their new tokens are
flattened into one batch of T rows. Attention never copies a context into a
tensor padded to the longest sequence; it reads pages. What it needs is
described here, in page units, built on the host from the page tables and
copied to the device in one transfer:

- a sequence feeding one token (a decode step) is cut into *tiles* of
  `tile_pages` consecutive pages of its page table; every tile of every such
  sequence is attended in one batched call (`attention.py`), so a long
  context costs its own tiles and nothing more to its neighbours;
- a sequence feeding several tokens (a prefill chunk) lists its pages.

Slots: `slot = page * page_size + offset` (`kv_pool.py`); a new token's K/V
go to its slot before attention reads the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from pdcluster.runtime.spec import pages_for

# Target tokens per decode tile: big enough for an efficient batched matmul,
# small enough that a sequence's last, partly filled tile wastes little.
TILE_TOKENS = 64


@dataclass(frozen=True)
class PrefillChunk:
    """A sequence feeding several tokens this step."""

    rows: slice  # its rows in the flattened batch
    start_pos: int  # position of its first new token
    end_pos: int  # one past its last
    pages: torch.Tensor  # [pages_for(end_pos)] int64: pages of positions 0..end_pos-1


@dataclass(frozen=True)
class DecodeTiles:
    """Every sequence feeding one token this step, cut into tiles of pages."""

    rows: torch.Tensor  # [B] int64: their rows in the flattened batch
    pages: torch.Tensor  # [P, tile_pages] int64: each tile's pages (padding: page 0, masked)
    owner: torch.Tensor  # [P] int64: which of the B sequences a tile belongs to (grouped)
    valid: torch.Tensor  # [P, 1, 1, tile_pages * page_size] bool: True at a context position


@dataclass(frozen=True)
class VarlenLayout:
    """The batch as a fused varlen kernel with a block table reads it (CUDA)."""

    cu_seq_q: torch.Tensor  # [N + 1] int32: row offsets of the N sequences
    cu_seq_k: torch.Tensor  # [N + 1] int32: cumulative context lengths
    seq_lens: torch.Tensor  # [N] int32: context length of each sequence
    block_table: torch.Tensor  # [N, max_pages] int32: page tables, padded with page 0
    max_q: int
    max_k: int


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: where the new tokens' K/V go
    last_rows: torch.Tensor  # [N] int64: each sequence's last row (where logits come from)
    sample_rows: torch.Tensor  # [S] int64: the last rows of the sequences that sample
    decode: DecodeTiles | None
    prefill: tuple[PrefillChunk, ...]
    varlen: VarlenLayout | None  # only when asked for (`build_forward_batch(varlen=True)`)
    page_size: int
    # [T] int64, captured decode steps only (`cuda_graphs.py`): the row whose K/V
    # each row writes. A padding row repeats a real row's slot and writes that
    # row's K/V, so the slot gets the same bytes whichever write lands last.
    write_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def tile_pages_for(page_size: int) -> int:
    return max(1, TILE_TOKENS // page_size)


def build_forward_batch(
    chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]],
    page_size: int,
    device: str | torch.device = "cpu",
    *,
    samples: Sequence[bool] | None = None,
    varlen: bool = False,
) -> ForwardBatch:
    """chunks: (new token ids, start position, page table) per sequence.

    `samples`: which sequences sample this step (default: all), for
    `sample_rows`. `varlen`: also lay the batch out for a fused varlen
    kernel (`VarlenLayout`).
    """
    if not chunks:
        raise ValueError("a forward batch needs at least one sequence")
    ps = page_size
    k = tile_pages_for(ps)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_rows: list[int] = []
    decode_rows: list[int] = []
    tile_pages: list[int] = []
    tile_owner: list[int] = []
    tile_start: list[int] = []
    tile_end: list[int] = []
    prefill: list[tuple[int, int, int, int]] = []  # (first row, start, end, offset in pages)
    prefill_pages: list[int] = []
    seq_ends: list[int] = []
    tables: list[Sequence[int]] = []
    for token_ids, start, table in chunks:
        n = len(token_ids)
        if n == 0:
            raise ValueError("a sequence in a forward batch has no tokens")
        end = start + n
        if len(table) * ps < end:
            raise ValueError(
                f"page table of {len(table)} pages holds {len(table) * ps} tokens, "
                f"the sequence needs {end}"
            )
        num_pages = pages_for(end, ps)
        row = len(ids)
        ids.extend(token_ids)
        positions.extend(range(start, end))
        # New slots page by page: a run of consecutive slots per page touched.
        for j in range(start // ps, num_pages):
            lo, hi = max(start, j * ps), min(end, (j + 1) * ps)
            base = table[j] * ps - j * ps
            slots.extend(range(base + lo, base + hi))
        last_rows.append(row + n - 1)
        seq_ends.append(end)
        tables.append(table)
        if n == 1:
            owner = len(decode_rows)
            decode_rows.append(row)
            for j in range(0, num_pages, k):
                part = list(table[j : min(j + k, num_pages)])
                tile_pages.extend(part + [0] * (k - len(part)))
                tile_owner.append(owner)
                tile_start.append(j * ps)
                tile_end.append(end)
        else:
            prefill.append((row, start, end, len(prefill_pages)))
            prefill_pages.extend(table[:num_pages])

    if samples is None:
        sample_rows = last_rows
    elif len(samples) != len(chunks):
        raise ValueError(f"{len(samples)} sample flags for {len(chunks)} sequences")
    else:
        sample_rows = [r for r, s in zip(last_rows, samples, strict=True) if s]
    parts: list[list[int]] = [
        ids,
        positions,
        slots,
        last_rows,
        sample_rows,
        decode_rows,
        tile_pages,
        tile_owner,
        tile_start,
        tile_end,
        prefill_pages,
    ]
    if varlen:
        width = max(pages_for(e, ps) for e in seq_ends)
        rows_q = [0]
        for token_ids, _, _ in chunks:
            rows_q.append(rows_q[-1] + len(token_ids))
        cu_k = [0]
        for e in seq_ends:
            cu_k.append(cu_k[-1] + e)
        table_rows: list[int] = []
        for e, table in zip(seq_ends, tables, strict=True):
            used = list(table[: pages_for(e, ps)])
            table_rows.extend(used + [0] * (width - len(used)))
        parts += [rows_q, cu_k, seq_ends, table_rows]
    # One host tensor, one copy to the device; the pieces are views of it.
    flat = torch.tensor(list(chain.from_iterable(parts)), dtype=torch.int64).to(device)
    pieces = list(torch.split(flat, [len(p) for p in parts]))
    t_ids, t_pos, t_slots, t_last, t_sample, t_rows, t_pages = pieces[:7]
    t_owner, t_start, t_end, t_prefill = pieces[7:11]
    decode = None
    if decode_rows:
        width = k * ps
        offsets = torch.arange(width, dtype=torch.int64, device=flat.device)
        valid = (t_start.unsqueeze(1) + offsets) < t_end.unsqueeze(1)  # [P, width]
        decode = DecodeTiles(
            rows=t_rows,
            pages=t_pages.view(-1, k),
            owner=t_owner,
            valid=valid.view(-1, 1, 1, width),
        )
    chunks_out = tuple(
        PrefillChunk(
            rows=slice(row, row + end - start),
            start_pos=start,
            end_pos=end,
            pages=t_prefill[offset : offset + pages_for(end, ps)],
        )
        for row, start, end, offset in prefill
    )
    layout = None
    if varlen:
        cu_q, cu_k_t, lens, table_t = (p.to(torch.int32) for p in pieces[11:])
        layout = VarlenLayout(
            cu_seq_q=cu_q,
            cu_seq_k=cu_k_t,
            seq_lens=lens,
            block_table=table_t.view(len(chunks), -1),
            max_q=max(len(c[0]) for c in chunks),
            max_k=max(seq_ends),
        )
    return ForwardBatch(
        token_ids=t_ids,
        positions=t_pos,
        slots=t_slots,
        last_rows=t_last,
        sample_rows=t_sample,
        decode=decode,
        prefill=chunks_out,
        varlen=layout,
        page_size=ps,
    )
