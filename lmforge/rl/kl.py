"""The KL divergence to the reference policy: per-token estimators, the KL-shaped reward, and the
coefficient's controller.

The policy is kept near the reference π_ref (the SFT model) either in the reward (InstructGPT,
PPO-RLHF: each token pays −β·KL_t) or in the loss (GRPO: β·KL_t added to each token's loss).
Both need a per-token estimate of KL(π‖π_ref) from tokens sampled from π, from Schulman's
"Approximating KL divergence" (2020, http://joschu.net/blog/kl-approx.html), with
``log ρ = log π_ref(y_t) − log π(y_t)``:

    k1 = −log ρ               unbiased, high variance, can be negative
    k2 = ½ (log ρ)²           biased (low for small KL), low variance; its gradient is the KL's
    k3 = (ρ − 1) − log ρ      unbiased and ≥ 0, low variance (GRPO's; verl's "low_var_kl")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lmforge.core.config import at_least, positive

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) at tokens sampled from π: k1, k2 or k3 (module docstring).
    Differentiable in ``logp``; ``ref_logp`` is the frozen reference's."""
    log_rho = ref_logp - logp
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho**2
    if estimator == "k3":
        return torch.expm1(log_rho) - log_rho
    raise ValueError(f"KL estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """KL(π(·|s_t) ‖ π_ref(·|s_t)) at each position, summed over the vocabulary from both models'
    logits (``... x V`` -> ``...``, float32): no estimator is needed where both distributions are
    known, so this is exact whatever produced the tokens (greedy answers are not samples of π,
    on which k1-k3 would be biased)."""
    logp, ref = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref_logits.float(), -1)
    return (logp.exp() * (logp - ref)).sum(-1)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last response position (where the reward model's score is credited)."""
    m = mask.to(torch.bool)
    has = m.any(-1)
    if not bool(has.all()):
        raise ValueError(f"completion {int((~has).nonzero()[0])} has no response token in mask; drop it first")
    positions = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    return torch.where(m, positions, -1).amax(-1)


@torch.no_grad()
def kl_shaped_rewards(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                      kl_coef: float, estimator: KLEstimator = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards with the KL penalty in the reward (Ziegler et al. 2019, arXiv:1909.08593;
    InstructGPT, Ouyang et al. 2022):

        r_t = −β·KL_t + 1[t = last response token]·score

    ``scores`` are one reward-model/verifier score per completion; ``logp`` the sampling policy's
    log-probs of its tokens (π_old), ``ref_logp`` the reference's. Returns ``(rewards, KL_t)``,
    both 0 off the mask. k1 is the estimator of the references (torchtune's ``get_rewards_ppo``,
    verl's default ``kl_penalty="kl"``); it is this per-token sum that GAE or REINFORCE++ discount.
    """
    m = mask.to(logp.dtype)
    kl = kl_estimate(logp, ref_logp, estimator) * m
    rewards = -kl_coef * kl
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards, kl


@dataclass
class KLController:
    """The KL coefficient β: fixed, or adapted towards a target KL with Ziegler et al. (2019)'s
    proportional controller (their §2.2, as in lm-human-preferences, TRL and verl):

        e = clip(KL / target − 1, −0.2, 0.2),   β ← β · (1 + e · n_steps / horizon)

    ``target=None`` keeps β fixed. ``kl`` is the measured KL per completion (the sum of its
    per-token estimates, averaged over the batch); ``n_steps`` the samples (or steps) since the
    last update. ``state_dict`` holds β, so a resumed run continues with the adapted value.
    """

    coef: float = at_least(0, 0.05)  # β; InstructGPT used 0.02, torchtune's PPO 0.01-0.05, verl 0.001
    target: float | None = positive(None)  # target KL (lm-human-preferences: 6 nats per completion)
    horizon: float = positive(10000.0)  # samples over which the error would double/halve β at most 20%

    def update(self, kl: float, n_steps: int) -> float:
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n_steps / self.horizon
        return self.coef

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])
