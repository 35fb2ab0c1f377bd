"""Policy-gradient losses: PPO's clipped surrogate and its GRPO/DAPO/GSPO variants, the clipped
value loss, the entropy bonus, and how per-token losses become one number.

Pure functions of ``B x T`` tensors: ``logp`` (the current policy's log-probs of the sampled
tokens, with gradient), ``old_logp`` (the sampling policy's, detached), per-token or
per-completion ``advantages``, and ``mask`` (the response tokens that are actions).

**Aggregation** (``aggregate``; verl's ``loss_agg_mode`` names), with ``L_it`` the per-token loss
and ``m_it`` the mask:

- ``token-mean`` (default; DAPO, TRL's ``dapo``/``bnpo``): ``Σ_it m·L / N``, N the response tokens
  of the whole optimizer step. Pass the global N as ``n_tokens`` and the loss is the same however
  the batch is split into micro-batches or data-parallel ranks (their summed gradients equal the
  full batch's); left out, N is this call's own token count (TRL's ``bnpo``, per micro-batch).
- ``seq-mean-token-mean`` (GRPO's paper, TRL's ``grpo``, GSPO): ``(1/S) Σ_i (Σ_t m·L / |y_i|)``.
- ``seq-mean-token-sum``: ``(1/S) Σ_i Σ_t m·L``.
- ``seq-mean-token-sum-norm`` (Dr. GRPO, TRL's ``dr_grpo``): ``Σ_it m·L / (S · max_length)``, a
  constant in place of each completion's length, which removes GRPO's length bias.

S is ``n_sequences``: the completions of the step with at least one response token (pass the
global count across micro-batches, as for N).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lmforge.core.config import at_least, in_range, option, positive
from lmforge.rl.advantages import masked_mean
from lmforge.rl.kl import KLEstimator, kl_estimate

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
RatioLevel = Literal["token", "sequence"]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation = "token-mean", *,
              n_tokens: int | float | torch.Tensor | None = None, n_sequences: int | float | torch.Tensor | None = None,
              max_length: int | None = None) -> torch.Tensor:
    """One loss from per-token losses (module docstring: the modes and their normalisers)."""
    m = mask.to(per_token.dtype)
    per_token = per_token.expand_as(m)
    if mode == "token-mean":
        return (per_token * m).sum() / (m.sum().clamp(min=1) if n_tokens is None else n_tokens)
    per_sequence = (per_token * m).sum(-1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / m.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if max_length is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' (Dr. GRPO) needs max_length: the maximum completion length")
        per_sequence = per_sequence / max_length
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {mode!r}")
    s = (m.sum(-1) > 0).sum().clamp(min=1) if n_sequences is None else n_sequences
    return per_sequence.sum() / s


def importance_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                         level: RatioLevel = "token") -> torch.Tensor:
    """log of the importance ratio π_θ/π_old at each token.

    ``token`` (PPO, GRPO): ``log r_it = log π_θ(y_it) − log π_old(y_it)``.
    ``sequence`` (GSPO, Zheng et al. 2025, arXiv:2507.18071): the length-normalised sequence ratio
    ``s_i = (π_θ(y_i)/π_old(y_i))^{1/|y_i|} = exp((1/|y_i|) Σ_t log r_it)``, the log-ratios
    *averaged* over the completion (a sum would put ratios like e^{|y|·δ} into the clip range),
    in the GSPO-token form ``s_it = sg[s_i] · π_θ(y_it)/sg[π_θ(y_it)]``: its value is s_i at every
    token and its gradient s_i·∇log π_θ(y_it), so a per-token advantage can be used, and with one
    advantage per completion it is GSPO's gradient exactly.
    """
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level != "sequence":
        raise ValueError(f"ratio level must be 'token' or 'sequence', got {level!r}")
    m = mask.to(logp.dtype)
    seq = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    return seq.detach() + logp - logp.detach()


@dataclass
class PolicyLossConfig:
    """The clipped surrogate's settings; the defaults are PPO's (ε = 0.2, token ratio, token-mean)."""

    clip_low: float = in_range(0.2, 0, 1, low_open=True, help="ε_low: the ratio's floor is 1 − ε_low")
    clip_high: float | None = positive(None, help="ε_high (None: ε_low). DAPO's clip-higher: 0.28")
    dual_clip: float | None = in_range(
        None, 1, low_open=True, help="c > 1 for A < 0 (verl's clip_ratio_c 3.0; TRL's delta)"
    )
    ratio_level: RatioLevel = option("token", help='"sequence": GSPO\'s length-normalised sequence ratio')
    aggregation: Aggregation = option(
        "token-mean",
        help="how per-token losses become the batch's: token-mean, seq-mean-token-mean (GRPO's paper), "
        "seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO)",
    )
    max_length: int | None = positive(None, help="Dr. GRPO's constant: the maximum completion length")
    kl_coef: float = at_least(
        0, 0.0, help="β of the KL-in-loss term β·KL_t (GRPO: 0.04 in the paper; 0 = no reference)"
    )
    kl_estimator: KLEstimator = option("k3", help="KL_t of the KL-in-loss term (k3: GRPO's, unbiased and >= 0)")
    entropy_coef: float = at_least(0, 0.0, help="loss −= coef · H (aggregated like the policy loss)")

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.aggregation == "seq-mean-token-sum-norm" and self.max_length is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' (Dr. GRPO) needs max_length, the maximum completion length")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (verl's clip_ratio_c, e.g. 3.0), got {self.dual_clip}")

    @property
    def epsilon_high(self) -> float:
        return self.clip_low if self.clip_high is None else self.clip_high


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: PolicyLossConfig | None = None, *, ref_logp: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                n_tokens: int | float | torch.Tensor | None = None,
                n_sequences: int | float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347, eq. 7), per token, negated:

        L_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε_low, 1 + ε_high))

    with separate ε_low/ε_high (DAPO's clip-higher, Yu et al. 2025, arXiv:2503.14476), and for
    A_t < 0 the dual clip (Ye et al. 2020, arXiv:1912.09729) ``L_t = min(L_t, −c·A_t)``, which bounds
    the loss of a token whose ratio has grown large; r_t is ``importance_log_ratio``'s (token or
    GSPO sequence). With ``weights`` (detached, per token: the rollout correction's w_t,
    ``rl.correction``) the clipped term is ``w_t · L_t``. With ``cfg.kl_coef`` > 0, β·KL_t(π‖π_ref) is added per token (GRPO's k3,
    ``ref_logp`` required); with ``cfg.entropy_coef`` > 0 and ``entropy`` given (``entropy_from_logits``)
    coef·H is subtracted. Then ``aggregate``. GRPO = this with ``grpo_advantages``; TRL's loss types
    map to aggregations: grpo → seq-mean-token-mean, bnpo → token-mean (local N), dr_grpo →
    seq-mean-token-sum-norm, dapo → token-mean (global N).

    Metrics (detached, means over this call's response tokens): ``clip_frac_low`` (r < 1−ε_low, A < 0),
    ``clip_frac_high`` (r > 1+ε_high, A > 0), ``clip_frac`` (either), ``dual_clip_frac``, ``approx_kl``
    (k3 estimate of KL(π_old‖π_θ) from the token ratios), ``ratio_mean``, ``ratio_max``, and
    ``kl_ref``, ``entropy`` when computed.
    """
    cfg = cfg or PolicyLossConfig()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(importance_log_ratio(logp, old_logp, mask, cfg.ratio_level))
    low, high = 1.0 - cfg.clip_low, 1.0 + cfg.epsilon_high
    unclipped, clipped = -adv * ratio, -adv * torch.clamp(ratio, low, high)
    per_token = torch.maximum(unclipped, clipped)
    if cfg.dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * cfg.dual_clip), per_token)
    if weights is not None:
        per_token = per_token * weights
    metrics: dict[str, torch.Tensor] = {}
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"kl_coef = {cfg.kl_coef} needs ref_logp, the reference policy's log-probs of the tokens")
        kl = kl_estimate(logp, ref_logp, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl_ref"] = masked_mean(kl.detach(), mask)
    agg = dict(mode=cfg.aggregation, n_tokens=n_tokens, n_sequences=n_sequences, max_length=cfg.max_length)
    loss = aggregate(per_token, mask, **agg)
    if entropy is not None:
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(entropy, mask, **agg)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    with torch.no_grad():
        r = ratio.expand_as(logp)
        a = adv.expand_as(logp)
        is_low, is_high = (r < low) & (a < 0), (r > high) & (a > 0)
        token_log_ratio = logp - old_logp
        on = mask.to(torch.bool)
        metrics |= {
            "clip_frac_low": masked_mean(is_low.to(logp.dtype), mask),
            "clip_frac_high": masked_mean(is_high.to(logp.dtype), mask),
            "clip_frac": masked_mean((is_low | is_high).to(logp.dtype), mask),
            "dual_clip_frac": masked_mean(((a < 0) & (r > (cfg.dual_clip or torch.inf))).to(logp.dtype), mask),
            "approx_kl": masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, mask),
            "ratio_mean": masked_mean(r, mask),
            "ratio_max": r[on].max() if bool(on.any()) else r.new_zeros(()),
        }
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = 0.2, mode: Aggregation = "token-mean", *,
               n_tokens: int | float | torch.Tensor | None = None, n_sequences: int | float | torch.Tensor | None = None,
               max_length: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's loss with PPO2's value clipping (OpenAI baselines ppo2; torchtune's and TRL's PPO):

        L^V_t = ½ · max((V_t − R_t)², (clip(V_t, V_old,t − c, V_old,t + c) − R_t)²)

    which keeps the value head within ±c of the values it had when the rollout was scored.
    ``clip=None``: the plain ½(V − R)². Metrics: ``value_clip_frac`` (the clipped term was larger).
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        per_token, frac = unclipped, torch.zeros((), device=values.device)
    else:
        clipped = (torch.clamp(values, old_values - clip, old_values + clip) - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        frac = masked_mean((clipped > unclipped).to(values.dtype).detach(), mask)
    loss = 0.5 * aggregate(per_token, mask, mode, n_tokens=n_tokens, n_sequences=n_sequences, max_length=max_length)
    return loss, {"value_clip_frac": frac}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """The policy's entropy at each position, ``H = −Σ_v p_v log p_v = logsumexp(z) − Σ_v p_v z_v``
    (nats), in float32; ``logits`` is ``... x V``. Masking is ``aggregate``'s/``policy_loss``'s."""
    z = logits.float()
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
