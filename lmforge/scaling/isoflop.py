"""Hoffmann et al. 2022's Approaches 1 and 2: compute-optimal N and D read off the runs without a
parametric law, then power laws N_opt ∝ C^a and D_opt ∝ C^b fitted through them.

Approach 1, the envelope of training curves: for each FLOP count C, the lowest loss any run
reached with at most C FLOPs, and the N and D of the run (and step) that reached it.
Approach 2, IsoFLOP profiles: the runs of one FLOP budget, loss against log N fitted by a
parabola; its vertex is that budget's N_opt (D_opt from the budget's D against N at that N).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lmforge.core.io import InputError
from lmforge.scaling.runs import Runs


@dataclass
class PowerLaw:
    """y = coefficient · C^exponent, least squares in log-log; ``se``: the slope's standard error."""

    exponent: float
    se: float
    coefficient: float
    n_points: int

    def __call__(self, flops) -> np.ndarray:
        return self.coefficient * np.asarray(flops, dtype=float) ** self.exponent


def fit_power_law(flops: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> PowerLaw:
    """Weighted least squares of log y on log C; the slope's SE counts each point once."""
    x, z = np.log(flops), np.log(y)
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=float)
    if np.ptp(x) == 0:
        raise InputError("a power law in C needs points at more than one FLOP count")
    slope, intercept = np.polyfit(x, z, 1, w=np.sqrt(w))
    n = len(x)
    se = math.nan
    if n > 2:
        resid = z - (slope * x + intercept)
        xm = (w * x).sum() / w.sum()
        se = math.sqrt((w * resid ** 2).sum() / w.sum() * n / (n - 2) / (n * (w * (x - xm) ** 2).sum() / w.sum()))
    return PowerLaw(float(slope), se, float(math.exp(intercept)), n)


# --------------------------------------------------------------------------- Approach 2

FAR = math.log(1e3)  # a profile's minimum this far (in log N) beyond its runs is no estimate

@dataclass
class Budget:
    """One IsoFLOP profile: loss = c2·(log N)² + c1·log N + c0 over its runs."""

    flops: float  # the geometric mean of its runs' FLOPs
    runs: list[int]  # indices into the fitted runs
    coeffs: tuple[float, float, float]
    n_opt: float
    d_opt: float
    loss_opt: float
    inside: bool  # the vertex lies within the runs' range of N


@dataclass
class IsoFlopFit:
    budgets: list[Budget]
    n_opt: PowerLaw
    d_opt: PowerLaw
    warnings: list[str] = field(default_factory=list)


def group_budgets(flops: np.ndarray, tolerance: float) -> list[np.ndarray]:
    """Runs whose FLOPs lie within ``tolerance`` decades of the smallest run not yet grouped."""
    order = np.argsort(flops)
    log_c = np.log10(flops[order])
    groups, start = [], 0
    while start < len(order):
        stop = start + int(np.searchsorted(log_c[start:], log_c[start] + tolerance, side="right"))
        groups.append(order[start:stop])
        start = stop
    return groups


def fit_isoflop(runs: Runs, tolerance: float = 0.05, min_points: int = 3) -> IsoFlopFit:
    """Approach 2 over the FLOP budgets found in ``runs`` (grouped by ``group_budgets``). A budget
    whose parabola cannot give an optimum is skipped with a warning; too few usable budgets is an
    error that says, budget by budget, why each was skipped."""
    warnings, budgets, dropped = [], [], 0
    skipped: list[tuple[float, str]] = []  # (C, why) of each budget left out, for the error
    log_n, log_d = np.log(runs.params), np.log(runs.tokens)
    for idx in group_budgets(runs.flops, tolerance):
        c_mean = float(np.exp(np.log(runs.flops[idx]).mean()))
        sizes = len(np.unique(runs.params[idx]))
        if sizes < min_points:
            dropped += len(idx)
            skipped.append((c_mean, f"only {sizes} model size{'s' if sizes > 1 else ''}"))
            continue
        c2, c1, c0 = np.polyfit(log_n[idx], runs.loss[idx], 2)
        if c2 <= 0:
            warnings.append(f"Approach 2: the profile at C = {c_mean:.3g} opens downward (no minimum in N); "
                            "skipped: spread its runs more widely around the optimum")
            skipped.append((c_mean, "opens downward"))
            continue
        vertex = -c1 / (2 * c2)
        if not log_n[idx].min() - FAR <= vertex <= log_n[idx].max() + FAR:
            warnings.append(f"Approach 2: the profile at C = {c_mean:.3g} has its minimum at log N = {vertex:.3g}, "
                            f"over {FAR / math.log(10):g} decades outside its runs' N (a nearly flat parabola); "
                            "skipped: spread its runs more widely around the optimum")
            skipped.append((c_mean, f"minimum over {FAR / math.log(10):g} decades outside its N"))
            continue
        slope, intercept = np.polyfit(log_n[idx], log_d[idx], 1)
        inside = bool(log_n[idx].min() <= vertex <= log_n[idx].max())
        if not inside:
            warnings.append(f"Approach 2: the profile at C = {c_mean:.3g} has its minimum at N = {math.exp(vertex):.3g}, "
                            "outside its runs' range: the optimum is extrapolated")
        if len(idx) < 5:
            warnings.append(f"Approach 2: only {len(idx)} runs at C = {c_mean:.3g}; a parabola through "
                            "fewer than 5 is poorly constrained")
        budgets.append(Budget(c_mean, idx.tolist(), (float(c2), float(c1), float(c0)), math.exp(vertex),
                              math.exp(slope * vertex + intercept), float(c2 * vertex ** 2 + c1 * vertex + c0),
                              inside))
    if dropped:
        warnings.append(f"Approach 2: {dropped} run(s) left out, in FLOP groups (±{tolerance} decades) with fewer "
                        f"than {min_points} model sizes")
    if len(budgets) < 2:
        why = f": {skipped_reasons(skipped)}" if skipped else ""
        raise InputError(f"{runs.source}: Approach 2 (IsoFLOP profiles) needs at least 2 FLOP budgets with a usable "
                         f"parabola (at least {min_points} model sizes, opening upward, its minimum within "
                         f"{FAR / math.log(10):g} decades of its runs; runs within ±{tolerance} decades of FLOPs count "
                         f"as one budget); found {len(budgets)} usable of {len(budgets) + len(skipped)}{why}. Train "
                         "more sizes per budget, spread them around its optimum, widen fit.budget_tolerance, or leave "
                         "Approach 2 out (fit.approaches=[1,3])")
    c = np.array([b.flops for b in budgets])
    return IsoFlopFit(budgets, fit_power_law(c, np.array([b.n_opt for b in budgets])),
                      fit_power_law(c, np.array([b.d_opt for b in budgets])), warnings)


def skipped_reasons(skipped: list[tuple[float, str]], shown: int = 3) -> str:
    """``C = 1e+18, 1e+19: opens downward; C = 1e+20: only 2 model sizes``: the budgets that share a
    reason together, at most ``shown`` of each named, so the error stays one short line."""
    by_reason: dict[str, list[float]] = {}
    for c, why in skipped:
        by_reason.setdefault(why, []).append(c)
    parts = []
    for why, cs in by_reason.items():
        named = ", ".join(f"{c:.3g}" for c in cs[:shown]) + (f" and {len(cs) - shown} more" if len(cs) > shown else "")
        parts.append(f"C = {named}: {why}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- Approach 1

@dataclass
class EnvelopeFit:
    frontier: list[int]  # indices of the points on the loss-vs-FLOPs frontier, by FLOPs
    n_opt: PowerLaw
    d_opt: PowerLaw
    warnings: list[str] = field(default_factory=list)


def frontier(flops: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """Indices of the points whose loss is below that of every point with fewer FLOPs."""
    order = np.lexsort((loss, flops))
    best = np.minimum.accumulate(loss[order])
    first = np.concatenate([[True], best[1:] < best[:-1]])
    return order[first]


def fit_envelope(points: Runs, grid: int = 1500) -> EnvelopeFit:
    """Approach 1 over training-curve points (or, without curves, each run's final point). As in
    Hoffmann et al., ``grid`` log-spaced FLOP counts, each taking the (N, D) of the frontier point
    that holds the lowest loss up to it, so every stretch of FLOPs weighs the same in the fit.
    Stretches held by the smallest or the largest model trained are left out when other sizes
    remain: there the envelope is capped by the sizes trained, not set by the law."""
    front = frontier(points.flops, points.loss)
    sizes = np.unique(points.params[front])
    if len(sizes) < 2:
        raise InputError(f"{points.source}: Approach 1 (the envelope of training curves) found a single model "
                         f"size on the loss-vs-FLOPs frontier (N = {sizes[0]:.3g}); it needs runs of several sizes "
                         "whose curves cross (give fit.curves, or leave it out: fit.approaches=[2,3])")
    c_front = points.flops[front]
    counts = np.geomspace(c_front[0], c_front[-1], grid)
    holder, weight = np.unique(front[np.searchsorted(c_front, counts, side="right") - 1], return_counts=True)
    warnings = []
    edge = np.isin(points.params[holder], [points.params.min(), points.params.max()])
    if len(np.unique(points.params[holder[~edge]])) >= 2:
        holder, weight = holder[~edge], weight[~edge]
    else:
        warnings.append("Approach 1: the envelope is held by the smallest and largest models trained; "
                        "its exponents are capped by those sizes")
    inner = len(np.unique(points.params[holder]))
    if inner < 4:
        warnings.append(f"Approach 1: only {inner} model sizes on the envelope; its power laws rest on few runs")
    c = points.flops[holder]
    return EnvelopeFit(front.tolist(), fit_power_law(c, points.params[holder], weight),
                       fit_power_law(c, points.tokens[holder], weight), warnings)
