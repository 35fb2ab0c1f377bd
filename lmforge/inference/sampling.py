"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.

Every filter takes its setting per row (a number, or a (B,) tensor), so rows of different
requests share one batch. Draws come from each request's own ``torch.Generator`` (rows of
one request draw together, in row order), so a seeded request samples the same tokens
whatever else is in the batch, up to the float rounding of the batch's matmuls. A draw costs
one uniform number per row (inverse transform sampling, ``draw``), not one per vocabulary
entry as ``torch.multinomial``'s exponential race does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def per_row(value: float | int | torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A setting as a (B, 1) tensor on the logits' device."""
    return torch.as_tensor(value, device=logits.device).expand(logits.shape[0]).reshape(-1, 1)


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """CTRL's penalty (Keskar et al. 2019, as transformers' ``RepetitionPenaltyLogitsProcessor``):
    the logit of every token already in the row (``seen``, (B, V) bool) is divided by the
    penalty when positive and multiplied by it when negative; 1 = off."""
    penalty = per_row(penalty, logits).to(logits.dtype)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def top_k_filter(logits: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Top-k sampling (Fan et al. 2018): logits outside the k largest of each row become -inf; k = 0 is off."""
    V = logits.shape[-1]
    k = per_row(k, logits).long()
    k = torch.where((k <= 0) | (k >= V), V, k)
    if bool((k == V).all()):
        return logits
    kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, k - 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2020): keep the smallest set of tokens whose probability sums to >= p; 1 = off."""
    p = per_row(p, logits).to(logits.dtype)
    if bool((p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= p) & (p < 1.0)
    drop[..., 0] = False  # the most likely token always stays, also for a p that rounds to 0 in the logits' dtype
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def min_p_filter(logits: torch.Tensor, min_p: float | torch.Tensor) -> torch.Tensor:
    """Min-p sampling (Nguyen et al. 2024): keep tokens whose probability is at least ``min_p``
    times the most likely token's; 0 = off."""
    min_p = per_row(min_p, logits).to(logits.dtype)
    if bool((min_p <= 0).all()):
        return logits
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def uniforms(n: int, generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """(n,) float64 draws from U[0, 1), row ``i``'s from ``generators[i]``; the rows sharing a
    generator (one request's, or None for torch's global one) draw together in row order."""
    u = torch.empty(n, dtype=torch.float64, device=device)
    groups: dict[int, list[int]] = {}
    by_id: dict[int, torch.Generator | None] = {}
    for row, gen in enumerate(generators):
        groups.setdefault(id(gen), []).append(row)
        by_id[id(gen)] = gen
    for key, rows in groups.items():
        values = torch.rand(len(rows), generator=by_id[key], dtype=torch.float64, device=device)
        if rows == list(range(rows[0], rows[0] + len(rows))):
            u[rows[0] : rows[0] + len(rows)] = values
        else:
            u[torch.tensor(rows, device=device)] = values
    return u


BLOCK = 128  # vocabulary entries per block of ``draw``'s two-level search


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row from ``probs`` (B, V), non-negative and not necessarily normalised:
    inverse transform sampling at u ~ U[0, 1) from the row's generator (``uniforms``)."""
    return inverse_transform(probs, uniforms(probs.shape[0], generators, probs.device))


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's first token whose cumulative probability exceeds ``u`` (B,) times the row's total.

    The search has two levels, so that the sums that place a token are short and in float64
    without a float64 copy of the whole (B, V) table: the totals of blocks of ``BLOCK``
    entries (float32 sums of 128 terms, rounded to about 1e-7 of the block's mass) locate
    the block, and the float64 running sum of that block alone locates the token in it. A
    token of probability 0 is never chosen (the first entry *exceeding* u times the total, that
    product kept below the row's and then the block's sum, where float32 and float64 disagree)."""
    B, V = probs.shape
    blocks = (probs if V % BLOCK == 0 else nn.functional.pad(probs, (0, -V % BLOCK))).view(B, -1, BLOCK)
    totals = blocks.sum(-1).double()  # (B, blocks)
    ends = totals.cumsum(-1)
    starts = torch.cat((ends.new_zeros(B, 1), ends[:, :-1]), dim=1)
    total = ends[:, -1:]
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, total.new_zeros(())))  # below the total, however rounded
    block = torch.searchsorted(ends, x, right=True)  # (B, 1)
    inside = blocks.gather(1, block[:, :, None].expand(B, 1, BLOCK)).squeeze(1).double().cumsum(-1)
    x = torch.minimum(x - starts.gather(1, block), torch.nextafter(inside[:, -1:], inside.new_zeros(())))
    return (block * BLOCK + torch.searchsorted(inside, x, right=True)).squeeze(1)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V): the argmax where the temperature is 0, else a draw
    from softmax(logits / T) after top-k, top-p and min-p (transformers' order of warpers).
    ``generator`` is one for every row or one per row."""
    temperature = per_row(temperature, logits).float()
    hot = temperature.squeeze(-1) > 0
    if not bool(hot.any()):
        return logits.argmax(dim=-1)
    scaled = logits.float()
    if not bool((temperature == 1.0).all()):
        # shifted to a maximum of 0 first: under a tiny temperature the rest go to -inf, not inf - inf = NaN
        scaled = (scaled - scaled.amax(dim=-1, keepdim=True)) / torch.where(temperature > 0, temperature, 1.0)
    scaled = min_p_filter(top_p_filter(top_k_filter(scaled, top_k), top_p), min_p)
    generators = generator if isinstance(generator, Sequence) else [generator] * logits.shape[0]
    if bool(hot.all()):
        return draw(scaled.softmax(dim=-1), generators)
    greedy = logits.argmax(dim=-1)
    rows = hot.nonzero().squeeze(-1)
    greedy[rows] = draw(scaled[rows].softmax(dim=-1), [generators[i] for i in rows.tolist()])
    return greedy
