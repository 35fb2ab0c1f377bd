"""A value head: the transformer plus a per-token scalar, the critic of PPO.

Where a reward model (``model.reward``) reads one score at the last real token, a value model
reads one at every position: ``V_t = w·h_t + b`` (TRL's ``AutoModelForCausalLMWithValueHead``,
torchtune's PPO value model). The head starts at zero, so the first values are 0 (a neutral
baseline) unless it is taken from a reward model's head (``from_reward_head``), as
InstructGPT initialised its value function from the reward model.
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.model.reward import RewardModel
from lmforge.model.transformer import Transformer


def value_head(d_model: int, like: torch.Tensor) -> nn.Linear:
    """A zero-initialised ``d_model -> 1`` head on ``like``'s device and dtype."""
    head = nn.Linear(d_model, 1, device=like.device, dtype=like.dtype)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class ValueModel(nn.Module):
    """A critic of its own: a transformer (the policy's or the reward model's weights) and a value head."""

    def __init__(self, backbone: Transformer):
        super().__init__()
        self.backbone = backbone
        self.value = value_head(backbone.cfg.d_model, backbone.embed.weight)
        if backbone.lm_head is not None and backbone.lm_head.weight is not backbone.embed.weight:
            backbone.lm_head.requires_grad_(False)  # never read: no gradient, no optimizer state

    @classmethod
    def from_reward_model(cls, reward: RewardModel) -> ValueModel:
        model = cls(reward.backbone)
        model.value.load_state_dict(reward.score.state_dict())
        return model

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """Values (B, T) in float32, one per position (``kwargs``: ``Transformer.forward``'s)."""
        return self.value(self.backbone.hidden_states(input_ids, **kwargs)).squeeze(-1).float()
