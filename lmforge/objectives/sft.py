"""Supervised fine-tuning: next-token cross-entropy on the trained tokens only."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.data.packing import block_causal_mask, is_packed
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

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        positions = batch.get("position_ids")
        attn_mask = batch.get("attn_mask")
        if attn_mask is None and positions is not None and is_packed(positions):
            attn_mask = block_causal_mask(positions)
        logits = model(batch["input_ids"], positions=positions, attn_mask=attn_mask)
        loss = causal_lm_loss(logits[:, :-1], batch["labels"][:, 1:])
        return LossOutput(loss, self.num_targets(batch))
