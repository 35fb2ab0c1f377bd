"""PPO-RLHF's advantages (Ziegler et al. 2019, arXiv:1909.08593; InstructGPT, Ouyang et al. 2022):
per-token rewards with the KL penalty in the reward, the critic's values, GAE and returns.

For each rollout batch (``rl.trainer.RolloutBatches`` with this as its ``estimate``), with the
sampling policy's log-probs π_old, the reference's π_ref and the critic's values V:

    r_t = −β·KL_t(π_old‖π_ref) + 1[t = last]·score      (``kl.kl_shaped_rewards``, k1 by default)
    A_t, R_t = GAE(γ, λ) over r and V                      (``advantages.gae``)
    A_t ← whiten(A_t)                                      (``advantages.whiten``, over the batch)

then β is updated by ``kl.KLController`` (fixed, or towards ``kl_target``) from the batch's KL
per completion; its state is this estimator's, so a resumed run continues with the adapted β.
The objective (``rl.objective.PolicyObjective`` with a value term) trains on ``advantages``
and regresses the values on ``returns`` around ``old_values``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmforge.core.config import ConfigError, at_least, in_range, option, positive
from lmforge.rl.advantages import AllSum, gae, local_sum, masked_mean, masked_var, whiten
from lmforge.rl.critic import CriticConfig
from lmforge.rl.kl import KLController, KLEstimator, kl_shaped_rewards
from lmforge.rl.rollout import RolloutConfig
from lmforge.rl.trainer import RolloutBatchConfig


@dataclass
class PPOConfig(RolloutBatchConfig):
    """The ``ppo:`` section: rollout batches (``updates_per_batch``: PPO epochs, ``minibatches``),
    the KL in the reward, GAE and the critic."""

    prompts_per_step: int = positive(16, help="prompts (groups of rollout.n responses) per rollout batch")
    updates_per_batch: int = positive(2, help="μ: passes over each rollout batch (TRL's num_iterations, PPO's epochs)")
    kl_coef: float = at_least(0, 0.05, help="β, the KL penalty in the reward")
    kl_target: float | None = positive(None, help="adaptive β towards this KL per completion (None: fixed)")
    kl_horizon: float = positive(10000.0, help="the adaptive controller's horizon, in completions")
    kl_estimator: KLEstimator = option("k1", help="KL_t in the reward (k1: InstructGPT's, TRL's, verl's)")
    gamma: float = in_range(1.0, 0.0, 1.0, help="γ, the discount over response tokens")
    lam: float = in_range(0.95, 0.0, 1.0, help="λ of GAE")
    whiten_advantages: bool = option(True, help="normalise the advantages to mean 0 and variance 1 over the batch")
    critic: CriticConfig = field(default_factory=CriticConfig)

    def check(self, rollout: RolloutConfig) -> None:
        if self.zero_variance != "keep":
            raise ConfigError("ppo.zero_variance must be keep: the critic's baseline, not the group's, "
                              "makes PPO's advantages")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ConfigError(f"ppo.kl_estimator must be k1, k2 or k3, got {self.kl_estimator!r}")
        super().check(rollout)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor | None = None,
                       all_sum: AllSum = local_sum) -> float:
    """1 − Var(R − V) / Var(R) over the masked tokens (of every rank, with ``all_sum``): 1 a perfect
    critic, 0 no better than a constant."""
    mask = torch.ones_like(returns, dtype=torch.bool) if mask is None else mask
    var_r = masked_var(returns, mask, unbiased=False, all_sum=all_sum)
    var_d = masked_var(returns - values, mask, unbiased=False, all_sum=all_sum)
    return float(1 - var_d / var_r) if float(var_r) > 0 else 0.0


class PPOAdvantages:
    """The rollout batch's ``estimate`` for PPO (module docstring). Under data parallelism the
    whitening, the KL and the explained variance are over every rank's tokens (sums and counts
    through ``all_sum``), so the advantages are those of the whole batch in one process."""

    def __init__(self, cfg: PPOConfig):
        self.cfg = cfg
        self.kl = KLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor],
                 all_sum: AllSum = local_sum) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        mask, values = batch["loss_mask"], batch["values"]
        has = mask.any(-1)  # a response with no loss token (mask_truncated) has no time step
        rewards, kl = torch.zeros_like(values), torch.zeros_like(values)
        if bool(has.any()):
            rewards[has], kl[has] = kl_shaped_rewards(batch["rewards"][has], batch["old_logprobs"][has],
                                                      batch["ref_logprobs"][has], mask[has], self.kl.coef,
                                                      self.cfg.kl_estimator)
        advantages, returns = gae(rewards, values, mask, self.cfg.gamma, self.cfg.lam)
        on = mask.bool()
        tokens, kl_sum, completions = all_sum(torch.stack((on.sum(), kl.sum(-1)[has].sum(), has.sum())).double())
        if self.cfg.whiten_advantages and tokens > 1:
            advantages = whiten(advantages, on, all_sum=all_sum)
        kl_per_completion = float(kl_sum / completions) if completions else 0.0
        figures = {"kl": kl_per_completion, "kl_coef": self.kl.coef,
                   "value_mean": float(masked_mean(values, on, all_sum=all_sum)),
                   "returns_mean": float(masked_mean(returns, on, all_sum=all_sum)),
                   "explained_variance": explained_variance(values, returns, on, all_sum) if tokens else 0.0}
        self.kl.update(kl_per_completion, int(completions))
        return {"advantages": advantages, "returns": returns, "old_values": values}, figures

    def state_dict(self) -> dict:
        return {"kl": self.kl.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "kl" in state:
            self.kl.load_state_dict(state["kl"])
