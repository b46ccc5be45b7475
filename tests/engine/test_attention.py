"""Attention over the paged pool: what a long context costs its neighbours, and
what a row's neighbours change about it."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pdcluster.runtime.engine.attention import PagedAttention
from pdcluster.runtime.engine.forward_batch import build_forward_batch
from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape

PAGE = 16
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32


def _pool(num_pages: int) -> KVPool:
    pool = KVPool(KVPoolShape(1, num_pages, PAGE, KV_HEADS, HEAD_DIM, "float32"))
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(0)))
    return pool


def _decode_batch(lengths: Sequence[int], first_page: int = 0) -> list:
    """One new token per sequence after `length - 1` cached ones, on consecutive pages."""
    chunks, page = [], first_page
    for n in lengths:
        pages = -(-n // PAGE)
        chunks.append(([1], n - 1, list(range(page, page + pages))))
        page += pages
    return chunks


def _peak_bytes(fn: Callable[[], object]) -> int:
    """Peak resident memory above the current level while `fn` runs (Linux)."""

    def status(field: str) -> int:
        found = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
        assert found is not None
        return int(found.group(1)) * 1024

    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def measure_decode_peaks() -> dict[str, int]:
    """Peak temporary memory of decoding one 8k and fifteen 64-token sequences
    together, the 8k one alone and the fifteen alone (run in a process whose
    allocator returns every block of 64 KiB or more at once: resident memory then
    follows what is live)."""
    torch.set_num_threads(1)
    long, short = [8192], [64] * 15
    pool = _pool(-(-8192 // PAGE) + 15 * 4 + 1)
    attend = PagedAttention()
    q = torch.randn(16, HEADS, HEAD_DIM)

    def run(lengths: list[int], first_page: int = 0) -> None:
        batch = build_forward_batch(_decode_batch(lengths, first_page), PAGE)
        attend(q[: len(lengths)], pool, 0, batch)

    cases = {"mixed": (long + short, 0), "long": (long, 0), "short": (short, 8192 // PAGE)}
    for lengths, first in cases.values():
        run(lengths, first)  # warm the kernels
    return {
        name: min(_peak_bytes(functools.partial(run, lengths, first)) for _ in range(3))
        for name, (lengths, first) in cases.items()
    }


def test_a_long_context_costs_its_own_memory_not_the_batch_times_it() -> None:
    """One 8k and fifteen 64-token sequences decode together in about the memory of
    each alone, summed: the short ones are never padded to the long one."""
    code = (
        "import json; from tests.engine.test_attention import measure_decode_peaks; "
        "print(json.dumps(measure_decode_peaks()))"
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    kv_bytes_per_token = 2 * KV_HEADS * HEAD_DIM * 4
    padded = 16 * 8192 * kv_bytes_per_token  # the K/V copy alone of a batch padded to 8k
    assert 0 < peaks["mixed"] < padded / 4, (peaks, padded)
    assert peaks["long"] > 0 and peaks["short"] > 0, peaks
    assert peaks["mixed"] <= peaks["long"] + peaks["short"] + (1 << 20), peaks


def test_a_decode_row_gets_the_same_bits_alone_or_in_any_batch() -> None:
    pool = _pool(200)
    attend = PagedAttention()
    lengths = [300, 5, 64, 65, 1, 700]
    chunks = _decode_batch(lengths)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM)
    together = attend(q, pool, 0, build_forward_batch(chunks, PAGE))
    order = [3, 0, 5, 1, 4, 2]
    shuffled = attend(q[order], pool, 0, build_forward_batch([chunks[i] for i in order], PAGE))
    for i, chunk in enumerate(chunks):
        alone = attend(q[i : i + 1], pool, 0, build_forward_batch([chunk], PAGE))
        assert torch.equal(alone[0], together[i])
        assert torch.equal(alone[0], shuffled[order.index(i)])


def test_decode_tiles_equal_plain_softmax_attention() -> None:
    pool = _pool(80)
    lengths = [1, 15, 16, 17, 129, 600]
    chunks = _decode_batch(lengths)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM, dtype=torch.float32)
    got = PagedAttention()(q, pool, 0, build_forward_batch(chunks, PAGE))
    flat_k = pool.buffer[0, 0].reshape(-1, KV_HEADS, HEAD_DIM)
    flat_v = pool.buffer[0, 1].reshape(-1, KV_HEADS, HEAD_DIM)
    for i, (_, start, pages) in enumerate(chunks):
        slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(start + 1)])
        k = flat_k[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [ctx, nq, D]
        v = flat_v[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].double(), k.double()) / HEAD_DIM**0.5
        want = torch.einsum("hk,khd->hd", scores.softmax(-1), v.double())
        assert (got[i].double() - want).abs().max() < 1e-5
