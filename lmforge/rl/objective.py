"""The policy-gradient objective: ``rl.losses.policy_loss`` on micro-batches of rollouts, as an
``Objective`` of the one training loop.

A micro-batch is what ``rl.trainer.RolloutBatches`` serves: prompt + response rows
(``input_ids``, ``attention_mask``), per-token ``loss_mask``, ``old_logprobs`` (the sampling
policy's), ``advantages`` and, with a KL term, ``ref_logprobs``, all aligned with ``input_ids``
(position t holds the log-prob of token t given the tokens before it). The loss is recomputed
from the policy's forward at positions 1..T-1 (``token_logprobs``).

The loop divides each micro-batch's summed loss by the targets of the whole step, so
``policy_loss``'s aggregation is done in two halves: here the sum (``n_tokens=1`` /
``n_sequences=1``), there the division. With ``token-mean`` the targets are the loss tokens of
the whole optimizer step (DAPO's global token mean, the default); with the ``seq-mean-*`` modes
they are its sequences. Either way the result equals ``policy_loss`` on the whole batch at once
(``tests/rl/test_objective.py``).

Metrics come back as sums over the step's targets (the loop logs their means): the token
metrics of ``policy_loss`` (clip fractions, approx KL, ratio mean, KL to the reference, entropy)
are token sums scaled by ``targets_per_token`` (the step's targets per loss token, from the batch
source), so they are exact token means over the step in every mode; the rollout batch's own
figures (``stat_*`` columns: reward mean/std, each reward term, response lengths, the share of
zero-variance groups) are constants of the batch and logged as they are. ``ratio_max``,
``rollout_ratio_max`` and ``response_length_max`` are maxima (``LossOutput.maxima``).

With a rollout correction (``rl.correction``, ``correction``: the recipe's ``rl:``), the batch
carries the engine's ``rollout_logprobs`` beside ``old_logprobs`` and each token's clipped term is
weighted by ``rollout_correction_weights``; its figures (``rollout_ratio_mean``/``_max``,
``rollout_corrected_share``, ``rollout_kl``, ``rollout_weight_mean``) are token means as above.

With a value term (PPO, ``value_coef`` > 0 or ``value_clip``), the model is an
``rl.critic.ActorCritic``: one ``logits_and_values`` call gives the log-probs and the values,
and the loss is ``L^CLIP + vf_coef · L^V`` (``rl.losses.value_loss`` on the batch's ``returns``
and ``old_values``, aggregated as the policy loss), logged as ``value_loss`` and
``value_clip_frac``.
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.model.reward import model_inputs
from lmforge.objectives.base import LossOutput, Objective
from lmforge.rl.correction import RLConfig, rollout_correction_weights
from lmforge.rl.losses import PolicyLossConfig, entropy_from_logits, policy_loss, value_loss

STAT_PREFIX = "stat_"  # batch columns holding the rollout batch's figures (one value, repeated per row)
STAT_MAXIMA = ("response_length_max",)  # of those, the ones logged as a maximum
TOKEN_METRICS = ("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "approx_kl", "ratio_mean",
                 "kl_ref", "entropy", "rollout_ratio_mean", "rollout_corrected_share", "rollout_kl",
                 "rollout_weight_mean")


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(input_ids[:, t] | input_ids[:, :t]) for t = 1..T-1 in float32 (B, T-1), the logits
    they come from (B, T-1, V)). With ``at`` (B, T) boolean, the log-probs of the marked tokens
    only (0 at the others), from the logits (N, V) of the N positions that predict them
    (``head_positions``): the response of a prompt + response row is a few of its positions, and
    the head and the log-softmax over the vocabulary then run on those alone."""
    kwargs = model_inputs(input_ids, attention_mask)
    if at is None:
        logits = model(input_ids, **kwargs)[:, :-1]
        return logprobs_of(logits, input_ids), logits
    logits = model(input_ids, head_at=head_positions(at), **kwargs)
    return selected_logprobs(logits, input_ids, at), logits


def logprobs_of(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The log-probs (B, T-1) of tokens 1..T-1 under ``logits`` of positions 0..T-2."""
    return chosen_logprobs(logits, input_ids[:, 1:])


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] in float32, for logits (..., V) and tokens (...)."""
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)


def head_positions(at: torch.Tensor) -> torch.Tensor:
    """The positions whose logits predict the tokens ``at`` (B, T) marks: each one to the left."""
    head_at = torch.zeros_like(at, dtype=torch.bool)
    head_at[:, :-1] = at[:, 1:]
    return head_at


def selected_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """(B, T-1) log-probs of the tokens ``at`` marks (0 elsewhere) from the logits (N, V) at
    ``head_positions(at)``."""
    marked = at[:, 1:].bool()
    return spread(chosen_logprobs(logits, input_ids[:, 1:][marked]), marked)


def spread(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The N ``values`` at the N true positions of ``mask`` (row-major), 0 elsewhere (float32)."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=values.device).masked_scatter(mask, values.float())


class PolicyObjective(Objective):
    """GRPO / Dr. GRPO / RLOO / REINFORCE++ / DAPO's clipped policy loss (they differ in the
    advantages the batch source computes and in ``cfg``); with ``vf_coef`` not None, PPO's
    actor-critic loss (module docstring)."""

    def __init__(self, cfg: PolicyLossConfig, vf_coef: float | None = None, value_clip: float | None = 0.2,
                 correction: RLConfig | None = None):
        self.cfg, self.vf_coef, self.value_clip = cfg, vf_coef, value_clip
        self.correction = correction if correction is not None and correction.corrects else None
        self.per_token = cfg.aggregation == "token-mean"

    def num_targets(self, batch: dict[str, torch.Tensor]) -> int:
        """Loss tokens (token-mean) or sequences with a loss token (the seq-mean modes)."""
        mask = batch["loss_mask"]
        return int(mask.sum()) if self.per_token else int(mask.any(-1).sum())

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum())

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        cfg = self.cfg
        ids = batch["input_ids"]
        at = batch["loss_mask"].bool()  # the logits of the response tokens only (token_logprobs)
        if self.vf_coef is None:
            logp, logits = token_logprobs(model, ids, batch["attention_mask"], at=at)
        else:
            logits, values = model.logits_and_values(ids, batch["attention_mask"], head_at=head_positions(at))
            logp, values = selected_logprobs(logits, ids, at), values[:, :-1]
        mask = batch["loss_mask"][:, 1:]
        with torch.set_grad_enabled(cfg.entropy_coef > 0 and torch.is_grad_enabled()):
            entropy = spread(entropy_from_logits(logits), at[:, 1:])
        ref = batch["ref_logprobs"][:, 1:] if "ref_logprobs" in batch else None
        weights, figures = None, {}
        if self.correction is not None:
            weights, figures = rollout_correction_weights(batch["old_logprobs"][:, 1:], batch["rollout_logprobs"][:, 1:],
                                                          mask, self.correction.rollout_correction,
                                                          self.correction.rollout_correction_cap)
        loss, metrics = policy_loss(logp, batch["old_logprobs"][:, 1:], batch["advantages"][:, 1:], mask, cfg,
                                    ref_logp=ref, entropy=entropy, weights=weights, n_tokens=1, n_sequences=1)
        metrics |= figures
        n_tokens = mask.sum()
        n_targets = self.num_targets(batch)
        scale = batch["targets_per_token"][0] if "targets_per_token" in batch else 1.0
        sums = {k: metrics[k].detach() * n_tokens * scale for k in TOKEN_METRICS if k in metrics}
        if self.vf_coef is not None:
            v_loss, v_metrics = value_loss(values, batch["old_values"][:, 1:], batch["returns"][:, 1:], mask,
                                           self.value_clip, cfg.aggregation, n_tokens=1, n_sequences=1,
                                           max_length=cfg.max_length)
            loss = loss + self.vf_coef * v_loss
            sums["value_loss"] = v_loss.detach()  # a sum over the targets, as the loss
            sums["value_clip_frac"] = v_metrics["value_clip_frac"].detach() * n_tokens * scale
        maxima = {key: metrics[key].detach() for key in ("ratio_max", "rollout_ratio_max") if key in metrics}
        for key, column in batch.items():
            if key.startswith(STAT_PREFIX):
                name = key[len(STAT_PREFIX):]
                if name in STAT_MAXIMA:
                    maxima[name] = column[0].float()
                else:
                    sums[name] = column[0].float() * n_targets
        return LossOutput(loss, n_targets, metrics=sums, maxima=maxima)
