"""The encoder and prefix objectives: masked LM (BERT), span corruption (T5, laid out as UL2
does for a decoder-only model) and the prefix LM, on the rows ``data.noising`` makes.

A batch is a dict of ``input_ids`` and ``labels`` (B, T), the label at a position being the token
predicted there (-100: none), and ``prefix_len`` (B,): the positions before it attend to each
other both ways, the later ones causally (``prefix_lm_mask``); masked LM's prefix is the whole
row, so its attention is bidirectional. The mask goes through the model's ``attn_mask``: the
model's forward is the causal LM's, with another mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.data.packing import IGNORE_INDEX
from lmforge.objectives.base import LossOutput, Objective


def prefix_lm_mask(prefix_len: torch.Tensor, T: int) -> torch.Tensor:
    """(B, 1, T, T) boolean, True = query i may attend to key j: j <= i, or j in the prefix
    (j < prefix_len). Within the prefix that is every pair; ``prefix_len = T`` is a
    bidirectional row, ``prefix_len = 1`` a causal one."""
    positions = torch.arange(T, device=prefix_len.device)
    causal = positions[None, :] <= positions[:, None]
    return (causal[None] | (positions[None, None, :] < prefix_len[:, None, None]))[:, None]


def summed_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-Σ log softmax(logits)[label] over the positions whose label is not -100, in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """BERT's masked-LM loss, summed over the selected positions M:

        L = -Σ_{i ∈ M} log p(x_i | x̃)        (Devlin et al. 2019, §3.1 "Masked LM")

    x̃ is the input with the selected tokens masked, randomised or kept (80/10/10), read with
    bidirectional attention; ``labels`` holds x_i at i ∈ M and -100 elsewhere, unshifted.
    """
    return summed_nll(logits, labels)


def span_corruption_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """T5's span-corruption loss, summed over the targets y (each dropped span after its sentinel):

        L = -Σ_t log p(y_t | x̃, y_<t)        (Raffel et al. 2020, §3.1.4; decoder-only as in Tay et al. 2022, UL2)

    x̃ is the input with each span replaced by its sentinel, a bidirectional prefix of the same
    row; ``labels`` holds y_t at the position before it (shifted) and -100 elsewhere.
    """
    return summed_nll(logits, labels)


def prefix_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The prefix LM's loss, summed over the tokens after the prefix x_{<P}:

        L = -Σ_{t ≥ P} log p(x_t | x_{<P}, x_{P..t-1})        (Raffel et al. 2020, §3.2.1; Dong et al. 2019)

    the prefix read bidirectionally, the rest causally; ``labels`` holds x_t at position t - 1
    (shifted) and -100 over the prefix.
    """
    return summed_nll(logits, labels)


DENOISING_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mlm": masked_lm_loss,
    "span": span_corruption_loss,
    "prefix_lm": prefix_lm_loss,
}


def correct_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many labelled positions the model's argmax gets right (masked-token accuracy, summed)."""
    scored = labels != IGNORE_INDEX
    return ((logits.argmax(dim=-1) == labels) & scored).sum().float()


class DenoisingObjective(Objective):
    """One of ``DENOISING_LOSSES`` on ``data.noising`` rows, logging ``accuracy`` (the share of
    targets the argmax predicts: masked-token accuracy for ``mlm``). With ``token_bytes`` an
    evaluation also counts the targets' bytes, for bits per byte."""

    def __init__(self, objective: str, token_bytes: torch.Tensor | None = None):
        if objective not in DENOISING_LOSSES:
            raise ValueError(f"unknown denoising objective {objective!r}; one of {', '.join(DENOISING_LOSSES)}")
        self.objective, self.loss = objective, DENOISING_LOSSES[objective]
        self.token_bytes = token_bytes

    def num_targets(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].numel()

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        tokens, labels = batch["input_ids"], batch["labels"]
        logits = model(tokens, attn_mask=prefix_lm_mask(batch["prefix_len"], tokens.shape[1]))
        metrics = {} if isinstance(logits, DTensor) else {"accuracy": correct_sum(logits.detach(), labels)}
        n_bytes = None
        if self.token_bytes is not None and not torch.is_grad_enabled():
            scored = labels != IGNORE_INDEX
            n_bytes = int(self.token_bytes.to(labels.device)[labels[scored]].sum())
        # the count is data-dependent (a host sync): a compiled training forward leaves it to the loop,
        # which counts a step's targets with num_targets, rather than break its graph here
        n_targets = 0 if torch.compiler.is_compiling() else self.num_targets(batch)
        return LossOutput(self.loss(logits, labels), n_targets, n_bytes, metrics=metrics)
