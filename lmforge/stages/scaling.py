"""Scaling laws. `lmforge scaling fit RUNS.csv` fits Hoffmann et al. 2022's three approaches
(1: the envelope of training curves, 2: IsoFLOP parabolas, 3: the parametric L(N, D) = E +
A/N^α + B/D^β by Huber loss on log-loss and L-BFGS from a grid, bootstrapped) and Kaplan et al.
2020's L(N, D), and writes fit.json, fit.md and PNGs into `out`. The CSV has one row per run:
run,params,tokens,flops,loss (params: non-embedding N; flops may be empty, then C = 6·N·D);
fit.curves=CURVES.csv (run,step,params,tokens,flops,loss) gives Approach 1 its curves.

`lmforge scaling plan [RECIPE.yaml]` reads `out`/fit.json and, for a budget (budget.flops, or
budget.gpu, budget.count, budget.hours and budget.mfu through the data-sheet dense bf16 peak:
NVIDIA's H100/H200/B200/A100/L40S/L4/A10G and RTX 4090 data sheets, `lmforge.train.metrics`),
gives the compute-optimal N and D with bootstrap intervals, the over-trained plan when
plan.inference_tokens is given (Sardana et al. 2024), the data-constrained plan when
plan.unique_tokens is given (Muennighoff et al. 2023), DeepSeek LLM's batch size and learning
rate, and writes `out`/pretrain.yaml: the pretrain recipe (RECIPE.yaml as the template) with a
model of about N parameters, for the data-constrained plan if there is one, else the over-trained
one if there is one, else the compute-optimal one. A budget over 100x beyond (or below) the compute
of the fitted runs is warned about, saying how many decades; a plan no recipe can hold (N over
1e15 parameters, D over 1e18 tokens, under one of either, not finite) is refused naming the key.

`lmforge scaling flops RECIPE.yaml` counts a pretrain recipe's parameters, FLOPs per token,
memory per device (as `lmforge plan memory`) and its training time at budget.mfu.

  lmforge scaling fit runs.csv out=runs/scaling fit.bootstrap=1000
  lmforge scaling plan recipes/demo/pretrain.yaml out=runs/scaling budget.gpu=H100 budget.count=8 budget.hours=24
  lmforge scaling flops recipes/demo/pretrain.yaml budget.gpu=H100 budget.mfu=0.4
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from lmforge.core.config import ConfigError, load_config, option
from lmforge.core.io import InputError, atomic_write_json, atomic_write_text, check_output_dir, check_output_file
from lmforge.scaling.analysis import FitSettings, analyse, markdown, summary
from lmforge.scaling.plots import write_plots
from lmforge.scaling.runs import read_runs

if TYPE_CHECKING:
    from lmforge.stages.scaling_plan import ScalingRecipe

# `plan` and `flops` read a pretrain recipe, whose classes import torch and the training code; they
# live in ``stages.scaling_plan``, imported only when one of them runs: a fit needs neither


@dataclass
class FitRecipe:
    """`lmforge scaling fit`'s keys: a fit reads a CSV, not a model, so it has no pretrain keys."""

    what: Literal["fit"] = option("fit", help="what `lmforge scaling` does (plan and flops: `ScalingRecipe`)")
    out: str = option("runs/scaling", help="fit.json, fit.md, *.png; plan.json, plan.md, pretrain.yaml; flops.json")
    fit: FitSettings = field(default_factory=FitSettings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["fit", "plan", "flops"], help="fit a runs CSV, plan a budget, or count a recipe")
    parser.add_argument("path", nargs="?", help="fit: the runs CSV; plan, flops: a pretrain recipe (YAML)")


def recipe_from_args(args: argparse.Namespace) -> FitRecipe | ScalingRecipe:
    path, overrides = args.path, list(args.overrides)
    if path is not None and "=" in path and not path.endswith((".yaml", ".yml", ".csv")):
        path, overrides = None, [path, *overrides]
    if args.what == "fit":
        given = [f"fit.runs={path}"] if path else []
        return load_config(FitRecipe, None, [*given, *overrides], overrides_label="command-line override")
    from lmforge.stages.scaling_plan import ScalingRecipe

    return load_config(ScalingRecipe, path, [f"what={args.what}", *overrides], overrides_label="command-line override")


# --------------------------------------------------------------------------- fit

def json_safe(value):
    """``value`` with NaN and infinities (an SE without bootstrap samples) as null: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def check_outputs(out: str, names: list[str]) -> Path:
    """``out`` when it and each of ``names`` in it can be written: checked before any work."""
    folder = check_output_dir(out, "out")
    for name in names:
        check_output_file(folder / name, f"out ({name})")
    return folder


def run_fit(recipe: FitRecipe) -> dict:
    opts = recipe.fit
    if opts.runs is None:
        raise ConfigError("scaling fit needs the runs CSV: `lmforge scaling fit runs.csv` (or fit.runs=...)")
    if not opts.approaches:
        raise ConfigError("fit.approaches is empty: choose among 1, 2 and 3")
    out = check_outputs(recipe.out, ["fit.json", "fit.md"])
    runs = read_runs(opts.runs)
    curves = read_runs(opts.curves, curves=True) if opts.curves else None
    try:
        result = analyse(runs, curves, opts)
    except (OverflowError, FloatingPointError, ZeroDivisionError, np.linalg.LinAlgError) as exc:
        raise InputError(f"{opts.runs}: the fit failed on these runs' values ({exc}); check the rows for "
                         "outliers (a size or loss far from the others)") from exc
    out.mkdir(parents=True, exist_ok=True)
    s = summary(result)
    s["plots"] = write_plots(result, out)
    atomic_write_json(out / "fit.json", json_safe(s))
    text = markdown(result, s)
    atomic_write_text(out / "fit.md", text)
    print(text)
    return s


def run(recipe: FitRecipe | ScalingRecipe) -> dict:
    if recipe.what == "fit":
        return run_fit(recipe)
    from lmforge.stages import scaling_plan

    return {"plan": scaling_plan.run_plan, "flops": scaling_plan.run_flops}[recipe.what](recipe)


def __getattr__(name: str):
    """``RECIPE`` (every key of the three, for ``--help``, the docs and `lmforge run`), loaded on
    first use: it is a pretrain recipe too, and so imports torch."""
    if name == "RECIPE":
        from lmforge.stages.scaling_plan import ScalingRecipe

        return ScalingRecipe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
