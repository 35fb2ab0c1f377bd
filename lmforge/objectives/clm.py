"""Causal language modelling: next-token cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.packing import IGNORE_INDEX
from lmforge.model.mtp import MTPTargets, documents_from_starts, mtp_modules
from lmforge.objectives.base import LossOutput, Objective


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed next-token negative log-likelihood, computed in float32.

        L = -sum_t log p(x_{t+1} | x_{<=t})        (Bengio et al. 2003; Radford et al. 2018)

    ``logits`` (B, T, V) and ``targets`` (B, T) are already shifted; targets equal to
    ``ignore_index`` contribute nothing. Returning the sum lets the training loop divide
    by the token count of the whole accumulated batch, so every token weighs the same.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index, reduction="sum")


class CausalLMObjective(Objective):
    """Pre-training objective: windows of ``seq_len + 1`` tokens -> inputs and shifted targets.

    With ``token_bytes`` (bytes of each vocabulary entry, 0 for special tokens) the output
    also counts the targets' bytes, so evaluation can report bits per byte. A model with
    multi-token prediction (``model.mtp``) gets the whole window as its depths' targets in
    training, documents split at ``document_start`` (the BOS id every document begins with).
    """

    def __init__(self, token_bytes: torch.Tensor | None = None, document_start: int | None = None):
        self.token_bytes, self.document_start = token_bytes, document_start

    def num_targets(self, batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)

    def inputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """(input ids, the model's keyword arguments, targets aligned with the input positions)."""
        return batch[:, :-1], {}, batch[:, 1:]

    def __call__(self, model: nn.Module, batch: torch.Tensor) -> LossOutput:
        inputs, kwargs, targets = self.inputs(batch)
        if mtp_modules(model) is not None and torch.is_grad_enabled():  # multi-token prediction's depths (model.mtp)
            kwargs["mtp"] = MTPTargets(batch, batch, documents_from_starts(batch, self.document_start))
        logits = model(inputs, **kwargs)
        n_bytes = None
        if self.token_bytes is not None and not torch.is_grad_enabled():
            n_bytes = int(self.token_bytes.to(targets.device)[targets].sum())
        return LossOutput(causal_lm_loss(logits, targets), self.num_targets(batch), n_bytes)
