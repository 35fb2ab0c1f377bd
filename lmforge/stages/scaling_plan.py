"""`lmforge scaling plan` and `lmforge scaling flops` (the verb and its fit: ``stages.scaling``):
the two that read a pretrain recipe, as the plan's template and as the model flops counts. Its
classes import torch, so ``stages.scaling`` imports this module only when one of them runs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from lmforge.core.config import ConfigError, option, positive, save_config, unit_interval
from lmforge.core.io import InputError, atomic_write_json, atomic_write_text, read_json
from lmforge.core.run import log
from lmforge.distributed.memory import format_bytes
from lmforge.scaling import counts, planning
from lmforge.stages.plan import PlanRecipe, memory_plans
from lmforge.stages.pretrain import PretrainRecipe
from lmforge.stages.scaling import FitRecipe, check_outputs, json_safe
from lmforge.train.metrics import GPU_PEAKS


@dataclass
class BudgetOptions:
    flops: float | None = positive(None, help="training FLOPs; else from gpu x count x hours x mfu")
    gpu: str | None = option(None, help="a data-sheet GPU (H100, A100, ...) for its dense bf16 peak")
    peak_flops: float | None = positive(None, help="per device, instead of the gpu's data sheet")
    count: int = positive(1, help="devices")
    hours: float | None = positive(None, help="wall-clock hours of training, with gpu or peak_flops, count and mfu")
    mfu: float = unit_interval(0.4, low_open=True, help="model FLOPs utilization")


@dataclass
class PlanOptions:
    fit: str | None = option(None, help="a fit.json of `lmforge scaling fit`; None = out/fit.json")
    inference_tokens: float | None = positive(None, help="tokens the model will serve (Sardana et al. 2024)")
    unique_tokens: float | None = positive(None, help="unique training tokens available (Muennighoff et al. 2023)")
    params: Literal["non_embedding", "total"] = option("non_embedding", help="what the fit's N counted")
    aspect_ratio: float = positive(64.0, help="d_model / n_layers of the emitted model")


@dataclass
class ScalingRecipe(PlanRecipe, FitRecipe):
    """Every key of `lmforge scaling`: the fit's, and a pretrain recipe's with the budget and the plan."""

    what: Literal["fit", "plan", "flops"] = option(
        "fit", help="fit a runs CSV, plan a budget, or count a recipe's FLOPs"
    )
    budget: BudgetOptions = field(default_factory=BudgetOptions)
    plan: PlanOptions = field(default_factory=PlanOptions)
    tokens: float | None = positive(None, help="flops: training tokens; None = train.max_steps x tokens per step")


def datasheet_bf16(gpu: str) -> float:
    for key, peaks in GPU_PEAKS.items():
        if key.lower() == gpu.strip().lower():
            return peaks["bfloat16"]
    raise ConfigError(f"budget.gpu = {gpu!r} is not in the data-sheet table; choose one of {', '.join(GPU_PEAKS)} "
                      "or give budget.peak_flops")


def device_peak(b: BudgetOptions) -> float | None:
    if b.peak_flops is not None:
        return b.peak_flops
    return datasheet_bf16(b.gpu) if b.gpu else None


def budget_of(b: BudgetOptions) -> tuple[float, str]:
    if b.flops is not None:
        return b.flops, f"{b.flops:.3g} FLOPs"
    peak = device_peak(b)
    if peak is None or b.hours is None:
        raise ConfigError("scaling plan needs a budget: budget.flops=1e21, or budget.gpu=H100 (or budget.peak_flops) "
                          "with budget.count, budget.hours and budget.mfu")
    c = counts.budget_flops(peak, b.count, b.hours, b.mfu)
    if not math.isfinite(c):
        raise ConfigError(f"budget: {b.count} devices x {peak:.3g} FLOP/s x {b.hours:g} h x MFU {b.mfu:g} is not a "
                          "finite number of FLOPs; lower budget.peak_flops, budget.count or budget.hours")
    return c, f"{b.count} x {b.gpu or 'device'} ({peak / 1e12:.0f} TFLOP/s bf16) x {b.hours:g} h x MFU {b.mfu:g} = {c:.3g} FLOPs"


def read_fit(path: Path) -> tuple[np.ndarray, np.ndarray, float, tuple[float, float] | None]:
    """The Approach-3 law of a fit.json (raw parameters, bootstrap rows, interval level) and the
    FLOPs of the runs it was fitted to, (low, high) (None in a fit.json that predates it)."""
    if not path.is_file():
        raise InputError(f"{path}: not found; run `lmforge scaling fit` first (or set plan.fit to a fit.json it wrote)")
    fit = read_json(path)
    if not isinstance(fit, dict) or "chinchilla" not in fit:
        raise InputError(f"{path}: has no Approach-3 fit (key 'chinchilla'); rerun `lmforge scaling fit` with 3 in "
                         "fit.approaches")
    names = ("log_A", "log_B", "log_E", "alpha", "beta")
    try:
        x = np.array([float(fit["chinchilla"]["params"][k]) for k in names])
        samples = np.array(fit["chinchilla"].get("bootstrap") or [], dtype=float).reshape(-1, 5)
        level = float(fit.get("level", 0.95))
        fitted = fit.get("fitted_range")
        compute = None if fitted is None else (float(fitted["flops"]["low"]), float(fitted["flops"]["high"]))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path}: not a fit.json of `lmforge scaling fit` (chinchilla.params needs "
                         f"{', '.join(names)}, chinchilla.bootstrap rows of 5 numbers; {type(exc).__name__}: {exc}); "
                         "rerun the fit") from None
    if not (np.isfinite(x).all() and 0 < level < 1):
        raise InputError(f"{path}: chinchilla.params {dict(zip(names, x.tolist()))} or level {level} is not a usable "
                         "law (non-finite, or a level outside (0, 1)); rerun the fit")
    return x, samples[np.isfinite(samples).all(axis=1)], level, compute


def pretrain_recipe(recipe: ScalingRecipe, n: float, d: float, hyper: dict):
    """The template pretrain recipe with a model of ~``n`` parameters, DeepSeek's batch and lr,
    and max_steps covering ``d`` tokens."""
    model = counts.shape_for_params(n, recipe.model, aspect_ratio=recipe.plan.aspect_ratio, which=recipe.plan.params)
    model.max_seq_len = max(model.max_seq_len, recipe.data.seq_len)
    per_micro = recipe.train.micro_batch_size * recipe.data.seq_len
    batch = max(1, round(hyper["batch_tokens"] / per_micro)) * per_micro
    steps = max(1, math.ceil(d / batch))
    train = dataclasses.replace(recipe.train, lr=hyper["lr"], batch_tokens=batch, max_steps=steps,
                                warmup_steps=min(recipe.train.warmup_steps, steps))
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(PretrainRecipe)}
    return PretrainRecipe(**{**fields, "model": model, "train": train})


def budget_key(b: BudgetOptions) -> str:
    return "budget.flops" if b.flops is not None else "budget (peak x count x hours x mfu)"


def extrapolation_warning(flops: float, fitted: tuple[float, float] | None, key: str, fit_path: Path) -> str | None:
    """A warning when the budget lies more than ``planning.FAR_FACTOR`` beyond the compute of the
    runs the law was fitted to: a power law's error grows with every decade it is extrapolated."""
    if fitted is None:
        return None
    low, high = fitted
    far = math.log10(planning.FAR_FACTOR)
    above, below = math.log10(flops) - math.log10(high), math.log10(low) - math.log10(flops)
    if above > far:
        return (f"{key} = {flops:.3g} FLOPs is {above:.1f} decades above the largest compute in the fit "
                f"({high:.3g} FLOPs, {fit_path}): the law is extrapolated that far beyond its runs; treat the plan "
                "as a guess, or fit runs nearer the budget")
    if below > far:
        return (f"{key} = {flops:.3g} FLOPs is {below:.1f} decades below the smallest compute in the fit "
                f"({low:.3g} FLOPs, {fit_path}): the law is extrapolated that far below its runs")
    return None


def check_buildable(plan: dict, name: str, key: str) -> None:
    """Refuse a plan no recipe can hold: N or D not finite, under one parameter or token, or past
    ``counts.MAX_PLAN_PARAMS`` / ``MAX_PLAN_TOKENS``."""
    n, d = plan["params"], plan["tokens"]
    if not (math.isfinite(n) and math.isfinite(d)):
        raise ConfigError(f"{key}: the {name} plan has N = {n:.3g} parameters and D = {d:.3g} tokens, not finite "
                          "numbers; lower the budget (or check the fit)")
    if n < 1 or d < 1:
        raise ConfigError(f"{key}: the {name} plan has N = {n:.3g} parameters and D = {d:.3g} tokens, under one "
                          "parameter or token: no model trains on that; raise the budget")
    if n > counts.MAX_PLAN_PARAMS or d > counts.MAX_PLAN_TOKENS:
        raise ConfigError(f"{key}: the {name} plan has N = {n:.3g} parameters and D = {d:.3g} tokens, beyond the "
                          f"{counts.MAX_PLAN_PARAMS:.0e} parameters and {counts.MAX_PLAN_TOKENS:.0e} tokens a recipe is "
                          "written for; lower the budget")


def run_plan(recipe: ScalingRecipe) -> dict:
    out = check_outputs(recipe.out, ["pretrain.yaml", "plan.json", "plan.md"])
    fit_path = Path(recipe.plan.fit) if recipe.plan.fit else out / "fit.json"
    x, samples, level, fitted = read_fit(fit_path)
    flops, how = budget_of(recipe.budget)
    key = budget_key(recipe.budget)
    if flops > counts.MAX_PLAN_FLOPS:
        raise ConfigError(f"{key} = {flops:.3g} FLOPs is beyond the {counts.MAX_PLAN_FLOPS:.0e} a plan is made for "
                          "(the largest runs trained so far spent about 1e26); lower the budget")
    for name in ("inference_tokens", "unique_tokens"):
        value = getattr(recipe.plan, name)
        if value is not None and value > counts.MAX_PLAN_FLOPS:
            raise ConfigError(f"plan.{name} = {value:.3g} is beyond the {counts.MAX_PLAN_FLOPS:.0e} tokens a plan "
                              "is made for; give a realistic count of tokens")
    warnings = [w for w in [extrapolation_warning(flops, fitted, key, fit_path)] if w]
    for warning in warnings:
        log.warning("scaling plan: %s", warning)
    opt = planning.optimal_allocation(x, samples, flops, level)
    hyper = planning.deepseek_hyperparameters(flops)
    result = {"fit": str(fit_path), "budget_flops": flops, "budget": how, "level": level, "bootstrap_samples": len(samples),
              "compute_optimal": {"params": opt.params, "tokens": opt.tokens, "loss": opt.loss,
                                  "tokens_per_param": opt.tokens_per_param, "params_range": opt.params_range,
                                  "tokens_range": opt.tokens_range},
              "hyperparameters": {**hyper, "rule": "DeepSeek LLM 2024: B = 0.2920 C^0.3271 tokens, "
                                  "lr = 0.3118 C^-0.1250"}}
    if recipe.plan.inference_tokens is not None:
        result["overtrained"] = planning.overtrained_plan(x, samples, flops, recipe.plan.inference_tokens, level)
    if recipe.plan.unique_tokens is not None:
        result["data_constrained"] = planning.data_constrained_plan(x, samples, flops, recipe.plan.unique_tokens,
                                                                    level)
    follows = next(k for k in ("data_constrained", "overtrained", "compute_optimal") if k in result)
    check_buildable(result[follows], follows.replace("_", "-"), f"{key} = {flops:.3g} FLOPs")
    result["warnings"] = warnings
    pretrain = pretrain_recipe(recipe, result[follows]["params"], result[follows]["tokens"], hyper)
    shape = counts.count_parameters(pretrain.model)
    result["recipe"] = {"path": str(out / "pretrain.yaml"), "follows": follows, "d_model": pretrain.model.d_model,
                        "n_layers": pretrain.model.n_layers, "n_heads": pretrain.model.n_heads,
                        "params": dataclasses.asdict(shape), "batch_tokens": pretrain.train.batch_tokens,
                        "max_steps": pretrain.train.max_steps, "lr": pretrain.train.lr}
    save_config(pretrain, out, "pretrain.yaml")
    atomic_write_json(out / "plan.json", json_safe(result))
    text = plan_markdown(result)
    atomic_write_text(out / "plan.md", text)
    print(text)
    return result


def _range(r: dict) -> str:
    return f"[{r['low']:.3g}, {r['high']:.3g}]" if math.isfinite(r["low"]) else "(no bootstrap)"


def plan_markdown(r: dict) -> str:
    pct = f"{100 * r['level']:g}%"
    o = r["compute_optimal"]
    lines = ["# Scaling plan", "", f"Budget: {r['budget']}; law: {r['fit']} ({r['bootstrap_samples']} bootstrap samples, "
             f"{pct} intervals).", "", "| plan | N | D | D/N | loss |", "|---|---|---|---|---|",
             f"| compute-optimal | {o['params']:.3g} {_range(o['params_range'])} | {o['tokens']:.3g} "
             f"{_range(o['tokens_range'])} | {o['tokens_per_param']:.1f} | {o['loss']:.4f} |"]
    if "overtrained" in r:
        v = r["overtrained"]
        lines.append(f"| over-trained for {v['inference_tokens']:.3g} inference tokens | {v['params']:.3g} "
                     f"{_range(v['params_range'])} | {v['tokens']:.3g} {_range(v['tokens_range'])} | "
                     f"{v['tokens_per_param']:.1f} | {v['loss']:.4f} |")
    if "data_constrained" in r:
        v = r["data_constrained"]
        lines.append(f"| {v['unique_tokens']:.3g} unique tokens ({v['epochs']:.1f} epochs) | {v['params']:.3g} "
                     f"{_range(v['params_range'])} | {v['tokens']:.3g} {_range(v['tokens_range'])} | "
                     f"{v['tokens'] / v['params']:.1f} | {v['loss']:.4f} |")
    lines.append("")
    if "overtrained" in r:
        v = r["overtrained"]
        lines.append(f"Over-training (Sardana et al. 2024) saves {100 * v['saving']:.1f}% of training + inference "
                     f"FLOPs ({v['total_flops']:.3g} vs {v['compute_optimal_total_flops']:.3g}).")
    if "data_constrained" in r:
        v = r["data_constrained"]
        lines.append(f"Repeating data (Muennighoff et al. 2023, R_D* = {v['r_d_star']:.4g}, R_N* = {v['r_n_star']:.4g}): "
                     f"loss {v['loss']:.4f}; the compute-optimal plan would repeat {v['compute_optimal_epochs']:.1f} "
                     f"epochs for {v['compute_optimal_loss_with_repeats']:.4f} (unique data: {v['unconstrained_loss']:.4f}).")
    h, m = r["hyperparameters"], r["recipe"]
    lines += [f"Batch {h['batch_tokens']:.3g} tokens, learning rate {h['lr']:.3g} ({h['rule']}).", "",
              f"Recipe {m['path']} (the {m['follows'].replace('_', '-')} plan): d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads: "
              f"{m['params']['non_embedding']:.4g} non-embedding ({m['params']['total']:.4g} total) parameters, "
              f"{m['max_steps']} steps of {m['batch_tokens']} tokens at lr {m['lr']:.3g}.", ""]
    if r.get("warnings"):
        lines += ["## Warnings", ""] + [f"- {w}" for w in r["warnings"]] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- flops

def run_flops(recipe: ScalingRecipe) -> dict:
    out = check_outputs(recipe.out, ["flops.json"])
    model, seq = recipe.model, recipe.data.seq_len
    params = counts.count_parameters(model)
    per_token = counts.flops_per_token(model, seq)
    step_tokens = recipe.train.batch_tokens or recipe.train.micro_batch_size * seq
    tokens = recipe.tokens or recipe.train.max_steps * step_tokens
    layout, plans = memory_plans(recipe)
    result = {"params": dataclasses.asdict(params), "flops_per_token": dataclasses.asdict(per_token), "seq_len": seq,
              "tokens": tokens, "training_flops": per_token.total * tokens, "training_flops_6nd": per_token.six_n * tokens,
              "memory": {"layout": layout, **{("with_ac" if ac else "without_ac"): {**dataclasses.asdict(p),
                                                                                   "total": p.total}
                                              for ac, p in plans.items()}}}
    peak = device_peak(recipe.budget)
    lines = [f"parameters: {params.total:,} total ({params.active:,} active), {params.embedding:,} embedding, "
             f"{params.head:,} output head, {params.non_embedding:,} non-embedding",
             f"FLOPs per token (seq {seq}): {per_token.total:.4g} = {per_token.dense:.4g} dense (6 x matmul weights) + "
             f"{per_token.attention:.4g} attention; 6N (non-embedding) = {per_token.six_n:.4g}",
             f"training: {tokens:.4g} tokens, {result['training_flops']:.4g} FLOPs ({result['training_flops_6nd']:.4g} "
             "by 6ND)",
             f"memory per device ({layout}): {format_bytes(plans[False].total)}, "
             f"{format_bytes(plans[True].total)} with activation checkpointing (`lmforge plan memory` for the table)"]
    if peak is not None:
        devices = recipe.budget.count
        seconds = counts.training_seconds(result["training_flops"], peak, devices, recipe.budget.mfu)
        result["training_hours"] = seconds / 3600
        result["devices"] = devices
        lines.append(f"time at MFU {recipe.budget.mfu:g} on {devices} x {peak / 1e12:.0f} TFLOP/s: {seconds / 3600:.3g} h")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "flops.json", json_safe(result))
    print("\n".join(lines))
    return result
