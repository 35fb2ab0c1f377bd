"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.

Every filter takes its setting per row (a number, or a (B,) tensor), so rows of different
requests share one batch. Draws come from each request's own ``torch.Generator`` (rows of
one request draw together, in row order), so a seeded request samples the same tokens
whatever else is in the batch, up to the float rounding of the batch's matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
    mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always has 0 before it, so it stays
    sorted_logits = sorted_logits.masked_fill((mass_before >= p) & (p < 1.0), float("-inf"))
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


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row from ``probs`` (B, V); the rows sharing a generator (one request's, or
    None for torch's global one) draw together in row order."""
    tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    groups: dict[int, list[int]] = {}
    by_id: dict[int, torch.Generator | None] = {}
    for row, gen in enumerate(generators):
        groups.setdefault(id(gen), []).append(row)
        by_id[id(gen)] = gen
    for key, rows in groups.items():
        index = torch.tensor(rows, device=probs.device)
        tokens[index] = torch.multinomial(probs[index], 1, generator=by_id[key]).squeeze(-1)
    return tokens


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
    greedy = logits.argmax(dim=-1)
    hot = temperature.squeeze(-1) > 0
    if not bool(hot.any()):
        return greedy
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)
    scaled = min_p_filter(top_p_filter(top_k_filter(scaled, top_k), top_p), min_p)
    generators = generator if isinstance(generator, Sequence) else [generator] * logits.shape[0]
    if bool(hot.all()):
        return draw(scaled.softmax(dim=-1), generators)
    rows = hot.nonzero().squeeze(-1)
    greedy[rows] = draw(scaled[rows].softmax(dim=-1), [generators[i] for i in rows.tolist()])
    return greedy
