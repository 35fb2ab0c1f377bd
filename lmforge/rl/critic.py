"""PPO's actor and critic as the one module the training loop trains.

The critic is a value head (``model.value``) either on a transformer of its own,
initialised from the policy's checkpoint or the reward model's (``critic.init``; TRL's and
InstructGPT's choice: the reward model's weights and head), or on the policy's own trunk
(``critic.kind: shared``: one forward gives the logits and the values, at the cost of the
value loss's gradient reaching the policy's weights). ``ActorCritic.forward`` is the policy's,
so sampling, the reference and the log-probs read it as a language model; the loop's
checkpoint holds both, so a resumed run resumes the critic too. Only the policy is written to
``final/``; the critic goes beside it as ``critic.safetensors``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from torch import nn

from lmforge.checkpoints.files import load_model_config
from lmforge.checkpoints.load import load_model, load_reward_model, resolve_checkpoint
from lmforge.core.config import ConfigError, at_least, option
from lmforge.core.io import InputError
from lmforge.model.families import build as build_model
from lmforge.model.reward import HEAD_FILE, model_inputs
from lmforge.model.transformer import Transformer
from lmforge.model.value import ValueModel, value_head
from lmforge.rl.rewards import RewardConfig

CRITIC_FILE = "critic.safetensors"


@dataclass
class CriticConfig:
    """The ``critic:`` section: where the value function lives and how its loss weighs."""

    kind: Literal["separate", "shared"] = option("separate", help="shared: a value head on the policy's trunk")
    init: str = option(
        "policy",
        help="separate: its transformer's weights: \"policy\" (the policy's checkpoint), "
        '"reward_model" (the reward.components\' reward model, its head included) or a checkpoint path',
    )
    vf_coef: float = at_least(0, 0.1, help="c_1 in L = L^CLIP + c_1 L^V (TRL's PPO: 0.1)")
    value_clip: float | None = at_least(0, 0.2, help="PPO2's value clipping range (None: unclipped)")

    def init_path(self, policy: str, reward: RewardConfig) -> Path | None:
        """The checkpoint a separate critic starts from (None: shared), checked before any model is loaded."""
        if self.kind == "shared":
            return None
        if self.kind != "separate":
            raise ConfigError(f"ppo.critic.kind must be separate or shared, got {self.kind!r}")
        if self.init == "policy":
            return resolve_checkpoint(policy, verify=False)
        if self.init == "reward_model":
            paths = [c.path for c in reward.components if c.kind == "reward_model"]
            if len(paths) != 1:
                raise ConfigError(f"ppo.critic.init=reward_model needs exactly one reward.components entry of kind "
                                  f"reward_model, the recipe has {len(paths)}; name a checkpoint path instead")
            return resolve_checkpoint(paths[0], verify=False)
        try:
            return resolve_checkpoint(self.init, verify=False)
        except (InputError, FileNotFoundError) as exc:
            raise ConfigError(f"ppo.critic.init {self.init!r}: not policy, reward_model or a checkpoint: {exc}") from exc


def load_critic(path: Path, device: torch.device | str) -> ValueModel:
    """A separate critic from ``path``: a reward model's head becomes the value head, else it starts at zero."""
    if (path / HEAD_FILE).is_file():
        return ValueModel.from_reward_model(load_reward_model(path, device=device))
    return ValueModel(load_model(path, device=device)[0])


class ActorCritic(nn.Module):
    """The policy (``backbone``) and its critic: ``critic`` (a ``ValueModel``) or, shared, ``value`` on its trunk."""

    def __init__(self, policy: nn.Module, critic: ValueModel | None = None):
        super().__init__()
        self.backbone, self.critic = policy, critic
        self.value = value_head(policy.cfg.d_model, policy.embed.weight) if critic is None else None

    @property
    def cfg(self):
        return self.backbone.cfg

    @property
    def layers(self) -> nn.ModuleList:
        return self.backbone.layers

    @property
    def embed(self) -> nn.Module:
        return self.backbone.embed

    def forward(self, input_ids: torch.Tensor, output: Literal["logits", "values", "both"] = "logits",
                head_at: torch.Tensor | None = None, **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The policy's logits (B, T, V), the values (B, T) float32, or both (``head_at`` and
        ``kwargs``: ``Transformer.forward``'s; ``head_at`` selects the logits' positions, never the
        values'). Every use goes through here, so a sharded model's forward hooks run."""
        if output == "logits":
            return self.backbone(input_ids, head_at=head_at, **kwargs)
        if self.critic is not None:
            values = self.critic(input_ids, **kwargs)
            return values if output == "values" else (self.backbone(input_ids, head_at=head_at, **kwargs), values)
        hidden = self.backbone.hidden_states(input_ids, **kwargs)
        values = self.value(hidden).squeeze(-1).float()
        if output == "values":
            return values
        return self.backbone.logits(hidden if head_at is None else hidden[head_at]), values

    def logits_and_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          head_at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (B, T, V), or (N, V) at ``head_at``; values (B, T) float32): a shared critic
        reads the policy's hidden states."""
        return self(input_ids, "both", head_at=head_at, **model_inputs(input_ids, attention_mask))

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Values (B, T) alone (the rollout batch's, without gradient)."""
        return self(input_ids, "values", **model_inputs(input_ids, attention_mask))

    def save_head(self, directory: str | Path) -> None:
        """The critic's weights beside the policy's checkpoint files."""
        part = self.critic if self.critic is not None else self.value
        save_file({k: v.detach().cpu().contiguous() for k, v in part.state_dict().items()},
                  str(Path(directory) / CRITIC_FILE), metadata={"format": "pt"})


def actor_critic(init: Path | None):
    """The ``head`` of the fine-tuning skeleton: wraps the (adapted) policy with its critic,
    shared (``init`` None) or loaded from ``init`` onto the policy's device."""
    def wrap(policy: Transformer) -> ActorCritic:
        if init is None:
            return ActorCritic(policy)
        if policy.embed.weight.is_meta:  # the architecture alone, for gathered weights (``gathered_for_saving``)
            return ActorCritic(policy, ValueModel(build_model(load_model_config(init))))
        model = load_critic(init, policy.embed.weight.device)
        if model.backbone.cfg.vocab_size != policy.cfg.vocab_size:
            raise InputError(f"ppo.critic.init {init}: vocabulary of {model.backbone.cfg.vocab_size} tokens, the "
                             f"policy's has {policy.cfg.vocab_size}: the critic must read the policy's tokens")
        return ActorCritic(policy, model.train())
    return wrap
