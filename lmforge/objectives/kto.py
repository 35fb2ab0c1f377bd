"""KTO (Ethayarajh et al. 2024) as a training objective, on unpaired desirable/undesirable examples.

A batch holds ``input_ids``/``labels``/``attention_mask`` rows, a boolean ``desirable``
per row and ``kl_*`` rows: each prompt followed by another example's completion
(``lmforge.data.preference.unpaired_rows``). The loss is ``kto_loss``: the policy's log-ratio
r against a baseline z0, the mean log-ratio on the mismatched ``kl_*`` rows, clamped at 0
and detached. As in TRL, the policy scores the KL rows without gradient, and z0 is taken
over the micro-batch: under torchrun pooled over every data-parallel rank's micro-batch (its
sum and count all-reduced), so it is what one process computes over the global micro-batch.
TRL averages the processes' means instead, which is the same when every rank scores as many
rows, as in training. Reference log-probs come precomputed in the batch (``ref_logps``,
``ref_kl_logps``) or from a ``Reference``. A row without target tokens (validation filler)
weighs zero, in the loss, z0 and the metrics.

Logged per example: ``kl`` (z0), ``accuracy`` (r above z0 for a desirable example, below
for an undesirable one), ``signed_reward`` (β·r, negated for undesirable examples, so it
rises as the policy separates them) and ``reward_desirable``/``reward_undesirable`` (β·r
summed over each kind, per example of the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmforge.core.config import positive
from lmforge.objectives.base import LossOutput, Objective
from lmforge.objectives.preference import has_targets, kto_loss, masked_sum
from lmforge.objectives.reference import Reference, completion_logprobs, trim_padding


@dataclass
class KTOLossConfig:
    beta: float = positive(0.1, help="β; TRL's default")
    desirable_weight: float = positive(1.0, help="λ_D; keep λ_D·n_D / (λ_U·n_U) in [1, 4/3] (TRL, KTO paper)")
    undesirable_weight: float = positive(1.0, help="λ_U")

    def __post_init__(self) -> None:
        if self.beta <= 0 or self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ValueError("beta, desirable_weight and undesirable_weight must be positive")


def weight_balance_warning(n_desirable: int, n_undesirable: int, desirable_weight: float,
                           undesirable_weight: float) -> str | None:
    """Why the data and λ_D, λ_U are out of balance, or None when λ_D·n_D / (λ_U·n_U) is in [1, 4/3].

    The KTO paper (Eq. 8) and TRL's KTOTrainer recommend that range; TRL warns outside it,
    and also only warns (does not refuse) when one kind of example is missing.
    """
    if n_desirable == 0 or n_undesirable == 0:
        kind, other = ("desirable", "undesirable") if n_undesirable == 0 else ("undesirable", "desirable")
        return (f"all {n_desirable + n_undesirable} KTO training examples are {kind} and none {other}: the loss "
                f"only moves their log-ratio against the KL baseline and nothing contrasts it; add {other} "
                f"examples (label: {str(other == 'desirable').lower()})")
    ratio = desirable_weight * n_desirable / (undesirable_weight * n_undesirable)
    if 1.0 <= ratio <= 4 / 3:
        return None
    d_lo, d_hi = (undesirable_weight * n_undesirable / n_desirable * f for f in (1.0, 4 / 3))
    u_lo, u_hi = (desirable_weight * n_desirable / n_undesirable / f for f in (4 / 3, 1.0))
    return (f"KTO weights out of balance: desirable_weight·n_desirable / (undesirable_weight·n_undesirable) = "
            f"{desirable_weight:g}·{n_desirable} / ({undesirable_weight:g}·{n_undesirable}) = {ratio:.2f}, outside "
            f"the recommended [1, 4/3]; set EITHER desirable_weight in [{d_lo:.2f}, {d_hi:.2f}] OR "
            f"undesirable_weight in [{u_lo:.2f}, {u_hi:.2f}] (not both)")


class KTOObjective(Objective):
    """``all_reduce`` sums a tensor over the data-parallel ranks in place and returns it
    (``ParallelContext.all_reduce_dp``); every rank must then run the same forwards, as the loop's do."""

    def __init__(self, cfg: KTOLossConfig, reference: Reference | None = None,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.cfg = cfg
        self.reference = reference
        self.all_reduce = all_reduce

    def num_targets(self, batch: dict[str, torch.Tensor]) -> int:
        """Examples with a target token (every example of the data; not a filler row)."""
        return int(has_targets(batch["labels"]).sum())

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum() + batch["kl_attention_mask"].sum())

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        cfg = self.cfg
        ids, labels, mask = trim_padding(batch["input_ids"], batch["labels"], batch["attention_mask"],
                                         static=self.static_shapes)
        kl_ids, kl_labels, kl_mask = trim_padding(batch["kl_input_ids"], batch["kl_labels"], batch["kl_attention_mask"],
                                                  static=self.static_shapes)
        logps, n_tokens, _ = completion_logprobs(model, ids, labels, mask)
        with torch.no_grad():
            kl_logps, n_kl_tokens, _ = completion_logprobs(model, kl_ids, kl_labels, kl_mask)
        if "ref_logps" in batch:
            ref_logps, ref_kl_logps = batch["ref_logps"], batch["ref_kl_logps"]
        elif self.reference is not None:
            ref_logps = self.reference(ids, labels, mask)
            ref_kl_logps = self.reference(kl_ids, kl_labels, kl_mask)
        else:
            raise ValueError("KTO needs a reference: pass one, or precompute ref_logps and ref_kl_logps")
        scored, kl_scored = n_tokens > 0, n_kl_tokens > 0
        # z0's mean log-ratio over the KL rows of this micro-batch, or of every rank's
        kl_sums = torch.stack([masked_sum((kl_logps - ref_kl_logps).detach().float(), kl_scored), kl_scored.sum()])
        if self.all_reduce is not None:
            kl_sums = self.all_reduce(kl_sums)
        desirable = batch["desirable"].bool()
        losses, rewards, z0 = kto_loss(logps, ref_logps, desirable, None, None, cfg.beta, cfg.desirable_weight,
                                       cfg.undesirable_weight, z0=kl_sums[0] / kl_sums[1].clamp(min=1))
        sign = desirable.float() * 2 - 1
        metrics = {
            "kl": z0 * scored.sum(),
            "accuracy": masked_sum(((rewards - cfg.beta * z0) * sign > 0).float(), scored),
            "signed_reward": masked_sum(rewards * sign, scored),
            "reward_desirable": masked_sum(rewards, scored & desirable),
            "reward_undesirable": masked_sum(rewards, scored & ~desirable),
        }
        return LossOutput(masked_sum(losses, scored), int(scored.sum()), metrics={k: v.detach() for k, v in metrics.items()})
