"""Parametric scaling laws fitted to (N, D, loss) points: Hoffmann et al. 2022's Approach 3 and
Kaplan et al. 2020's L(N, D), by the same robust procedure.

Chinchilla (Hoffmann et al. 2022, eq. 2; fitted as in their App. D.2 and Besiroglu et al. 2024):

    L(N, D) = E + A / N^α + B / D^β
    log L̂ = LSE(a − α log N, b − β log D, e),   A = e^a, B = e^b, E = e^e
    minimise Σ_i Huber_δ(log L̂_i − log L_i),  δ = 1e-3

with L-BFGS from every start of Hoffmann et al.'s grid (α, β ∈ {0, 0.5, …, 2}, e ∈ {−1, −.5, …, 1},
a, b ∈ {0, 5, …, 25}) and the best end kept. The objective is the sum over points, not the mean:
Besiroglu et al. show that the mean's tiny scale stops L-BFGS early, which is how Hoffmann et al.'s
own estimates came out biased. Standard errors and intervals come from a bootstrap over the runs
(resampled with replacement, each refitted from the full-data estimate, as Besiroglu et al. do).

Kaplan et al. 2020, eq. 1.5: L(N, D) = [(N_c / N)^(α_N/α_D) + D_c / D]^α_D, whose limits are their
L(N) = (N_c / N)^α_N (data not a bottleneck) and L(D) = (D_c / D)^α_D (model not a bottleneck).
In log form log L̂ = α_D · LSE((α_N/α_D)(log N_c − log N), log D_c − log D), fitted the same way.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize
from threadpoolctl import threadpool_limits

from lmforge.scaling.runs import Runs, require_points

HUBER_DELTA = 1e-3


def huber(r: np.ndarray, delta: float) -> tuple[float, np.ndarray]:
    """Σ Huber_δ(r) and its derivative per residual: ½r² inside |r| ≤ δ, δ(|r| − ½δ) outside."""
    inside = np.abs(r) <= delta
    value = np.where(inside, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum()
    return float(value), np.where(inside, r, delta * np.sign(r))


def _softmax3(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    top = t.max(axis=0)
    w = np.exp(t - top)
    total = w.sum(axis=0)
    return top + np.log(total), w / total


def chinchilla_log_loss(x: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log L̂ = LSE(a − α log N, b − β log D, e) and its Jacobian in (a, b, e, α, β)."""
    a, b, e, alpha, beta = x
    t = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    pred, w = _softmax3(t)
    jac = np.stack([w[0], w[1], w[2], -w[0] * log_n, -w[1] * log_d], axis=1)
    return pred, jac


def kaplan_log_loss(x: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log L̂ = α_D · LSE((α_N/α_D)(log N_c − log N), log D_c − log D) and its Jacobian in
    (log N_c, log D_c, α_N, α_D)."""
    log_nc, log_dc, alpha_n, alpha_d = x
    u = (alpha_n / alpha_d) * (log_nc - log_n)
    v = log_dc - log_d
    s, w = _softmax3(np.stack([u, v]))
    jac = np.stack([alpha_n * w[0], alpha_d * w[1], w[0] * (log_nc - log_n), s - w[0] * u], axis=1)
    return alpha_d * s, jac


@dataclass(frozen=True)
class Form:
    """A parametric law: its raw parameters, log-loss prediction, start grid and bounds."""

    name: str
    params: tuple[str, ...]
    log_loss: object  # (x, log N, log D) -> (log L̂, Jacobian)
    grid: tuple[tuple[float, ...], ...]
    bounds: tuple[tuple[float, float], ...]


CHINCHILLA = Form(
    "chinchilla", ("log_A", "log_B", "log_E", "alpha", "beta"), chinchilla_log_loss,
    grid=(tuple(np.arange(0, 30, 5.0)), tuple(np.arange(0, 30, 5.0)), tuple(np.arange(-1, 1.5, 0.5)),
          tuple(np.arange(0, 2.5, 0.5)), tuple(np.arange(0, 2.5, 0.5))),
    # wide enough to hold the grid and any sensible law; an estimate that ends on one is reported
    bounds=((-10.0, 60.0), (-10.0, 60.0), (-10.0, 5.0), (1e-3, 5.0), (1e-3, 5.0)),
)
KAPLAN = Form(
    "kaplan", ("log_Nc", "log_Dc", "alpha_N", "alpha_D"), kaplan_log_loss,
    grid=((10.0, 20.0, 30.0, 40.0), (10.0, 20.0, 30.0, 40.0), (0.05, 0.1, 0.2, 0.4), (0.05, 0.1, 0.2, 0.4)),
    bounds=((0.0, 120.0), (0.0, 120.0), (1e-3, 5.0), (1e-3, 5.0)),
)
FORMS = {f.name: f for f in (CHINCHILLA, KAPLAN)}


def huber_objective(x: np.ndarray, form: Form, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                    delta: float) -> tuple[float, np.ndarray]:
    """Σ Huber_δ(log L̂ − log L) / δ² and its gradient. Dividing by δ² keeps the minimiser and
    gives L-BFGS's stopping tests a scale they can see (a sum of ~1e-3 stops it early)."""
    pred, jac = form.log_loss(x, log_n, log_d)
    value, dr = huber(pred - log_l, delta)
    return value / delta ** 2, (dr @ jac) / delta ** 2


def _lbfgs(form: Form, x0, args) -> tuple[np.ndarray, float]:
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        res = minimize(huber_objective, np.asarray(x0, dtype=float), args=args, jac=True, method="L-BFGS-B",
                       bounds=form.bounds)
    return res.x, float(res.fun) * args[-1] ** 2 if np.isfinite(res.fun) else math.inf


def fit_points(form: Form, log_n, log_d, log_l, delta: float, starts) -> tuple[np.ndarray, float]:
    """The best L-BFGS end over ``starts`` (clipped into the bounds)."""
    lo, hi = np.array(form.bounds).T
    best_x, best = None, math.inf
    for x0 in starts:
        x, value = _lbfgs(form, np.clip(x0, lo, hi), (form, log_n, log_d, log_l, delta))
        if value < best:
            best_x, best = x, value
    return best_x, best


@dataclass
class LawFit:
    """A fitted law: raw parameters, their bootstrap samples, and how well it fits."""

    form: str
    params: dict[str, float]
    bootstrap: np.ndarray  # (samples, len(params)) raw parameters
    objective: float
    r2: float  # on the loss itself
    rmse_log: float  # of the log-loss residuals
    residuals: np.ndarray  # log L − log L̂ per point
    predicted: np.ndarray  # L̂ per point
    at_bound: list[str] = field(default_factory=list)

    def vector(self) -> np.ndarray:
        return np.array(list(self.params.values()))


def _at_bounds(form: Form, x: np.ndarray) -> list[str]:
    out = []
    for name, value, (lo, hi) in zip(form.params, x, form.bounds):
        span = hi - lo
        if value - lo < 1e-6 * span or hi - value < 1e-6 * span:
            out.append(f"{name} = {value:.4g} is at its bound [{lo:g}, {hi:g}]")
    return out


def fit_law(form: Form, runs: Runs, *, bootstrap: int = 100, seed: int = 0, delta: float = HUBER_DELTA,
            grid_stride: int = 1) -> LawFit:
    """Fit ``form`` to the runs from its start grid (every ``grid_stride``-th value of each axis),
    then bootstrap it ``bootstrap`` times."""
    require_points(runs, len(form.params), f"the {form.name} law")
    log_n, log_d, log_l = np.log(runs.params), np.log(runs.tokens), np.log(runs.loss)
    starts = list(itertools.product(*(axis[::grid_stride] for axis in form.grid)))
    rng = np.random.default_rng(seed)
    samples = []
    with threadpool_limits(1):
        x, value = fit_points(form, log_n, log_d, log_l, delta, starts)
        for _ in range(bootstrap):
            idx = rng.integers(0, len(runs), len(runs))
            samples.append(_lbfgs(form, x, (form, log_n[idx], log_d[idx], log_l[idx], delta))[0])
    pred = np.exp(form.log_loss(x, log_n, log_d)[0])
    resid = log_l - np.log(pred)
    r2 = 1.0 - float(((runs.loss - pred) ** 2).sum() / ((runs.loss - runs.loss.mean()) ** 2).sum())
    return LawFit(form.name, dict(zip(form.params, map(float, x))),
                  np.array(samples).reshape(-1, len(form.params)), value, r2, float(np.sqrt((resid ** 2).mean())),
                  resid, pred, _at_bounds(form, x))


def predict(fit: LawFit, n, d) -> np.ndarray:
    """L̂(N, D) of a fitted law."""
    x = fit.vector()
    log_n, log_d = np.log(np.asarray(n, dtype=float)), np.log(np.asarray(d, dtype=float))
    return np.exp(FORMS[fit.form].log_loss(x, np.atleast_1d(log_n), np.atleast_1d(log_d))[0])


# --------------------------------------------------------------------------- Chinchilla's constants

def chinchilla_constants(x: np.ndarray) -> dict[str, np.ndarray]:
    """A, B, E, α, β and the compute-optimal allocation of Hoffmann et al. 2022 (eq. 4), for raw
    parameters ``x`` (one row or many): under C = 6ND,
    N_opt = G (C/6)^a, D_opt = G^-1 (C/6)^b, G = (αA / (βB))^(1/(α+β)), a = β/(α+β), b = α/(α+β)."""
    x = np.atleast_2d(x)
    log_a, log_b, log_e, alpha, beta = x.T
    log_g = (np.log(alpha) + log_a - np.log(beta) - log_b) / (alpha + beta)
    return {"E": np.exp(log_e), "A": np.exp(log_a), "B": np.exp(log_b), "alpha": alpha, "beta": beta,
            "G": np.exp(log_g), "a": beta / (alpha + beta), "b": alpha / (alpha + beta)}


def kaplan_constants(x: np.ndarray) -> dict[str, np.ndarray]:
    x = np.atleast_2d(x)
    log_nc, log_dc, alpha_n, alpha_d = x.T
    return {"N_c": np.exp(log_nc), "D_c": np.exp(log_dc), "alpha_N": alpha_n, "alpha_D": alpha_d}


def compute_optimal(x: np.ndarray, flops) -> tuple[np.ndarray, np.ndarray]:
    """N_opt and D_opt at ``flops`` for Chinchilla raw parameters ``x`` (rows: bootstrap samples)."""
    k = chinchilla_constants(x)
    c6 = np.asarray(flops, dtype=float) / 6.0
    n = k["G"][:, None] * c6 ** k["a"][:, None]
    return n, c6 / n


def uncertainty(estimate: float, samples: np.ndarray, level: float) -> dict[str, float]:
    """Bootstrap standard error and percentile interval of one constant."""
    samples = samples[np.isfinite(samples)]
    tail = 100 * (1 - level) / 2
    if samples.size < 2:
        return {"estimate": estimate, "se": math.nan, "low": math.nan, "high": math.nan}
    low, high = np.percentile(samples, [tail, 100 - tail])
    return {"estimate": estimate, "se": float(samples.std(ddof=1)), "low": float(low), "high": float(high)}


def constants_table(fit: LawFit, level: float) -> dict[str, dict[str, float]]:
    """Every constant of a fit (raw and derived) with its bootstrap SE and interval."""
    derive = chinchilla_constants if fit.form == "chinchilla" else kaplan_constants
    point = {k: float(v[0]) for k, v in derive(fit.vector()).items()}
    samples = derive(fit.bootstrap) if len(fit.bootstrap) else {k: np.array([]) for k in point}
    table = {k: uncertainty(point[k], samples[k], level) for k in point}
    for i, name in enumerate(fit.params):
        if name.startswith("log_"):
            table[name] = uncertainty(fit.params[name], fit.bootstrap[:, i] if len(fit.bootstrap) else np.array([]),
                                      level)
    return table
