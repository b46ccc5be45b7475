"""The batched token sampler: every row of a step at once, on the logits' device.

Per step the sampler sees the logits of the rows that sample ([S, vocab])
and one `SampleSpec` per row. In this order, each part only for the rows
that need it:
1. penalties rewrite the logits (`SamplingParams` says how);
2. greedy rows take the argmax;
3. the other rows divide by their temperature, and those with top-k/top-p
   sort their row (descending, stable) and keep the smallest prefix the
   filters allow; then each row draws by inverse CDF: the first token whose
   cumulative probability exceeds `uniform_for(seed, index)` times the row's
   total (found block by block: `_inverse_cdf`);
4. rows asking for logprobs get them from the unmodified logits.
Everything comes back to the host in one copy.

Why inverse CDF with one uniform per row: the draw is a function of (seed,
position, logits) alone: the uniform comes from `sampling.uniform_for`,
every operation works row by row (no reduction crosses rows), and every
sum runs along the row in a fixed order. So a request samples the
same token whatever it is batched with, on a prefill or a decode instance,
before or after a preemption (`sampling.py`). It costs two passes over the
row (a softmax, block sums) and work on one block, where per-element random
noise would cost a hash per vocabulary entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdcluster.runtime.engine.sampling import SamplingParams, TokenLogprobs, uniform_for

__all__ = ["SampleSpec", "SampledTokens", "TokenLogprobs", "penalise", "sample"]

CDF_BLOCK = 256  # probabilities summed together in the first level of a draw


@dataclass(frozen=True)
class SampleSpec:
    """What one row needs to sample its token."""

    params: SamplingParams
    seed: int  # the request's seed (drawn by the engine when the request gave none)
    index: int  # output position of the token sampled now
    # Only for a request with penalties (empty otherwise): its tokens so far.
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SampledTokens:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # one per row; None where not asked for


def sample(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> SampledTokens:
    """logits: [S, vocab] on any device; one spec per row → one token per row."""
    num_rows, vocab = logits.shape
    if num_rows != len(specs):
        raise ValueError(f"{num_rows} logit rows for {len(specs)} requests")
    if num_rows == 0:
        return SampledTokens([], [])
    device = logits.device
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    raw = logits.detach()
    x = raw.to(work)  # [S, V]
    penalised = [i for i, s in enumerate(specs) if s.params.has_penalties]
    if penalised:
        if x.data_ptr() == raw.data_ptr():
            x = x.clone()  # never rewrite the caller's logits
        x[penalised] = penalise(x[penalised], [specs[i] for i in penalised])

    tokens = torch.empty(num_rows, dtype=torch.int64, device=device)  # [S]
    greedy = [i for i, s in enumerate(specs) if s.params.is_greedy]
    # max(dim).indices: the first index of the maximum, as argmax, in about
    # half argmax's time on a CPU (a 128k-entry row).
    if len(greedy) == num_rows:
        tokens = x.max(dim=-1).indices
    elif greedy:
        tokens[greedy] = x[greedy].max(dim=-1).indices
    drawn = [i for i, s in enumerate(specs) if not s.params.is_greedy]
    if drawn:
        tokens[drawn] = _draw(x if len(drawn) == num_rows else x[drawn], [specs[i] for i in drawn])

    wanted = [i for i, s in enumerate(specs) if s.params.logprobs is not None]
    if not wanted:
        return SampledTokens([int(t) for t in tokens.tolist()], [None] * num_rows)
    num_top = max(int(specs[i].params.logprobs or 0) for i in wanted)
    lp = torch.log_softmax(raw[wanted].to(work), dim=-1)  # [L, V]
    chosen = lp.gather(1, tokens[wanted].unsqueeze(1))  # [L, 1]
    top_lp, top_ids = lp.topk(min(num_top, vocab), dim=-1)  # each [L, k]
    # One copy to the host: tokens, then per wanted row (logprob, k ids, k logprobs).
    packed = torch.cat(
        [
            tokens.to(torch.float64),
            torch.cat([chosen.double(), top_ids.double(), top_lp.double()], dim=1).flatten(),
        ]
    ).tolist()
    out_tokens = [int(t) for t in packed[:num_rows]]
    logprobs: list[TokenLogprobs | None] = [None] * num_rows
    width = 1 + 2 * top_ids.shape[1]
    for n, row in enumerate(wanted):
        cell = packed[num_rows + n * width : num_rows + (n + 1) * width]
        k = int(specs[row].params.logprobs or 0)
        ids, values = cell[1 : 1 + top_ids.shape[1]], cell[1 + top_ids.shape[1] :]
        top = tuple((int(ids[j]), float(values[j])) for j in range(k))
        logprobs[row] = TokenLogprobs(float(cell[0]), top)
    return SampledTokens(out_tokens, logprobs)


def penalise(x: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """x: [P, V] logits of rows with penalties → the penalised logits."""
    num_rows, vocab = x.shape
    device = x.device
    out_rows = [r for r, s in enumerate(specs) for _ in s.output_ids]
    out_ids = [t for s in specs for t in s.output_ids]
    counts = torch.zeros(num_rows, vocab, dtype=x.dtype, device=device)  # [P, V]
    if out_ids:
        where = (
            torch.tensor(out_rows, dtype=torch.int64, device=device),
            torch.tensor(out_ids, dtype=torch.int64, device=device),
        )
        # Adding ones is exact in any order: the counts are the same on every device.
        counts.index_put_(where, torch.ones(len(out_ids), dtype=x.dtype, device=device), True)
    rep = [s.params.repetition_penalty for s in specs]
    if any(r != 1.0 for r in rep):
        seen = counts > 0  # [P, V]
        prompt_rows = [r for r, s in enumerate(specs) for _ in s.prompt_ids]
        prompt_ids = [t for s in specs for t in s.prompt_ids]
        if prompt_ids:
            seen[
                torch.tensor(prompt_rows, dtype=torch.int64, device=device),
                torch.tensor(prompt_ids, dtype=torch.int64, device=device),
            ] = True
        r = torch.tensor(rep, dtype=x.dtype, device=device).unsqueeze(1)  # [P, 1]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    freq = torch.tensor([s.params.frequency_penalty for s in specs], dtype=x.dtype, device=device)
    pres = torch.tensor([s.params.presence_penalty for s in specs], dtype=x.dtype, device=device)
    return x - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).to(x.dtype)


def _draw(x: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """x: [R, V] logits of rows that draw at random → [R] token ids."""
    device, dtype = x.device, x.dtype
    temps = torch.tensor([s.params.temperature for s in specs], dtype=dtype, device=device)
    uniforms = torch.tensor(
        [uniform_for(s.seed, s.index) for s in specs], dtype=torch.float64, device=device
    )  # [R]
    scaled = x if all(s.params.temperature == 1.0 for s in specs) else x / temps.unsqueeze(1)
    filtered = [i for i, s in enumerate(specs) if s.params.needs_filter]
    if not filtered:
        return _inverse_cdf(scaled, uniforms)
    plain = [i for i, s in enumerate(specs) if not s.params.needs_filter]
    tokens = torch.empty(len(specs), dtype=torch.int64, device=device)  # [R]
    if plain:
        tokens[plain] = _inverse_cdf(scaled[plain], uniforms[plain])
    rows = scaled[filtered] if plain else scaled
    ordered, order = torch.sort(rows, dim=-1, descending=True, stable=True)  # each [F, V]
    keep = _filter_mask(ordered, [specs[i].params for i in filtered])
    picks = _inverse_cdf(ordered.masked_fill(~keep, float("-inf")), uniforms[filtered])
    tokens[filtered] = order.gather(1, picks.unsqueeze(1)).squeeze(1)
    return tokens


def _filter_mask(ordered: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """ordered: [F, V] scaled logits, sorted descending → [F, V] bool, True where kept.

    Top-k keeps the first k; top-p keeps the smallest prefix whose probability
    mass (of the whole distribution) reaches top_p. The first always stays.
    """
    device, vocab = ordered.device, ordered.shape[1]
    rank = torch.arange(vocab, device=device).unsqueeze(0)  # [1, V]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    keep = rank < top_k.unsqueeze(1)  # [F, V]
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(ordered.to(torch.float64), dim=-1)  # [F, V]
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly better tokens
        limit = torch.tensor(top_p, dtype=torch.float64, device=device).unsqueeze(1)
        keep &= before < limit
    keep[:, 0] = True
    return keep


def _inverse_cdf(scaled: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """scaled: [R, V] logits (−inf: excluded); uniforms: [R] in [0, 1) → [R] column picked.

    In two levels, so no pass over the row is a sequential scan: the sums of
    blocks of `CDF_BLOCK` probabilities (one vectorised pass), their running
    sum in float64 to find the block the target falls in, then a running sum
    inside that block alone. Every reduction runs along the row in a fixed
    order, whatever the batch.
    """
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    rows, vocab = probs.shape
    num_blocks = -(-vocab // CDF_BLOCK)
    if num_blocks * CDF_BLOCK != vocab:  # zeros past the end: never picked
        probs = F.pad(probs, (0, num_blocks * CDF_BLOCK - vocab))
    blocks = probs.view(rows, num_blocks, CDF_BLOCK)
    cum = torch.cumsum(blocks.sum(dim=-1).double(), dim=-1)  # [R, nb]
    target = uniforms.unsqueeze(1) * cum[:, -1:]  # [R, 1] float64, below the total
    # The first block whose running sum exceeds the target (a block of zero
    # weight never does before the one ahead of it).
    block = torch.searchsorted(cum, target, right=True).clamp_(max=num_blocks - 1)  # [R, 1]
    before = torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0)), 0.0)  # [R, 1]
    inside = blocks.gather(1, block.unsqueeze(2).expand(rows, 1, CDF_BLOCK)).squeeze(1)
    picks = torch.searchsorted(torch.cumsum(inside.double(), dim=-1), target - before, right=True)
    # Rounding may carry the target past the block's own running total: then
    # its last token of any weight (the block has one, its sum is positive).
    offsets = torch.arange(CDF_BLOCK, device=probs.device)
    last = torch.where(inside > 0, offsets, 0).amax(dim=-1, keepdim=True)  # [R, 1]
    return (block * CDF_BLOCK + torch.minimum(picks, last)).squeeze(1)
