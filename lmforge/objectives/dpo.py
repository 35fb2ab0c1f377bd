"""Paired preference optimisation (DPO and its variants, SimPO, ORPO, CPO) as a training objective.

A batch holds ``chosen_*`` and ``rejected_*`` rows (``lmforge.data.preference.pair_rows``),
run through the policy as one ``[chosen; rejected]`` batch. Each method's loss is the pure
function in ``lmforge.objectives.preference``; this module only gathers its inputs: summed
or length-averaged completion log-probs, the reference's (precomputed in the batch as
``ref_chosen_logps``/``ref_rejected_logps``, or from a ``Reference``), and the NLL term of
ORPO and CPO. The loss is summed over pairs; the loop divides by the pairs of the whole step.
A pair whose chosen or rejected row has no target token (the filler rows that pad a
distributed validation set to whole global batches, ``validation_batches``) weighs zero:
it is left out of the loss, the metrics and the pair count.

Logged per pair, as TRL does: ``reward_chosen``/``reward_rejected`` (β·log-ratio for the
reference-based losses, β·log-prob for the reference-free ones), ``margin`` (their
difference), ``accuracy`` (margin > 0), ``logp_chosen``/``logp_rejected`` and, with a
reference, ``ties`` (margin 0 up to rounding: every pair while the policy is the reference, so
an accuracy near 0 then means ties, not wrong preferences) and ``kl_k1``: the mean log-ratio
logπ − logπ_ref of chosen and rejected (TRL's ``kl``; a k1 estimate on the preference data, not
on the policy's own samples, so it can be negative).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lmforge.core.config import at_least, in_range, option, positive
from lmforge.objectives.base import LossOutput, Objective
from lmforge.objectives.preference import (
    cpo_loss,
    dpo_loss,
    masked_sum,
    orpo_loss,
    pair_has_targets,
    sequence_logprobs,
    simpo_loss,
)
from lmforge.objectives.reference import Reference, completion_logprobs, trim_padding

# a tie's log-ratio margin, relative to the summed log-probs it is the difference of: float32 sums
# over a completion's tokens, computed in batches of other padding, round at ~1e-6 of their size
TIE_RELATIVE = 1e-5


def ties(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor) -> torch.Tensor:
    """The pairs whose log-ratio margin (logπ_c − logπ_ref_c) − (logπ_r − logπ_ref_r) is zero up to
    float32 rounding: every pair while the policy is the reference."""
    scale = chosen.abs() + rejected.abs() + ref_chosen.abs() + ref_rejected.abs()
    return ((chosen - ref_chosen) - (rejected - ref_rejected)).abs() <= TIE_RELATIVE * scale

PreferenceLoss = Literal["dpo", "ipo", "cdpo", "rdpo", "hinge", "simpo", "orpo", "cpo"]
REFERENCE_FREE = ("simpo", "orpo", "cpo")
DPO_TYPES = {"dpo": "sigmoid", "ipo": "ipo", "cdpo": "cdpo", "rdpo": "robust", "hinge": "hinge"}


@dataclass
class PreferenceLossConfig:
    loss: PreferenceLoss = option(
        "dpo", help="dpo | ipo | cdpo | rdpo | hinge (reference) ; simpo | orpo | cpo (reference-free)"
    )
    beta: float = positive(0.1, help="β (IPO's τ; ORPO's λ). TRL's default 0.1; SimPO's paper uses 2.0-2.5")
    label_smoothing: float = in_range(
        0.0, 0, 0.5, high_open=True, help="ε for cdpo and rdpo (0.1 is typical), and optional for simpo/cpo"
    )
    simpo_gamma: float = at_least(0, 0.5, help="SimPO's target margin γ (TRL's simpo_gamma)")
    cpo_alpha: float = at_least(0, 1.0, help="weight of CPO's NLL term on the chosen completion")
    sft_weight: float = at_least(
        0,
        0.0,
        help="+ w·NLL(chosen completion) for the reference-based losses: RPO (Pang et al. 2024), "
        "TRL's loss_type [..., \"sft\"] with loss_weights; keeps DPO from lowering the chosen answer's likelihood",
    )

    def __post_init__(self) -> None:
        if self.loss not in DPO_TYPES and self.loss not in REFERENCE_FREE:
            raise ValueError(f"loss must be one of {[*DPO_TYPES, *REFERENCE_FREE]}, got {self.loss!r}")
        if self.beta <= 0:
            raise ValueError(f"beta must be positive, got {self.beta}")
        if self.loss in ("cdpo", "rdpo") and not 0 < self.label_smoothing < 0.5:
            raise ValueError(f"loss {self.loss} needs label_smoothing in (0, 0.5), e.g. 0.1; got {self.label_smoothing}")
        if self.label_smoothing and self.loss not in ("cdpo", "rdpo", "simpo", "cpo"):
            raise ValueError(f"label_smoothing has no effect with loss {self.loss}; use cdpo or rdpo")
        if self.sft_weight < 0 or (self.sft_weight and not self.needs_reference):
            raise ValueError(f"sft_weight must be >= 0 and applies to dpo/ipo/cdpo/rdpo/hinge (orpo and cpo have "
                             f"their own NLL term), got {self.sft_weight} with loss {self.loss}")

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE


def _cat(batch: dict[str, torch.Tensor], key: str) -> torch.Tensor | None:
    if f"chosen_{key}" not in batch:
        return None
    return torch.cat([batch[f"chosen_{key}"], batch[f"rejected_{key}"]])


class PreferenceObjective(Objective):
    """The paired preference losses over ``[chosen; rejected]`` batches."""

    def __init__(self, cfg: PreferenceLossConfig, reference: Reference | None = None):
        self.cfg = cfg
        self.reference = reference

    def num_targets(self, batch: dict[str, torch.Tensor]) -> int:
        """Pairs with a target token on both sides (every pair of the data; not a filler pair)."""
        return int(pair_has_targets(batch).sum())

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Real (non-pad) tokens the policy processes, for tokens/s and MFU."""
        return int(batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum())

    def reference_logprobs(self, batch, input_ids, labels, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if self.reference is None:
            raise ValueError(f"loss {self.cfg.loss} needs a reference: pass one, or precompute ref_*_logps")
        return self.reference(input_ids, labels, attention_mask).chunk(2)

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        cfg = self.cfg
        input_ids, labels, attention_mask = trim_padding(_cat(batch, "input_ids"), _cat(batch, "labels"),
                                                         _cat(batch, "attention_mask"), static=self.static_shapes)
        logps, n_tokens, logits = completion_logprobs(model, input_ids, labels, attention_mask)
        chosen, rejected = logps.chunk(2)
        n_chosen, n_rejected = n_tokens.chunk(2)
        scored = (n_chosen > 0) & (n_rejected > 0)  # pair_has_targets, from the counts at hand
        avg_chosen, avg_rejected = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
        metrics: dict[str, torch.Tensor] = {}
        chosen_nll = -chosen.sum() / n_chosen.sum().clamp(min=1)  # token mean over the micro-batch, as TRL
        if cfg.needs_reference:
            ref_chosen, ref_rejected = self.reference_logprobs(batch, input_ids, labels, attention_mask)
            if cfg.loss == "ipo":  # TRL: the log-ratios are length-normalised for IPO
                losses = dpo_loss(avg_chosen, avg_rejected, ref_chosen / n_chosen.clamp(min=1),
                                  ref_rejected / n_rejected.clamp(min=1), cfg.beta, "ipo")[0]
            else:
                losses = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, cfg.beta, DPO_TYPES[cfg.loss],
                                  cfg.label_smoothing)[0]
            reward_c, reward_r = cfg.beta * (chosen - ref_chosen).detach(), cfg.beta * (rejected - ref_rejected).detach()
            metrics["ties"] = masked_sum(ties(chosen, rejected, ref_chosen, ref_rejected).float(), scored)
            metrics["kl_k1"] = masked_sum((chosen - ref_chosen) + (rejected - ref_rejected), scored).detach() / 2
            if cfg.sft_weight:  # TRL's "sft" loss on the chosen completions
                losses = losses + cfg.sft_weight * chosen_nll
                metrics["nll"] = chosen_nll.detach() * scored.sum()
        elif cfg.loss == "simpo":
            losses, reward_c, reward_r = simpo_loss(avg_chosen, avg_rejected, cfg.beta, cfg.simpo_gamma,
                                                    cfg.label_smoothing)
        elif cfg.loss == "cpo":  # NLL over the chosen completion
            losses, reward_c, reward_r = cpo_loss(chosen, rejected, chosen_nll, cfg.beta, cfg.cpo_alpha,
                                                  cfg.label_smoothing)
            metrics["nll"] = chosen_nll.detach() * scored.sum()
        else:  # ORPO: TRL's NLL covers the chosen prompt *and* completion (trl PR #1516)
            half = input_ids.shape[0] // 2
            mask = attention_mask[:half] if attention_mask is not None else torch.ones_like(input_ids[:half])
            mask = mask * scored[:, None]  # a filler pair's prompt is no one's
            nll_logps, nll_tokens = sequence_logprobs(logits[:half], input_ids[:half].masked_fill(mask == 0, -100))
            nll = -nll_logps.sum() / nll_tokens.sum().clamp(min=1)
            losses, reward_c, reward_r = orpo_loss(avg_chosen, avg_rejected, nll, cfg.beta)
            metrics["nll"] = nll.detach() * scored.sum()
        margin = reward_c - reward_r
        metrics.update(reward_chosen=masked_sum(reward_c, scored), reward_rejected=masked_sum(reward_r, scored),
                       margin=masked_sum(margin, scored), accuracy=masked_sum((margin > 0).float(), scored),
                       logp_chosen=masked_sum(chosen.detach(), scored), logp_rejected=masked_sum(rejected.detach(), scored))
        return LossOutput(masked_sum(losses, scored), int(scored.sum()), metrics={k: v.detach() for k, v in metrics.items()})
