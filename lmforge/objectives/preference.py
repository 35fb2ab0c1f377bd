"""Preference losses (DPO family, SimPO, ORPO, CPO, KTO, Bradley-Terry) as pure functions.

Every loss takes per-sequence log-probabilities of shape (B,) from ``sequence_logprobs``
and returns the per-pair (or per-example) loss of shape (B,); the caller takes the mean.
Whether a method wants summed or length-averaged log-probs is stated in its docstring:
sum for DPO/hinge/cDPO/robust, CPO and KTO; average for IPO, SimPO and ORPO.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from lmforge.objectives.clm import IGNORE_INDEX

DPOLossType = Literal["sigmoid", "cdpo", "robust", "hinge", "ipo"]


def sequence_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX, average: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence log-probability of the labelled tokens, and how many tokens it covers.

        logp = sum_t log_softmax(logits[:, :-1])[labels[:, 1:]] * [labels[:, 1:] != ignore_index]

    ``logits`` (B, T, V) and ``labels`` (B, T) are aligned with the input ids (shifted here),
    so the mask applies to *targets*: mask prompt and padding with ``ignore_index`` in
    ``labels`` rather than by comparing ids with a pad id, which would also drop an EOS
    that shares the pad id. Half-precision logits are scored in float32. With ``average``
    the sum is divided by the token count (a row with no target gets 0, not NaN).
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must share (B, T)")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits, targets = logits[:, :-1], labels[:, 1:]
    mask = targets != ignore_index
    picked = logits.gather(-1, targets.masked_fill(~mask, 0).unsqueeze(-1)).squeeze(-1)
    token_logps = picked - torch.logsumexp(logits, dim=-1)
    logps = (token_logps * mask).sum(-1)
    n_tokens = mask.sum(-1)
    if average:
        logps = logps / n_tokens.clamp(min=1)
    return logps, n_tokens


def has_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """(B,) True for rows with at least one target token (``labels`` aligned with the inputs, as
    in ``sequence_logprobs``). The objectives weigh a row without one zero: the filler rows that
    pad a distributed validation set to whole global batches (``finetune.validation_batches``)."""
    return (labels[:, 1:] != ignore_index).any(-1)


def pair_has_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B,) True for the pairs of a ``[chosen; rejected]`` batch with a target token on both sides."""
    return has_targets(batch["chosen_labels"]) & has_targets(batch["rejected_labels"])


def masked_sum(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` (B,) where ``keep`` (a masked sum rather than ``@``, which autocast would run in 16 bits)."""
    return values.masked_fill(~keep, 0).sum()


def _smoothed_sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - ε) log σ(z) - ε log σ(-z): a Bradley-Terry loss whose labels flip with probability ε."""
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct preference optimisation and its variants, per pair.

    With Δ = (logπ(y_c) - logπ_ref(y_c)) - (logπ(y_r) - logπ_ref(y_r)) and ε = ``label_smoothing``:

        sigmoid  -log σ(βΔ)                                      DPO, Rafailov et al. 2023
        cdpo     -(1-ε) log σ(βΔ) - ε log σ(-βΔ)                 conservative DPO, Mitchell 2023
        robust   [-(1-ε) log σ(βΔ) + ε log σ(-βΔ)] / (1-2ε)      rDPO, Chowdhury et al. 2024
        hinge    relu(1 - βΔ)                                    SLiC, Zhao et al. 2023
        ipo      (Δ - 1/(2β))²                                   IPO, Azar et al. 2023

    sigmoid/cdpo/robust/hinge take summed log-probs. IPO, as in TRL (PR #1265, confirmed
    with the IPO authors), takes *length-averaged* ones, so Δ = Δ_c/n_c - Δ_r/n_r: call
    ``sequence_logprobs(..., average=True)`` for it. β is IPO's τ. Returns the losses
    and the detached implicit rewards β(logπ - logπ_ref) of chosen and rejected.
    """
    if loss_type in ("cdpo", "robust"):
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5) for loss_type={loss_type!r}, got {label_smoothing}")
    elif label_smoothing:
        raise ValueError(
            f"label_smoothing={label_smoothing} has no effect with loss_type={loss_type!r}; use 'cdpo' or 'robust'"
        )
    delta = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    logits = beta * delta
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(logits)
    elif loss_type == "cdpo":
        losses = _smoothed_sigmoid_loss(logits, label_smoothing)
    elif loss_type == "robust":
        eps = label_smoothing
        losses = (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = torch.relu(1 - logits)
    elif loss_type == "ipo":
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of sigmoid, cdpo, robust, hinge, ipo")
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def simpo_loss(
    policy_chosen_avg: torch.Tensor,
    policy_rejected_avg: torch.Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (Meng et al. 2024): reference-free, length-normalised, with a target margin γ.

        L = -log σ(β(avg_c - avg_r) - γ)

    Inputs are length-averaged log-probs. γ is the absolute margin, as TRL's ``simpo_gamma``
    (which computes β(Δ - γ/β)); the SimPO repository's ``gamma_beta_ratio`` is γ/β, so
    pass ``gamma = gamma_beta_ratio * beta``. The paper's Llama-3-8B-Instruct setting is
    β 2.5, γ 1.375. ``label_smoothing`` ε gives -(1-ε) log σ(z) - ε log σ(-z) as in TRL.
    Pure SimPO has no NLL term; add ``α·nll`` yourself for CPO-SimPO. Returns the losses
    and the detached rewards β·avg.
    """
    losses = _smoothed_sigmoid_loss(beta * (policy_chosen_avg - policy_rejected_avg) - gamma, label_smoothing)
    return losses, beta * policy_chosen_avg.detach(), beta * policy_rejected_avg.detach()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, accurate at both ends (Mächler 2012)."""
    # Clamp the unused branch's input so its gradient cannot turn into NaN through `where`.
    near_zero = torch.log(-torch.expm1(x))
    far = torch.log1p(-torch.exp(x.clamp(max=-math.log(2))))
    return torch.where(x > -math.log(2), near_zero, far)


def orpo_loss(
    policy_chosen_avg: torch.Tensor,
    policy_rejected_avg: torch.Tensor,
    nll_chosen: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO (Hong et al. 2024): SFT loss plus a log-odds-ratio penalty, no reference model.

        log odds(y) = ℓ(y) - log(1 - e^ℓ(y)),   ℓ = length-averaged log-prob
        L = NLL(y_c) - β log σ(log odds(y_c) - log odds(y_r))

    As TRL's ``odds_ratio_loss``; β is the paper's λ. ``nll_chosen`` is a scalar or (B,);
    TRL's NLL covers prompt + completion of the chosen sequence (trl PR #1516). Inputs
    must be < 0 (a log-prob of exactly 0 has infinite odds). Returns the losses and the
    detached rewards β·ℓ.
    """
    log_odds = (policy_chosen_avg - policy_rejected_avg) - (
        _log1mexp(policy_chosen_avg) - _log1mexp(policy_rejected_avg)
    )
    losses = nll_chosen - beta * F.logsigmoid(log_odds)
    return losses, beta * policy_chosen_avg.detach(), beta * policy_rejected_avg.detach()


def cpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    nll_chosen: torch.Tensor,
    beta: float = 0.1,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPO (Xu et al. 2024): DPO with a uniform reference, plus behaviour cloning on chosen.

        L = -log σ(β(logπ(y_c) - logπ(y_r))) + α·NLL(y_c)

    Summed log-probs; ``nll_chosen`` (scalar or (B,)) is the chosen completion's NLL, as
    TRL's CPOTrainer (``loss_type="sigmoid"``, ``cpo_alpha`` = α). ``label_smoothing`` ε
    as in ``simpo_loss``. Returns the losses and the detached rewards β·logπ.
    """
    losses = _smoothed_sigmoid_loss(beta * (policy_chosen - policy_rejected), label_smoothing) + alpha * nll_chosen
    return losses, beta * policy_chosen.detach(), beta * policy_rejected.detach()


def kto_loss(
    policy: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    policy_kl: torch.Tensor | None,
    ref_kl: torch.Tensor | None,
    beta: float = 0.1,
    lambda_d: float = 1.0,
    lambda_u: float = 1.0,
    z0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO (Ethayarajh et al. 2024) on unpaired examples labelled desirable or not.

        r = logπ(y|x) - logπ_ref(y|x)
        z0 = max(0, mean(logπ(y'|x) - logπ_ref(y'|x))),  detached
        L = λ_D (1 - σ(β(r - z0)))  if desirable,   λ_U (1 - σ(β(z0 - r)))  otherwise

    Summed log-probs. y' are mismatched completions (each prompt paired with another
    example's completion, e.g. rotated by one, not reversed: trl#1911), scored by both
    models into ``policy_kl``/``ref_kl``. z0 is a baseline, so no gradient flows through
    it, as in TRL's ``kto_loss``. Under data parallelism the mean runs over every rank's KL
    rows (``KTOObjective`` pools them; TRL averages the processes' means): the caller computes
    that mean and passes it as ``z0`` (clamped here), and ``policy_kl``/``ref_kl`` are then None.
    Returns the losses (B,), the detached rewards βr and z0.
    """
    desirable = desirable.bool()
    if (z0 is None) == (policy_kl is None or ref_kl is None):
        raise ValueError("kto_loss needs either policy_kl and ref_kl, or the mean log-ratio z0, not both")
    z0 = ((policy_kl - ref_kl).mean() if z0 is None else z0).clamp(min=0).detach()
    r = policy - ref
    losses = torch.where(
        desirable, lambda_d * (1 - torch.sigmoid(beta * (r - z0))), lambda_u * (1 - torch.sigmoid(beta * (z0 - r)))
    )
    return losses, beta * r.detach(), z0


def bradley_terry_loss(
    rewards_chosen: torch.Tensor,
    rewards_rejected: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    center_coef: float = 0.0,
) -> torch.Tensor:
    """Reward-model loss (Bradley & Terry 1952; Ouyang et al. 2022; margin: Touvron et al. 2023).

        L = -log σ(r_c - r_r - m) + c·(r_c + r_r)²

    The centring term (Eisenstein et al. 2023; TRL ``center_rewards_coefficient``, 0.01
    recommended) keeps rewards near zero. The mean over pairs equals TRL RewardTrainer's loss.
    """
    diff = rewards_chosen - rewards_rejected
    if margin is not None:
        diff = diff - margin
    losses = -F.logsigmoid(diff)
    if center_coef:
        losses = losses + center_coef * (rewards_chosen + rewards_rejected) ** 2
    return losses
