"""Bradley-Terry reward-model training as an objective, on ``[chosen; rejected]`` pair batches.

The model is a ``lmforge.model.reward.RewardModel``; the loss is ``bradley_terry_loss``
with the pair's optional ``margin`` (Llama 2) and the optional centring term (TRL's
``center_rewards_coefficient``). Logged per pair: ``reward_chosen``, ``reward_rejected``,
``margin`` (r_c − r_r) and ``accuracy`` (r_c > r_r: the pairwise accuracy). A pair without
completion tokens (validation filler under torchrun) weighs zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmforge.core.config import at_least, option
from lmforge.objectives.base import LossOutput, Objective
from lmforge.objectives.preference import bradley_terry_loss, masked_sum, pair_has_targets
from lmforge.objectives.reference import trim_padding


@dataclass
class RewardLossConfig:
    center_coef: float = at_least(0, 0.0, help="c·(r_c + r_r)² keeps rewards near 0; TRL recommends 0.01")
    use_margin: bool = option(True, help="subtract the data's per-pair `margin` field when present")


class RewardObjective(Objective):
    def __init__(self, cfg: RewardLossConfig):
        self.cfg = cfg

    def num_targets(self, batch: dict[str, torch.Tensor]) -> int:
        """Pairs with a completion on both sides (every pair of the data; not a validation filler pair)."""
        return int(pair_has_targets(batch).sum())

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum())

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        mask = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        ids, _, mask = trim_padding(ids, ids, mask, static=self.static_shapes)
        rewards = model(ids, mask)
        chosen, rejected = rewards.chunk(2)
        margin = batch.get("margin") if self.cfg.use_margin else None
        losses = bradley_terry_loss(chosen, rejected, margin, self.cfg.center_coef)
        diff = (chosen - rejected).detach()
        scored = pair_has_targets(batch)
        metrics = {"reward_chosen": masked_sum(chosen.detach(), scored),
                   "reward_rejected": masked_sum(rejected.detach(), scored),
                   "margin": masked_sum(diff, scored), "accuracy": masked_sum((diff > 0).float(), scored)}
        return LossOutput(masked_sum(losses, scored), int(scored.sum()), metrics=metrics)
