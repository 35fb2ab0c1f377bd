"""Advantage estimators: how much better than expected each sampled token or completion was.

Pure functions of detached tensors, computed once per rollout batch, before the policy update.
Shapes: ``B`` completions of ``T`` response positions; ``mask`` (``B x T``, bool or 0/1) marks
the response tokens that are actions (not padding, not tool/observation tokens). Outcome
estimators take one score per completion and ``group_ids`` (``B`` integers, equal for the
completions of one prompt; they need not be contiguous) and return one advantage per
completion; ``per_token`` spreads it over the completion's tokens.

GAE and REINFORCE++ treat a masked position as no time step at all: the recursion carries
across it (verl's treatment of observation tokens), and its output is 0.

The masked statistics (``masked_mean``, ``masked_var``, ``whiten``) take ``all_sum``, a function
summing a tensor over the data-parallel ranks (an ``all_reduce``; the identity in one process),
so that under torchrun they are those of the whole global batch from each rank's sums and counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

# TRL's GRPOTrainer divides by std + 1e-4 (verl: 1e-6); a group with std 0 gets advantage 0 either way
GROUP_STD_EPS = 1e-4
WHITEN_EPS = 1e-8  # TRL's / torchtune's / verl's whiten: (x - mean) * rsqrt(var + 1e-8)

GroupScale = Literal["group", "batch", "none"]
ZeroVariance = Literal["keep", "drop"]
AllSum = Callable[[torch.Tensor], torch.Tensor]  # a tensor summed over the data-parallel ranks


def local_sum(x: torch.Tensor) -> torch.Tensor:
    """``AllSum`` in one process: the tensor itself."""
    return x


# ----------------------------------------------------------------------------- masked statistics

def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                all_sum: AllSum = local_sum) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set (0 where none is); with ``dim``
    None and ``all_sum``, over every rank's positions (one reduction of the sum and the count)."""
    m = mask.to(x.dtype)
    if dim is None:
        total, count = all_sum(torch.stack(((x * m).sum(), m.sum())))
        return total / count.clamp(min=1)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, all_sum: AllSum = local_sum,
               mean: torch.Tensor | None = None) -> torch.Tensor:
    """Variance of ``x`` over the masked positions (of every rank, with ``all_sum``), with Bessel's
    correction n/(n-1) by default (as TRL's, torchtune's and verl's ``masked_var``); ``mean``, when
    the caller has it, is ``masked_mean(x, mask)``. One reduction (squares and count together),
    two without ``mean``."""
    mean = masked_mean(x, mask, all_sum=all_sum) if mean is None else mean
    m = mask.to(x.dtype)
    squares, count = all_sum(torch.stack((((x - mean) ** 2 * m).sum(), m.sum())))
    n = int(count)
    if n < (2 if unbiased else 1):
        raise ValueError(f"masked_var needs at least {2 if unbiased else 1} masked positions, got {n}")
    var = squares / n
    return var * (n / (n - 1)) if unbiased else var


def whiten(x: torch.Tensor, mask: torch.Tensor | None = None, keep_mean: bool = False,
           all_sum: AllSum = local_sum) -> torch.Tensor:
    """Advantage whitening: ``(x - mean) / sqrt(var + 1e-8)`` over the masked positions (of every
    rank, with ``all_sum``), 0 elsewhere.

    ``keep_mean=True`` adds the mean back (only the spread is normalised). Mind the references'
    naming: TRL's and verl's ``masked_whiten(shift_mean=True)`` is ``keep_mean=False`` here, while
    torchtune's ``whiten(shift_mean=True)`` (the default its ``estimate_advantages`` uses) adds the
    mean back, i.e. ``keep_mean=True``.
    """
    mask = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
    mean = masked_mean(x, mask, all_sum=all_sum)
    var = masked_var(x, mask, all_sum=all_sum, mean=mean)
    out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if keep_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per completion (``B``) spread over its response tokens (``B x T``)."""
    return advantages.unsqueeze(-1) * mask.to(advantages.dtype)


# ----------------------------------------------------------------------------- token-level estimators

@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16) and returns.

        δ_t = r_t + γ V(s_{t+1}) − V(s_t),   A_t = Σ_l (γλ)^l δ_{t+l},   R_t = A_t + V(s_t)

    with V = 0 after the last response token. ``rewards`` and ``values`` are ``B x T`` (per-token
    rewards, e.g. ``kl.kl_shaped_rewards``; the value head's estimates at each response token).
    λ = 1 gives the Monte-Carlo return minus V; λ = 0 the one-step TD error. Returns are the value
    head's regression targets. Whitening (``whiten``) is the caller's choice, on ``A`` only.
    """
    _check_token_tensors(mask, rewards=rewards, values=values)
    m = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    running = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * running
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        running = torch.where(m[:, t] > 0, a_t, running)
        advantages[:, t] = a_t * m[:, t]
    return advantages, (advantages + values) * m


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Token-level discounted returns ``G_t = Σ_{s≥t} γ^{s−t} r_s`` over the response tokens."""
    _check_token_tensors(mask, rewards=rewards)
    m = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        g_t = rewards[:, t] + gamma * running
        running = torch.where(m[:, t] > 0, g_t, running)
        returns[:, t] = g_t * m[:, t]
    return returns


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                            all_sum: AllSum = local_sum) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): critic-free, global batch normalisation.

        r_t = 1[t = last]·score − β·KL_t,   G_t = Σ_{s≥t} γ^{s−t} r_s,   A_t = (G_t − mean G) / std G

    with mean and std over every response token of the batch (pass the whole rollout batch, not a
    micro-batch; under torchrun this rank's share and ``all_sum``, so the statistics are the global
    batch's); ``token_rewards`` is ``kl.kl_shaped_rewards``'s output, the KL in the reward as
    in the paper and verl's ``compute_reinforce_plus_plus_outcome_advantage``. Returns ``(A, G)``.
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return whiten(returns, mask, all_sum=all_sum), returns


# ----------------------------------------------------------------------------- outcome estimators

def _groups(scores: torch.Tensor, group_ids: torch.Tensor, min_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's group number (0..G-1) and each group's size, checking the inputs."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be one score per completion (1-D), got shape {tuple(scores.shape)}")
    if group_ids.shape != scores.shape:
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, scores {tuple(scores.shape)}: one id per score")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor (the prompt each completion answers), got {group_ids.dtype}")
    ids, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    small = counts < min_size
    if bool(small.any()):
        bad = ids[small][0].item()
        raise ValueError(f"group-relative advantages need at least {min_size} completions per prompt: group id {bad} "
                         f"has {counts[small][0].item()}; sample several completions per prompt (num_generations >= 2)")
    return inverse, counts


def _group_sum(x: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    return x.new_zeros(n_groups).index_add_(0, inverse, x)


@torch.no_grad()
def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, scale: GroupScale = "group",
                    eps: float = GROUP_STD_EPS) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, arXiv:2402.03300, outcome supervision):

        A_i = (r_i − mean_{j∈g(i)} r_j) / (std_{j∈g(i)} r_j + ε)

    ``scale="group"``: the group's std (unbiased, as TRL's and verl's); ``"batch"``: the whole batch's
    std (TRL's ``scale_rewards="batch"``, Lite PPO); ``"none"``: mean-centred only (Dr. GRPO, Liu et al.
    2025, arXiv:2503.20783, which shows the std division biases towards too-easy/too-hard prompts).
    """
    inverse, counts = _groups(scores, group_ids, min_size=2)
    n = counts.to(scores.dtype)
    mean = (_group_sum(scores, inverse, len(counts)) / n)[inverse]
    centred = scores - mean
    if scale == "none":
        return centred
    if scale == "group":
        std = (_group_sum(centred**2, inverse, len(counts)) / (n - 1)).sqrt()[inverse]
    elif scale == "batch":
        std = scores.std()
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return centred / (std + eps)


@torch.no_grad()
def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740): each
    completion's baseline is the mean score of the *other* k−1 completions of its prompt:

        A_i = r_i − (1/(k−1)) Σ_{j∈g(i), j≠i} r_j  =  k/(k−1) · (r_i − mean_{g(i)} r)
    """
    inverse, counts = _groups(scores, group_ids, min_size=2)
    k = counts.to(scores.dtype)[inverse]
    total = _group_sum(scores, inverse, len(counts))[inverse]
    return scores - (total - scores) / (k - 1)


@torch.no_grad()
def reinforce_advantages(scores: torch.Tensor, baseline: torch.Tensor | float | None = None) -> torch.Tensor:
    """REINFORCE with a baseline (Williams 1992): ``A_i = r_i − b``. ``baseline`` is a number, one
    per completion (e.g. ReMax's greedy-decode score, a running mean), or None for the batch mean."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be one score per completion (1-D), got shape {tuple(scores.shape)}")
    b = scores.mean() if baseline is None else baseline
    return scores - b


# ----------------------------------------------------------------------------- zero-variance groups

@torch.no_grad()
def zero_variance_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per completion: True where every completion of its prompt scored the same (all right or all
    wrong). Such a group has advantage 0 under every group-relative estimator: no learning signal."""
    inverse, counts = _groups(scores, group_ids, min_size=1)
    hi = scores.new_full((len(counts),), -torch.inf).scatter_reduce(0, inverse, scores, "amax")
    lo = scores.new_full((len(counts),), torch.inf).scatter_reduce(0, inverse, scores, "amin")
    return torch.isclose(hi, lo)[inverse]


@torch.no_grad()
def zero_variance_mask(scores: torch.Tensor, group_ids: torch.Tensor,
                       policy: ZeroVariance = "keep") -> tuple[torch.Tensor, int]:
    """The completions to train on, and how many prompts were dropped.

    ``"keep"``: all of them (zero-variance groups stay in with advantage 0, and still count in a
    token-mean's denominator, as TRL does). ``"drop"``: leave zero-variance groups out (DAPO's
    dynamic sampling, Yu et al. 2025, arXiv:2503.14476, without the re-sampling); multiply the
    token mask by the result so that the loss's token count excludes them too.
    """
    flat = zero_variance_groups(scores, group_ids)
    if policy == "keep":
        return torch.ones_like(flat), 0
    if policy != "drop":
        raise ValueError(f"policy must be 'keep' or 'drop', got {policy!r}")
    return ~flat, int(torch.unique(group_ids[flat]).numel())


def _check_token_tensors(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        if x.dim() != 2 or x.shape != mask.shape:
            raise ValueError(f"{name} must be B x T like mask {tuple(mask.shape)}, got {tuple(x.shape)}")
