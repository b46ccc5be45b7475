"""Decode steps replayed from CUDA graphs, one capture per padded batch size.

A decode step (every sequence feeds one token) does the same work for a
given batch size; on a GPU, at small batches, its time is mostly the launch
of a dozen kernels per layer. A captured graph replays them with one launch.
What changes from step to step lives in static buffers the graph reads:
token ids, positions, slots, and the block tables and context lengths of the
varlen kernel (int32, its types). A batch of n sequences replays the
smallest captured size b >= n; rows n..b-1 repeat the last real row (token,
position, slot, block-table row) and write that row's K/V
(`ForwardBatch.write_rows`), so they change no page, and their logits are
dropped.

Captured only where every kernel of the step can be: a CUDA device, the
fused varlen attention (its block table has a fixed shape, where the paged
tiles' shape follows the contexts) and one rank (no collective, no pipeline
hand-off inside the graph). Sampling runs eagerly on the replayed logits. A
capture that fails leaves the engine eager, with a warning.

Not run in CI (no GPU there): `bench/gpu_check.sh` runs the `gpu` tests and
times decode with and without graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch

from pdcluster.runtime.engine.forward_batch import ForwardBatch, VarlenLayout
from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.engine.model import LlamaModel
from pdcluster.runtime.spec import pages_for

log = logging.getLogger("pdcluster.engine")

__all__ = ["DecodeGraphs", "capture_sizes"]

# (token ids, start position, page table) of one sequence, as the runner plans it.
Chunk = tuple[Sequence[int], int, Sequence[int]]


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes with a graph: powers of two up to the first that holds `max_batch`."""
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] * 2)
    return sizes


class DecodeGraphs:
    """The captured decode steps of one rank (`capture()` once, before serving)."""

    def __init__(
        self, model: LlamaModel, pool: KVPool, *, max_batch: int, max_model_len: int
    ) -> None:
        if not model.attention.needs_varlen:
            raise ValueError("decode graphs need an attention that reads a block table")
        self.model, self.pool = model, pool
        self.sizes = capture_sizes(max_batch)
        self.max_model_len = max_model_len
        self.max_pages = pages_for(max_model_len, pool.shape.page_size)
        device, most = pool.device, self.sizes[-1]
        self._i64 = torch.zeros(4, most, dtype=torch.int64, device=device)  # ids, pos, slots, src
        self._seq_lens = torch.ones(most, dtype=torch.int32, device=device)  # [B]
        self._cu_k = torch.arange(most + 1, dtype=torch.int32, device=device)  # [B + 1]
        self._cu_q = torch.arange(most + 1, dtype=torch.int32, device=device)  # [B + 1], fixed
        self._tables = torch.zeros(most, self.max_pages, dtype=torch.int32, device=device)
        # size -> (graph, its logits); None where the device has no graphs.
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}

    def capture(self) -> bool:
        """Capture every size (largest first, one memory pool); False, and no graph
        kept, when the device refuses. Off CUDA nothing is captured: a replay runs
        the step eagerly on the same buffers (how tests check them without a GPU)."""
        if self.pool.device.type != "cuda":
            self._graphs = dict.fromkeys(self.sizes)
            return True
        pool = torch.cuda.graph_pool_handle()
        try:
            for size in reversed(self.sizes):
                self._graphs[size] = self._capture(size, pool)
        except Exception as err:  # noqa: BLE001 - any refusal means "stay eager"
            self._graphs.clear()
            log.warning("decode CUDA graphs unavailable (%s); decoding eagerly", err)
            return False
        log.info("decode CUDA graphs captured for batch sizes %s", self.sizes)
        return True

    def can_run(self, chunks: Sequence[Chunk]) -> bool:
        """A decode-only step of at most the largest captured size."""
        return (
            bool(self._graphs)
            and 0 < len(chunks) <= self.sizes[-1]
            and all(len(ids) == 1 and start < self.max_model_len for ids, start, _ in chunks)
        )

    @torch.inference_mode()
    def run(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Replay the step of `chunks` (`can_run`) → logits [n, vocab] of its rows."""
        n = len(chunks)
        size = next(s for s in self.sizes if s >= n)
        ps = self.pool.shape.page_size
        rows = list(chunks) + [chunks[-1]] * (size - n)
        lens = [start + 1 for _, start, _ in rows]
        width = max(pages_for(length, ps) for length in lens)
        ids = [c[0][0] for c in rows]
        positions = [start for _, start, _ in rows]
        slots = [table[start // ps] * ps + start % ps for _, start, table in rows]
        src = list(range(n)) + [n - 1] * (size - n)
        ints = torch.tensor([ids, positions, slots, src], dtype=torch.int64)
        cu_k = [0, *lens]
        for i in range(1, len(cu_k)):
            cu_k[i] += cu_k[i - 1]
        table_rows = [
            list(chain(table[:used], [0] * (width - used)))
            for (_, _, table), used in zip(rows, (pages_for(x, ps) for x in lens), strict=True)
        ]
        self._i64[:, :size].copy_(ints, non_blocking=True)
        self._seq_lens[:size].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self._cu_k[: size + 1].copy_(torch.tensor(cu_k, dtype=torch.int32), non_blocking=True)
        self._tables[:size, :width].copy_(
            torch.tensor(table_rows, dtype=torch.int32), non_blocking=True
        )
        captured = self._graphs[size]
        if captured is None:
            return self._forward(self._batch(size))[:n]
        graph, logits = captured
        graph.replay()
        return logits[:n]

    def _batch(self, size: int) -> ForwardBatch:
        """The static buffers' first `size` rows, as the model reads a batch."""
        ids, positions, slots, src = self._i64[:, :size]
        rows = torch.arange(size, device=self.pool.device)
        return ForwardBatch(
            token_ids=ids,
            positions=positions,
            slots=slots,
            last_rows=rows,
            sample_rows=rows,
            decode=None,
            prefill=(),
            varlen=VarlenLayout(
                cu_seq_q=self._cu_q[: size + 1],
                cu_seq_k=self._cu_k[: size + 1],
                seq_lens=self._seq_lens[:size],
                block_table=self._tables[:size],
                max_q=1,
                max_k=self.max_model_len,
            ),
            page_size=self.pool.shape.page_size,
            write_rows=src,
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        model = self.model
        hidden = model.forward(batch, self.pool, model.embed(batch.token_ids))  # [b, hidden]
        return model.logits(hidden)  # [b, vocab]

    @torch.inference_mode()
    def _capture(self, size: int, pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The buffers hold a valid one-token step at every size (page 0, slot 0):
        # capture runs before any request, so the KV it writes is no one's.
        self._i64[3, :size] = torch.arange(size, device=self.pool.device)
        batch = self._batch(size)
        side = torch.cuda.Stream(self.pool.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy kernels and workspaces before capture
                self._forward(batch)
        torch.cuda.current_stream(self.pool.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._forward(batch)
        return graph, logits
