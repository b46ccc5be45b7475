"""Checks that run inside vLLM's own interpreter (its torch, FastAPI, NIXL), one process.

    python in_vllm.py   → prints one JSON object of findings on its last line

- `imports`: our connector's module loads there, and which of our modules
  and which third-party packages it pulled in (the test forbids the
  operator, our engine's model code, the worker HTTP app);
- `pages`: vLLM's CPU attention writes K and V into a KV cache with its own
  kernel; pages moved with our transfer engine's gather and scatter (whole
  pages, as the connector moves that backend's pages) give vLLM's attention
  kernel the same output from the copy as from the original, and the same
  move cut to the tokens' rows does not (a page's interior is the kernel's).
"""

from __future__ import annotations

import json
import sys


def imports() -> dict[str, object]:
    before = set(sys.modules)
    import torch

    import pdcluster.runtime.vllm_connector.connector as connector

    loaded = sorted(m for m in set(sys.modules) - before if m.startswith("pdcluster"))
    return {
        "class": connector.PDClusterConnector.__name__,
        "modules": loaded,
        "torch": torch.__version__,
        "torch_file": torch.__file__,
    }


def pages() -> dict[str, object]:
    import torch
    from vllm import _custom_ops as ops

    from pdcluster.runtime.engine.kv_pool import KVPool
    from pdcluster.runtime.transfer.staging import frame_view, gather_into, scatter_bytes
    from pdcluster.runtime.vllm_connector.kv_layout import LayerView, describe_vllm_kv

    blocks, heads, tokens, dim, n = 6, 2, 32, 64, 45  # a prompt of 45: one page and a half
    isa = "vec"

    def cache() -> torch.Tensor:
        return torch.zeros(1, blocks, heads, tokens, 2 * dim)  # one layer, vLLM's LBHNC view

    def planes(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key_cache, value_cache = kv[0].view(blocks, heads, 2 * tokens, dim).chunk(2, dim=2)
        return key_cache, value_cache

    gen = torch.Generator().manual_seed(0)
    key = torch.randn(n, heads, dim, generator=gen)
    value = torch.randn(n, heads, dim, generator=gen)
    query = torch.randn(1, 4, dim, generator=gen)
    src_pages, dst_pages = [4, 1], [2, 5]

    src = cache()
    slots = torch.tensor([src_pages[t // tokens] * tokens + t % tokens for t in range(n)])
    ops.cpu_attn_reshape_and_cache(key, value, *planes(src), slots, isa)

    def attention(kv: torch.Tensor, table: list[int]) -> torch.Tensor:
        out = torch.zeros(1, 4, dim)
        key_cache, value_cache = planes(kv)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1,
            num_heads=4,
            num_kv_heads=heads,
            head_dim=dim,
            seq_lens=torch.tensor([n], dtype=torch.int32),
            dtype=torch.float32,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=False,
        )
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            scale=dim**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=torch.tensor([table], dtype=torch.int32),
            softcap=0.0,
            scheduler_metadata=metadata,
            s_aux=None,
        )
        return out

    def moved(end: int) -> torch.Tensor:
        """The prompt's tokens [0, end) moved into `dst_pages` by our gather and scatter."""
        views = []
        for kv in (src, cache()):
            layer = kv[0]
            view = LayerView(tuple(layer.shape), tuple(layer.stride()), layer.data_ptr())
            desc = describe_vllm_kv([view], backend="CPU_ATTN", dtype="float32", head_size=dim)
            views.append((KVPool.over(kv.view(desc.shape.dims()), desc.shape), kv))
        (a, _), (b, dst) = views
        src_slots = torch.tensor([src_pages[t // tokens] * tokens + t % tokens for t in range(end)])
        dst_slots = [dst_pages[t // tokens] * tokens + t % tokens for t in range(end)]
        frame = torch.empty(1 * 2 * end * heads * dim)
        out = frame_view(frame.view(torch.uint8), torch.float32, (1, 2, end, heads, dim))
        gather_into(a, [0], src_slots, slice(None), out)
        data = out.view(torch.uint8).numpy().reshape(1, 2, end, heads, -1)
        scatter_bytes(b, [0], torch.tensor(dst_slots).numpy(), (0, heads), data)
        return dst

    want = attention(src, src_pages)
    whole = attention(moved(2 * tokens), dst_pages)  # both pages to their end
    rows = attention(moved(n), dst_pages)  # only the prompt's token rows
    return {
        "whole_pages_equal": bool(torch.equal(whole, want)),
        "token_rows_equal": bool(torch.equal(rows, want)),
        "whole_pages_max_diff": float((whole - want).abs().max()),
    }


if __name__ == "__main__":
    print(json.dumps({"imports": imports(), "pages": pages()}))
