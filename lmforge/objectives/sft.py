"""Supervised fine-tuning: next-token cross-entropy on the trained tokens only."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.data.packing import block_causal_mask, document_ids, is_packed
from lmforge.model.mtp import MTPTargets, mtp_modules
from lmforge.objectives.base import LossOutput, Objective
from lmforge.objectives.clm import IGNORE_INDEX, causal_lm_loss


class SFTObjective(Objective):
    """Causal LM loss over the tokens whose label is not -100 (prompt masking, packing).

        L = -sum_{t : y_{t+1} != -100} log p(y_{t+1} | x_{<=t})     (Ouyang et al. 2022; TRL SFTTrainer)

    The batch is a dict of (B, T) ``input_ids``, ``labels`` aligned with them (shifted here),
    ``position_ids`` and an optional (B, 1, T, T) boolean ``attn_mask``. A packed batch
    without a mask gets the block-causal mask from ``position_ids``, so documents never
    see each other. The sum is returned; the loop divides by the targets of the whole step.
    """

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].numel()

    def num_targets(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """(input ids, the model's keyword arguments, the targets of positions 0..T-2)."""
        positions = batch.get("position_ids")
        attn_mask = batch.get("attn_mask")
        if attn_mask is None and positions is not None and is_packed(positions):
            attn_mask = block_causal_mask(positions)
        return batch["input_ids"], {"positions": positions, "attn_mask": attn_mask}, batch["labels"][:, 1:]

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        ids, kwargs, targets = self.inputs(batch)
        if mtp_modules(model) is not None and torch.is_grad_enabled():  # multi-token prediction's depths (model.mtp)
            positions = kwargs["positions"]
            documents = document_ids(positions) if positions is not None else torch.zeros_like(batch["labels"])
            kwargs["mtp"] = MTPTargets(ids, batch["labels"], documents)
        logits = model(ids, **kwargs)
        loss = causal_lm_loss(logits[:, :-1], targets)
        return LossOutput(loss, self.num_targets(batch))
