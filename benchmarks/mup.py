"""µTransfer on the demo corpus: does the best learning rate at width 64 stay the best at 256?

Sweeps AdamW's peak rate over a grid (factors of 2) at widths 64, 128 and 256 under the standard
parameterisation (SP) and under µP relative to width 64 (``model.mup.base_width: 64``), each run
``recipes/mup/pretrain.yaml`` (2 layers, 32-wide heads added with width, an MLP 3x as wide, 200
steps of 4096 tokens, a 512-token vocabulary of the bundled prose), and records the validation
loss at the last step. At the base width µP is the standard model, so width 64 is trained once
and serves both. Yang et al. 2021 (Tensor Programs
V) find SP's best rate moving as the model widens and µP's staying put; the JSON says, for this
corpus and budget, whether µP's best rate at 256 is within one grid step of its best at 64.

    .venv/bin/python benchmarks/mup.py                # 25 runs in one process (~30 min on 2 CPU cores)
    .venv/bin/python benchmarks/mup.py --quick        # a smoke run: widths 32 and 64, 2 rates, 4 steps
    .venv/bin/python scripts/write_benchmark_docs.py  # then the table of the JSON into the README and docs

It trains the tokenizer and shards of recipes/mup/tokenizer.yaml and prepare.yaml first, where
they are missing (about 10 s). The losses do not depend on the machine's load (each run is
seeded), only the time it takes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from record import header, machine_line, made_once, now, parse_training_args, replotted, write_result

from lmforge.core.config import load_config
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/mup/pretrain.yaml"
TOKENIZER, PREPARE = "recipes/mup/tokenizer.yaml", "recipes/mup/prepare.yaml"  # the sweep's vocabulary of 512 and shards
RESULTS = "benchmarks/results/mup.json"
PLOT = "docs/img/mup.png"
WIDTHS, BASE, HEAD_DIM = (64, 128, 256), 64, 32
RATES = [2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2]
QUICK = dict(widths=(32, 64), base=32, rates=[2e-3, 8e-3],
             set=["train.max_steps=4", "train.warmup_steps=1", "train.eval_every=4", "train.eval_batches=2"])


def shape(width: int) -> list[str]:
    return [f"model.d_model={width}", f"model.n_heads={max(1, width // HEAD_DIM)}", f"model.ffn_hidden={3 * width}"]


def train(param: str, width: int, base: int, lr: float, run_dir: Path, extra: list[str]) -> dict:
    mup = f"model.mup.base_width={base}" if param == "mup" else "model.mup.base_width=null"
    overrides = [f"run_dir={run_dir}", *shape(width), mup, f"train.lr={lr}", "train.resume=never", *extra]
    print(f"== {param} width {width} lr {lr:g}", flush=True)
    started = time.perf_counter()
    run_pretrain(load_config(PretrainRecipe, REPO / RECIPE, overrides))
    evals = [r for r in read_metrics(run_dir) if "val_loss" in r]
    loss = evals[-1]["val_loss"] if evals else math.nan
    print(f"   validation loss {loss:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
    return {"param": param, "width": width, "lr": lr, "val_loss": loss, "step": evals[-1]["step"] if evals else None,
            "seconds": round(time.perf_counter() - started, 1)}


def best_rates(runs: list[dict]) -> dict[str, dict[int, float]]:
    """(param -> width -> the rate of the lowest validation loss)."""
    best: dict[str, dict[int, dict]] = {}
    for run in runs:
        if math.isfinite(run["val_loss"]):
            slot = best.setdefault(run["param"], {})
            if run["width"] not in slot or run["val_loss"] < slot[run["width"]]["val_loss"]:
                slot[run["width"]] = run
    return {param: {w: r["lr"] for w, r in sorted(by.items())} for param, by in best.items()}


def summarise(runs: list[dict], rates: list[float]) -> dict:
    best = best_rates(runs)
    steps = {}
    for param, by_width in best.items():
        narrow, wide = min(by_width), max(by_width)
        steps[param] = rates.index(by_width[wide]) - rates.index(by_width[narrow])  # grid steps the best rate moved
    return {"best_lr": {p: {str(w): lr for w, lr in by.items()} for p, by in best.items()},
            "grid_steps_moved": steps, "mup_transfers": abs(steps.get("mup", 99)) <= 1}


def draw_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, param, title in zip(axes, ("sp", "mup"), ("standard parameterisation", f"µP (base width {result['base_width']})")):
        for width in result["widths"]:
            points = sorted((r["lr"], r["val_loss"]) for r in result["runs"] if r["param"] == param and r["width"] == width
                            and math.isfinite(r["val_loss"]))
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=4, label=f"width {width}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["rates"], [f"{lr:g}" for lr in result["rates"]])
        ax.set_xlabel("AdamW peak learning rate")
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("validation loss")
    fig.suptitle(f"{result['recipe']}, {result['steps']} steps\n{machine_line(result)}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parse_training_args(p, "mup", RESULTS, PLOT, "widths 32 and 64 (base 32), 2 rates, 4 steps", argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if replotted(args, draw_plot):
        return
    widths, base, rates = (QUICK["widths"], QUICK["base"], QUICK["rates"]) if args.quick else (WIDTHS, BASE, RATES)
    extra = (QUICK["set"] if args.quick else []) + args.set
    made_once(TOKENIZER, PREPARE, extra)
    started, runs = now(), []
    for lr in rates:
        for width in widths:
            params = ("sp",) if width == base else ("sp", "mup")  # at the base width µP is SP, bit for bit
            for param in params:
                runs.append(train(param, width, base, lr, args.runs / f"{param}-w{width}-lr{lr:g}", extra))
                if width == base:
                    runs.append({**runs[-1], "param": "mup", "same_as": "sp"})
    result = {**header("mup", "mup.py", argv, started), "recipe": RECIPE, "steps": next(r["step"] for r in runs),
              "widths": list(widths), "base_width": base, "rates": rates, "overrides": extra,
              "figure": "validation loss against AdamW's peak rate per width, SP and µP", "runs": runs,
              "summary": summarise(runs, rates)}
    write_result(result, args.out)
    draw_plot(result, args.plot)
    for param, by_width in result["summary"]["best_lr"].items():
        print(f"{param}: best rate by width {by_width}; {result['summary']['grid_steps_moved'][param]:+d} grid steps "
              f"from width {min(result['widths'])} to {max(result['widths'])}")
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
