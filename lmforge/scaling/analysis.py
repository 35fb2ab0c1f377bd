"""`lmforge scaling fit` as functions: the three approaches of Hoffmann et al. 2022 and Kaplan et
al.'s law over one set of runs, their agreement, the warnings a poorly constrained fit earns, and
the results as JSON + Markdown (+ PNGs from ``scaling.plots``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lmforge.core.config import ConfigError, at_least, in_range, option, positive, seed_field, unit_interval
from lmforge.scaling.isoflop import EnvelopeFit, IsoFlopFit, PowerLaw, fit_envelope, fit_isoflop
from lmforge.scaling.parametric import CHINCHILLA, KAPLAN, LawFit, constants_table, fit_law
from lmforge.scaling.runs import Runs


@dataclass
class FitSettings:
    """The `fit:` section of `lmforge scaling fit`."""

    runs: str | None = option(None, help="the runs CSV: run,params,tokens,flops,loss")
    curves: str | None = option(None, help="training curves CSV (run,step,params,tokens,flops,loss) for Approach 1")
    approaches: list[int] = in_range(low=1, high=3, default_factory=lambda: [1, 2, 3], help="Hoffmann et al.'s 1, 2, 3")
    bootstrap: int = at_least(0, 500, help="resamples for standard errors and intervals (Besiroglu et al.: 4000)")
    seed: int = seed_field(0, help="the seed of the bootstrap's resamples")
    level: float = unit_interval(0.95, low_open=True, high_open=True, help="of the percentile intervals")
    huber_delta: float = positive(1e-3, help="Hoffmann et al.'s δ")
    budget_tolerance: float = positive(0.05, help="decades of FLOPs that count as one IsoFLOP budget")
    agreement: float = positive(0.05, help="the approaches agree when their a are all within this")
    grid_stride: int = positive(1, help="every k-th value of each axis of the 4,500-start grid (1: all)")
    exclude_highest: int = at_least(0, 0, help="leave out the k highest losses (Besiroglu et al.: 5)")


@dataclass
class Analysis:
    runs: Runs
    settings: FitSettings
    chinchilla: LawFit | None = None
    kaplan: LawFit | None = None
    isoflop: IsoFlopFit | None = None
    envelope: EnvelopeFit | None = None
    warnings: list[str] = field(default_factory=list)


def poorly_constrained(fit: LawFit, table: dict, n_points: int) -> list[str]:
    """Why a parametric fit should not be trusted far: a parameter at its bound, a wide bootstrap
    spread, failed bootstrap refits, few points per parameter."""
    out = [f"{fit.form}: {note}" for note in fit.at_bound]
    for name in ("alpha", "beta", "alpha_N", "alpha_D"):
        if name in table and table[name]["se"] > 0.25 * abs(table[name]["estimate"]):
            out.append(f"{fit.form}: {name} = {table[name]['estimate']:.3g} has bootstrap SE {table[name]['se']:.2g} "
                       "(over 25%): the exponent is poorly constrained")
    for name in ("log_A", "log_B", "log_E", "log_Nc", "log_Dc"):
        if name in table and table[name]["se"] > 1.0:
            out.append(f"{fit.form}: {name} has bootstrap SE {table[name]['se']:.2g}: "
                       f"{name[4:]} is known only within a factor e^{table[name]['se']:.2g}")
    bad = int((~np.isfinite(fit.bootstrap).all(axis=1)).sum()) if len(fit.bootstrap) else 0
    if bad:
        out.append(f"{fit.form}: {bad} bootstrap refits failed")
    if n_points < 5 * len(fit.params):
        out.append(f"{fit.form}: {n_points} runs for {len(fit.params)} parameters (fewer than 5 per parameter)")
    return out


def exclude_highest(runs: Runs, k: int) -> Runs:
    """``runs`` without its ``k`` highest losses (and any tied with the k-th); some must remain."""
    if k >= len(runs):
        raise ConfigError(f"fit.exclude_highest = {k} leaves out all {len(runs)} runs of {runs.source}; set it "
                          f"below {len(runs)} (Besiroglu et al. leave out 5)")
    kept = runs.subset(runs.loss < np.sort(runs.loss)[-k])
    if not len(kept):
        raise ConfigError(f"fit.exclude_highest = {k}: every run of {runs.source} ties the {k}-th highest loss, so "
                          "none is left; lower it")
    return kept


def analyse(runs: Runs, curves: Runs | None, settings: FitSettings) -> Analysis:
    if settings.exclude_highest:
        runs = exclude_highest(runs, settings.exclude_highest)
    result = Analysis(runs, settings)
    # Approaches 2 and 1 first: they take milliseconds, and their errors (too few usable IsoFLOP
    # budgets, a single size on the envelope) should not wait for Approach 3's bootstrapped fits
    if 2 in settings.approaches:
        result.isoflop = fit_isoflop(runs, settings.budget_tolerance)
        result.warnings += result.isoflop.warnings
    if 1 in settings.approaches:
        result.envelope = fit_envelope(curves if curves is not None else runs)
        result.warnings += result.envelope.warnings
        if curves is None:
            result.warnings.append("Approach 1: no training curves given (fit.curves): the envelope is of the "
                                   "runs' final points only")
    if 3 in settings.approaches:
        kw = dict(bootstrap=settings.bootstrap, seed=settings.seed, delta=settings.huber_delta,
                  grid_stride=settings.grid_stride)
        result.chinchilla = fit_law(CHINCHILLA, runs, **kw)
        result.kaplan = fit_law(KAPLAN, runs, **kw)
        for fit in (result.chinchilla, result.kaplan):
            result.warnings += poorly_constrained(fit, constants_table(fit, settings.level), len(runs))
    result.warnings += agreement_warnings(result)
    return result


def exponents(result: Analysis) -> dict[str, dict]:
    """a (N_opt ∝ C^a) and b (D_opt ∝ C^b) of every approach run, with standard errors."""
    out = {}
    for name, fit in (("approach_1", result.envelope), ("approach_2", result.isoflop)):
        if fit is not None:
            out[name] = {"a": fit.n_opt.exponent, "a_se": fit.n_opt.se, "b": fit.d_opt.exponent, "b_se": fit.d_opt.se}
    if result.chinchilla is not None:
        t = constants_table(result.chinchilla, result.settings.level)
        out["approach_3"] = {"a": t["a"]["estimate"], "a_se": t["a"]["se"], "b": t["b"]["estimate"], "b_se": t["b"]["se"]}
    return out


def agreement_warnings(result: Analysis) -> list[str]:
    ex = exponents(result)
    names = list(ex)
    out = []
    for i, p in enumerate(names):
        for q in names[i + 1:]:
            gap = abs(ex[p]["a"] - ex[q]["a"])
            if gap > result.settings.agreement:
                out.append(f"the approaches disagree: a = {ex[p]['a']:.3f} ({p}) vs {ex[q]['a']:.3f} ({q}), "
                           f"apart by {gap:.3f} > {result.settings.agreement}")
    return out


def _law(p: PowerLaw) -> dict:
    return {"exponent": p.exponent, "se": p.se, "coefficient": p.coefficient, "points": p.n_points}


def summary(result: Analysis) -> dict:
    """Everything the fit found, as JSON (the input of `lmforge scaling plan`)."""
    s = result.settings
    r = result.runs
    out: dict = {"runs": r.source, "points": len(r), "level": s.level, "settings": dict(vars(s)),
                 "fitted_range": {k: {"low": float(v.min()), "high": float(v.max())}
                                  for k, v in (("params", r.params), ("tokens", r.tokens), ("flops", r.flops))}}
    for fit in (result.chinchilla, result.kaplan):
        if fit is not None:
            out[fit.form] = {"params": fit.params, "constants": constants_table(fit, s.level), "r2": fit.r2,
                             "rmse_log": fit.rmse_log, "huber_objective": fit.objective,
                             "bootstrap": fit.bootstrap.tolist()}
    if result.isoflop is not None:
        out["approach_2"] = {"n_opt": _law(result.isoflop.n_opt), "d_opt": _law(result.isoflop.d_opt),
                             "budgets": [{"flops": b.flops, "runs": len(b.runs), "n_opt": b.n_opt, "d_opt": b.d_opt,
                                          "loss_opt": b.loss_opt, "inside": b.inside} for b in result.isoflop.budgets]}
    if result.envelope is not None:
        out["approach_1"] = {"n_opt": _law(result.envelope.n_opt), "d_opt": _law(result.envelope.d_opt),
                             "frontier_points": len(result.envelope.frontier)}
    ex = exponents(result)
    gaps = [abs(ex[p]["a"] - ex[q]["a"]) for i, p in enumerate(ex) for q in list(ex)[i + 1:]]
    out["exponents"] = ex
    out["agree"] = bool(not gaps or max(gaps) <= s.agreement)
    out["warnings"] = result.warnings
    return out


def _fmt(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:.4g}"


def markdown(result: Analysis, s: dict) -> str:
    pct = f"{100 * result.settings.level:g}%"
    lines = [f"# Scaling-law fit of {s['runs']}", "", f"{s['points']} runs; bootstrap of "
             f"{result.settings.bootstrap} resamples; intervals are {pct} percentile intervals.", ""]
    for form, title in (("chinchilla", "Approach 3: L(N, D) = E + A/N^α + B/D^β (Hoffmann et al. 2022)"),
                        ("kaplan", "Kaplan et al. 2020: L(N, D) = [(N_c/N)^(α_N/α_D) + D_c/D]^α_D")):
        if form not in s:
            continue
        lines += [f"## {title}", "", f"R² = {s[form]['r2']:.4f}, RMSE of log-loss residuals = "
                  f"{s[form]['rmse_log']:.4f}", "", f"| constant | estimate | SE | {pct} interval |", "|---|---|---|---|"]
        for name, row in s[form]["constants"].items():
            lines.append(f"| {name} | {_fmt(row['estimate'])} | {_fmt(row['se'])} | "
                         f"[{_fmt(row['low'])}, {_fmt(row['high'])}] |")
        if form == "kaplan":
            k = {name: row["estimate"] for name, row in s[form]["constants"].items()}
            lines += ["", f"Its limits, Kaplan et al.'s L(N) = ({k['N_c']:.3g}/N)^{k['alpha_N']:.4f} and "
                      f"L(D) = ({k['D_c']:.3g}/D)^{k['alpha_D']:.4f}."]
        lines.append("")
    if s["exponents"]:
        lines += ["## N_opt ∝ C^a, D_opt ∝ C^b by approach", "", "| approach | a | SE | b | SE |", "|---|---|---|---|---|"]
        for name, e in s["exponents"].items():
            lines.append(f"| {name.replace('_', ' ')} | {e['a']:.4f} | {_fmt(e['a_se'])} | {e['b']:.4f} | {_fmt(e['b_se'])} |")
        lines += ["", f"Agreement (all a within {result.settings.agreement}): {'yes' if s['agree'] else 'NO'}", ""]
    if s["warnings"]:
        lines += ["## Warnings", ""] + [f"- {w}" for w in s["warnings"]] + [""]
    return "\n".join(lines)
