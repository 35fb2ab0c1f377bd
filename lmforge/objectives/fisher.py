"""The diagonal Fisher information of a causal LM on a dataset, for EWC (``objectives.ewc``).

    F_i = E_x E_{y ~ p_θ(·|x)} [ (∂ log p_θ(y|x) / ∂θ_i)² ]             (Kirkpatrick et al. 2017, §2.1)

**Unit: one target token.** Each sequence's contexts come from the data (teacher forcing) and
the Fisher is the mean over target tokens t of E_{y_t ~ p(·|x_≤t)} [(∂ log p(y_t|x_≤t)/∂θ)²], so
it is on the scale of the per-token losses the stages train on (λ = 1 weighs old and new
tokens alike). Per-token squared gradients would take one backward per token; instead each
sequence takes one backward of g = Σ_t ∂ log p(ŷ_t|x_≤t)/∂θ, and g² / T estimates the per-token
Fisher without bias: given the data's contexts the draws ŷ_t are independent and each score
has mean zero (E_y ∂ log p(y) = ∂ Σ_y p(y) = 0), so E[g_t g_u] = 0 for t ≠ u and E[g²] = Σ_t E[g_t²].

``labels`` chooses ŷ:

- ``sampled`` (default): ŷ_t drawn from the model's own p(·|x_≤t), the true Fisher.
- ``empirical``: ŷ_t the data's next token, the *empirical* Fisher (Martens 2020 explains why it
  is not the Fisher). The cross terms no longer vanish, so g²/T is the empirical Fisher with the
  sequence as the datum (Kirkpatrick's per-example squared gradient), per token of it.
- ``exact``: the expectation over y enumerated, Σ_y p(y|x_≤t) (∂ log p(y|x_≤t)/∂θ)² per token, one
  backward per token and vocabulary entry: the true Fisher without sampling noise, for tiny
  vocabularies (tests) only.

Avalanche's ``EWCPlugin`` squares mini-batch gradients of the data's loss, which is neither (a
batch's gradient squared keeps every cross term between examples); here each sequence is its
own backward. The computation runs in the model's dtype (float64 for the tests).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

from lmforge.data.packing import IGNORE_INDEX

Labels = Literal["sampled", "empirical", "exact"]


def token_log_probs(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(·|x_≤t) of each position of one sequence (T,) -> (T, V), at least in float32."""
    logits = model(input_ids[None])[0]
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)


def sample_labels(log_probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw ŷ_t ~ p(·|x_≤t) per row of ``log_probs`` (T, V)."""
    return torch.multinomial(log_probs.detach().exp(), 1, generator=generator)[:, 0]


def squared_grads(total: torch.Tensor, params: list[nn.Parameter], sums: list[torch.Tensor], weight: torch.Tensor | float,
                  retain: bool) -> None:
    """sums_i += weight · (∂ total / ∂θ_i)²."""
    grads = torch.autograd.grad(total, params, retain_graph=retain, allow_unused=True)
    for s, g in zip(sums, grads):
        if g is not None:
            s.add_(g.detach().square() * weight)


def sequence_fisher_sums(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor, labels: Labels,
                         params: list[nn.Parameter], sums: list[torch.Tensor],
                         generator: torch.Generator | None = None) -> int:
    """Add one sequence's squared score (module docstring) to ``sums``; return its target count.
    ``targets`` (T,) are the next tokens aligned with ``input_ids``, IGNORE_INDEX where untrained."""
    keep = targets != IGNORE_INDEX
    n = int(keep.sum())
    if n == 0:
        return 0
    log_probs = token_log_probs(model, input_ids)[keep]
    if labels == "exact":
        probs = log_probs.detach().exp()
        cells = [(t, y) for t in range(n) for y in range(log_probs.shape[1])]
        for i, (t, y) in enumerate(cells):
            squared_grads(log_probs[t, y], params, sums, probs[t, y], retain=i + 1 < len(cells))
        return n
    chosen = targets[keep] if labels == "empirical" else sample_labels(log_probs, generator)
    squared_grads(log_probs.gather(1, chosen[:, None]).sum(), params, sums, 1.0, retain=False)
    return n


def diagonal_fisher(model: nn.Module, sequences: Iterable[tuple[torch.Tensor, torch.Tensor]], labels: Labels = "sampled",
                    max_tokens: int | None = None, seed: int = 0) -> tuple[dict[str, torch.Tensor], int, int]:
    """The diagonal Fisher of ``model`` (every parameter, by name) per target token over
    ``sequences`` of (input_ids, targets), stopping after the sequence that reaches ``max_tokens``;
    returns it with the tokens and sequences it covers. ``seed`` seeds the sampled labels."""
    named = [(n, p) for n, p in model.named_parameters()]
    params = [p for _, p in named]
    sums = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in params]
    generator = torch.Generator(device=params[0].device).manual_seed(seed)
    tokens = count = 0
    was_training = model.training
    model.eval()  # no dropout: the Fisher of the model as it predicts
    try:
        for input_ids, targets in sequences:
            tokens += sequence_fisher_sums(model, input_ids, targets, labels, params, sums, generator)
            count += 1
            if max_tokens is not None and tokens >= max_tokens:
                break
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("no target tokens to compute the Fisher on")
    return {n: s / tokens for (n, _), s in zip(named, sums)}, tokens, count
