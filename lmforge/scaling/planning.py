"""Compute-optimal plans from a fitted Chinchilla law L(N, D) = E + A/N^α + B/D^β, each with the
spread over the fit's bootstrap samples (rows of raw parameters log A, log B, log E, α, β).

- compute-optimal N, D at a budget C = 6ND (Hoffmann et al. 2022, eq. 4; ``parametric.compute_optimal``);
- over-training for inference (Sardana et al. 2024, "Beyond Chinchilla-Optimal"): the N, D_tr that
  reach the compute-optimal loss with the least 6·N·D_tr + 2·N·D_inf FLOPs in all;
- repeated data (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models"): with U_D
  unique tokens, repeated tokens and excess parameters are worth less,
  D' = U_D + U_D·R_D*·(1 − e^(−R_D/R_D*)), R_D = D/U_D − 1, and
  N' = U_N + U_N·R_N*·(1 − e^(−R_N/R_N*)), U_N = min(N, the compute-optimal N for U_D tokens),
  R_N = N/U_N − 1, with their fitted R_D* = 15.387756 and R_N* = 5.309743 (datablations README);
  the plan is the N (D = C/6N) that minimises L(N', D') on a grid. Their R* were fitted beside
  their own E, A, B, α, β: used with another fit's constants they are an approximation;
- batch size and learning rate from DeepSeek LLM (DeepSeek-AI 2024, §3.1):
  B_opt = 0.2920·C^0.3271 tokens, η_opt = 0.3118·C^−0.1250, fitted for their AdamW setup, with C
  their non-embedding FLOPs (M·D): here C = 6ND, an approximation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar

from lmforge.scaling.parametric import chinchilla_constants, compute_optimal

R_D_STAR = 15.387756
R_N_STAR = 5.309743
DEEPSEEK_BATCH = (0.2920, 0.3271)  # B_opt = k·C^p tokens
DEEPSEEK_LR = (0.3118, -0.1250)  # η_opt = k·C^p
FAR_FACTOR = 100.0  # a budget this many times beyond the fitted runs' compute is a far extrapolation


def chinchilla_loss(k: dict, n, d) -> np.ndarray:
    return k["E"] + k["A"] / np.asarray(n) ** k["alpha"] + k["B"] / np.asarray(d) ** k["beta"]


def spread(values: np.ndarray, level: float) -> dict[str, float]:
    values = values[np.isfinite(values)]
    if values.size < 2:
        return {"low": math.nan, "high": math.nan}
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return {"low": float(low), "high": float(high)}


def _one(k: dict, i: int) -> dict:
    return {name: float(v[i]) for name, v in k.items()}


@dataclass
class Allocation:
    params: float
    tokens: float
    loss: float
    params_range: dict
    tokens_range: dict

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params


def optimal_allocation(x: np.ndarray, samples: np.ndarray, flops: float, level: float) -> Allocation:
    n, d = compute_optimal(x, flops)
    k = chinchilla_constants(x)
    ns, ds = (v[:, 0] for v in compute_optimal(samples, flops)) if len(samples) else (np.empty(0), np.empty(0))
    return Allocation(float(n[0, 0]), float(d[0, 0]), float(chinchilla_loss(_one(k, 0), n[0, 0], d[0, 0])),
                      spread(ns, level), spread(ds, level))


def _overtrained(k: dict, flops: float, inference_tokens: float) -> tuple[float, float, float]:
    """(N, D_tr, loss target): the least 6·N·D_tr + 2·N·D_inf reaching the compute-optimal loss."""
    g, c6 = k["G"], flops / 6.0
    n_opt = g * c6 ** k["a"]
    target = chinchilla_loss(k, n_opt, c6 / n_opt)
    gap = target - k["E"]

    def tokens(log_n: float) -> float:
        left = gap - k["A"] / math.exp(log_n) ** k["alpha"]
        return (k["B"] / left) ** (1 / k["beta"]) if left > 0 else math.inf

    def cost(log_n: float) -> float:
        n = math.exp(log_n)
        return 6 * n * tokens(log_n) + 2 * n * inference_tokens

    n_min = (k["A"] / gap) ** (1 / k["alpha"])  # below it no D reaches the target
    res = minimize_scalar(cost, bounds=(math.log(n_min) + 1e-9, math.log(n_opt) + 1e-9), method="bounded",
                          options={"xatol": 1e-7})
    return math.exp(res.x), tokens(res.x), float(target)


def overtrained_plan(x: np.ndarray, samples: np.ndarray, flops: float, inference_tokens: float,
                     level: float) -> dict:
    """Sardana et al. 2024: the model that reaches the compute-optimal loss at ``flops`` with the
    fewest training + inference FLOPs when it will serve ``inference_tokens`` tokens."""
    k = chinchilla_constants(x)
    n, d, target = _overtrained(_one(k, 0), flops, inference_tokens)
    n_opt, d_opt = (float(v[0, 0]) for v in compute_optimal(x, flops))
    total = 6 * n * d + 2 * n * inference_tokens
    baseline = 6 * n_opt * d_opt + 2 * n_opt * inference_tokens
    ks = chinchilla_constants(samples) if len(samples) else None
    sampled = np.array([_overtrained(_one(ks, i), flops, inference_tokens)[:2] for i in range(len(samples))]) \
        if ks is not None else np.empty((0, 2))
    return {"inference_tokens": inference_tokens, "loss": target, "params": n, "tokens": d,
            "tokens_per_param": d / n, "training_flops": 6 * n * d, "inference_flops": 2 * n * inference_tokens,
            "total_flops": total, "compute_optimal_total_flops": baseline, "saving": 1 - total / baseline,
            "params_range": spread(sampled[:, 0], level), "tokens_range": spread(sampled[:, 1], level)}


def effective(unique, total, r_star: float) -> np.ndarray:
    """U + U·R*·(1 − e^(−R/R*)), R = total/U − 1: Muennighoff et al. 2023, eq. 5 and 6, with U the
    unique part of ``total`` (all of it when total ≤ unique)."""
    total = np.asarray(total, dtype=float)
    unique = np.minimum(unique, total)
    repeats = total / unique - 1.0
    return unique + unique * r_star * (1.0 - np.exp(-repeats / r_star))


def data_constrained_loss(k: dict, n, d, unique_tokens: float) -> np.ndarray:
    n = np.asarray(n, dtype=float)
    unique_n = np.minimum(n, k["G"] * (k["G"] * unique_tokens) ** (k["beta"] / k["alpha"]))
    return chinchilla_loss(k, effective(unique_n, n, R_N_STAR), effective(unique_tokens, d, R_D_STAR))


def _constrained(k: dict, flops: float, unique_tokens: float) -> tuple[float, float, float]:
    n_opt = k["G"] * (flops / 6.0) ** k["a"]
    grid = np.geomspace(n_opt / 1e3, n_opt * 1e2, 2001)
    loss = data_constrained_loss(k, grid, flops / (6 * grid), unique_tokens)
    i = int(np.argmin(loss))
    return float(grid[i]), float(flops / (6 * grid[i])), float(loss[i])


def data_constrained_plan(x: np.ndarray, samples: np.ndarray, flops: float, unique_tokens: float,
                          level: float) -> dict:
    """Muennighoff et al. 2023: the N, D (D = C/6N, repeating ``unique_tokens``) with the least
    loss L(N', D'), beside the compute-optimal plan's loss with the same repeated data."""
    k = _one(chinchilla_constants(x), 0)
    n, d, loss = _constrained(k, flops, unique_tokens)
    n_opt = k["G"] * (flops / 6.0) ** k["a"]
    d_opt = flops / (6 * n_opt)
    ks = chinchilla_constants(samples) if len(samples) else None
    sampled = np.array([_constrained(_one(ks, i), flops, unique_tokens)[:2] for i in range(len(samples))]) \
        if ks is not None else np.empty((0, 2))
    return {"unique_tokens": unique_tokens, "params": n, "tokens": d, "epochs": d / unique_tokens, "loss": loss,
            "compute_optimal_loss_with_repeats": float(data_constrained_loss(k, n_opt, d_opt, unique_tokens)),
            "compute_optimal_epochs": d_opt / unique_tokens,
            "unconstrained_loss": float(chinchilla_loss(k, n_opt, d_opt)),
            "params_range": spread(sampled[:, 0], level), "tokens_range": spread(sampled[:, 1], level),
            "r_d_star": R_D_STAR, "r_n_star": R_N_STAR}


def deepseek_hyperparameters(flops: float) -> dict:
    """DeepSeek LLM's (2024) batch size (tokens) and peak learning rate for a budget."""
    return {"batch_tokens": DEEPSEEK_BATCH[0] * flops ** DEEPSEEK_BATCH[1],
            "lr": DEEPSEEK_LR[0] * flops ** DEEPSEEK_LR[1]}
