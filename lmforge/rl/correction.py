"""Rollout/trainer mismatch correction: an importance weight between the policy that sampled a
rollout (the inference engine's log-probs) and the policy the trainer computes (its own forward).

The two should be one distribution, and in fp32 they are (the engine drives the model's one
forward: |Δ log p| < 1e-5, ``tests/rl/test_rollout.py``); they drift apart when the trainer's
forward runs in another precision (bf16 autocast against the engine's fp32), with other kernels
or batch shapes, or when a sample's policy is some optimizer steps old. PPO's ratio is then taken
against the wrong policy. Decoupled PPO (Hilton et al. 2021, arXiv:2110.00641) keeps three:
π_rollout (the engine's, which drew the tokens), π_old (the trainer's recompute of the policy
before the update: the proximal policy of PPO's ratio) and π_θ, and corrects the gap between
the first two with a detached weight on each token's clipped surrogate:

    L_t = w_t · max(−A_t·r_t, −A_t·clip(r_t, 1 − ε_low, 1 + ε_high)),   r_t = π_θ / π_old,
    ρ_t = π_old(y_t) / π_rollout(y_t)

``rl.rollout_correction`` chooses w (C = ``rl.rollout_correction_cap`` > 1; verl's
``rollout_corr_helper.py``, TRL's ``vllm_importance_sampling_mode``; Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training", and Liu et al. 2025, "When
speed kills stability"):

- ``none``: w = 1 (no weight is computed; the loss is bit-identical to the code without it);
- ``token_truncate`` (TIS): w_t = min(ρ_t, C);
- ``token_mask`` (MIS): w_t = ρ_t · 1[1/C ≤ ρ_t ≤ C], a token whose ratio leaves the band is
  dropped (it still counts in the loss's token normaliser, as TRL's);
- ``sequence_truncate``: w_it = min(ρ̄_i, C) at every token of sequence i, with ρ̄_i the
  geometric mean of its token ratios, ρ̄_i = exp((1/|y_i|) Σ_t log ρ_it) (length-normalised,
  as GSPO's ratio: a product of |y| ratios would put e^{|y|·δ} into the cap);
- ``sequence_mask``: w_it = ρ̄_i · 1[1/C ≤ ρ̄_i ≤ C], the whole sequence dropped outside the band
  (verl's geometric rejection ``seq_mean_k1`` with the bounds 1/C and C, the weight kept).

TRL's and verl's sequence-level weights are the product ratio exp(Σ_t log ρ_it) instead of the
geometric mean; their token-level weights are these (TRL's with ``clip_min`` 1/C for the mask).
The KL term and the entropy bonus are not weighted (TRL's and verl's order).

``rl.old_logprobs`` says where π_old comes from: the trainer's recompute (a separate no-grad
forward over the batch before its first update), or the engine's log-probs themselves (verl's
bypass mode: π_old = π_rollout, so ρ = 1, w = 1 and PPO's clipped ratio π_θ/π_rollout is the only
correction; the separate forward is skipped). On the first step of a rollout batch the policy's
own forward is π_old, so there ``approx_kl`` and ``ratio_mean``/``ratio_max`` of the policy loss
measure the engine/trainer gap in that mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lmforge.core.config import ConfigError, at_least, in_range, option
from lmforge.rl.advantages import masked_mean

Correction = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
OldLogprobs = Literal["auto", "trainer", "engine"]
OLD_LOGPROBS = ("auto", "trainer", "engine")
Partial = Literal["continue", "discard"]
LOG_RATIO_BOUND = 20.0  # exp(±20): the ratio's safety bound before exponentiating (verl's SAFETY_BOUND)


@dataclass
class RLConfig:
    """The ``rl:`` section of grpo and ppo: how the engine's sampling log-probs and the trainer's meet."""

    rollout_correction: Correction = option(
        "none", help="the importance weight π_old/π_rollout on each token's loss: none | token_truncate (TIS) | "
        "token_mask (MIS) | sequence_truncate | sequence_mask (sequence: the geometric mean of its token ratios)"
    )
    rollout_correction_cap: float = in_range(
        2.0, 1, low_open=True, help="C > 1: truncate at C, or mask outside [1/C, C] (verl's rollout_is_threshold 2.0)"
    )
    old_logprobs: OldLogprobs = option(
        "auto", help="π_old of PPO's ratio: trainer (a no-grad forward over the batch before its first update) | "
        "engine (the sampling log-probs: no such forward, verl's bypass mode) | auto (trainer when the forward is "
        "not fp32 or a rollout_correction is set, else engine: in fp32 they agree to 1e-5)"
    )
    rollout_workers: int = at_least(
        0, 0, help="processes sampling and scoring groups while the trainer trains (lmforge.rl.workers; 0: in-process, "
        "synchronous)"
    )
    max_off_policy_steps: int = at_least(
        0, 0, help="how many optimizer steps old a sample's policy may be (older: dropped, counted, sampled again); "
        "0: synchronous, k: the workers sample k steps ahead (prime-rl's max_off_policy_steps)"
    )
    partial_rollouts: Partial = option(
        "continue", help="a generation that new weights interrupt: continue (its later tokens from the new weights, "
        "each token tagged with its version) | discard (sampled again under the new weights)"
    )
    worker_threads: int = at_least(0, 0, help="torch threads per rollout worker (0: the trainer's split evenly over "
                                   "the trainer and the workers)")

    def __post_init__(self) -> None:
        if self.rollout_correction not in CORRECTIONS:
            raise ConfigError(f"rl.rollout_correction must be one of {', '.join(CORRECTIONS)}, "
                              f"got {self.rollout_correction!r}")
        if not self.rollout_correction_cap > 1:  # NaN too
            raise ConfigError(f"rl.rollout_correction_cap must be > 1 (the weights are truncated at C or masked "
                              f"outside [1/C, C]), got {self.rollout_correction_cap}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ConfigError(f"rl.old_logprobs must be one of {', '.join(OLD_LOGPROBS)}, got {self.old_logprobs!r}")
        if self.max_off_policy_steps < 0:
            raise ConfigError(f"rl.max_off_policy_steps must be >= 0 (0: synchronous), got {self.max_off_policy_steps}")
        if self.max_off_policy_steps > 0 and self.rollout_workers == 0:
            raise ConfigError(f"rl.max_off_policy_steps {self.max_off_policy_steps} needs rollout workers to sample "
                              f"ahead: set rl.rollout_workers (e.g. 1), or max_off_policy_steps 0")
        if self.partial_rollouts not in ("continue", "discard"):
            raise ConfigError(f"rl.partial_rollouts must be continue or discard, got {self.partial_rollouts!r}")

    @property
    def corrects(self) -> bool:
        return self.rollout_correction != "none"

    def recomputes(self, precision: str) -> bool:
        """Whether the trainer recomputes π_old in a forward of its own (else π_old is the engine's)."""
        if self.old_logprobs == "auto":
            return precision != "fp32" or self.corrects
        return self.old_logprobs == "trainer"


def rollout_correction_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                               mode: Correction, cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The detached weights w (B, T) of the module docstring, from the trainer's ``old_logp`` (log π_old)
    and the engine's ``rollout_logp`` (log π_rollout) of the sampled tokens, ``mask`` the loss tokens
    (each row one whole sequence); and their figures, means over the masked tokens:

    - ``rollout_ratio_mean``, ``rollout_ratio_max``: the ratio the mode corrects, before truncation
      or masking (ρ_t for the token modes, ρ̄_i at each of the sequence's tokens for the sequence modes);
    - ``rollout_corrected_share``: the share of tokens whose weight was truncated or masked;
    - ``rollout_kl``: k3 = ρ_t − 1 − log ρ_t, Schulman's unbiased, non-negative estimate of
      KL(π_rollout ‖ π_old) from tokens drawn from π_rollout (verl's ``rollout_corr/k3_kl``);
    - ``rollout_weight_mean``: the weights applied.

    ``mode`` none gives weights of 1 and the same figures.
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"rollout correction must be one of {list(CORRECTIONS)}, got {mode!r}")
    if not cap > 1:
        raise ValueError(f"the rollout correction's cap must be > 1, got {cap}")
    m = mask.to(torch.float32)
    log_rho = ((old_logp.float() - rollout_logp.float()) * m).detach()  # 0 off the loss tokens
    if mode.startswith("sequence"):
        per_sequence = log_rho.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = per_sequence.expand_as(log_rho)
    else:
        log_ratio = log_rho
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if mode.endswith("truncate"):
        weights = ratio.clamp(max=cap)
        corrected = ratio > cap
    elif mode.endswith("mask"):
        corrected = (ratio < 1.0 / cap) | (ratio > cap)
        weights = ratio.masked_fill(corrected, 0.0)
    else:
        weights, corrected = torch.ones_like(ratio), torch.zeros_like(ratio, dtype=torch.bool)
    on = mask.bool()
    figures = {
        "rollout_ratio_mean": masked_mean(ratio, m),
        "rollout_ratio_max": ratio[on].max() if bool(on.any()) else ratio.new_zeros(()),
        "rollout_corrected_share": masked_mean(corrected.float(), m),
        "rollout_kl": masked_mean(torch.expm1(log_rho) - log_rho, m),
        "rollout_weight_mean": masked_mean(weights, m),
    }
    return weights * m, figures
