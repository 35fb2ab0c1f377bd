"""A mixture of experts against a dense model of equal active FLOPs, on the same tokens of the demo corpus.

``recipes/moe/pretrain.yaml``: 4 layers of width 128 on the µP sweep's 512-token shards of the bundled
prose. The MoE replaces each SwiGLU of 384 by 8 experts of 192, 2 per token: a token's expert matmuls are
the dense model's (plus the router's 8·128 per layer), so both spend the same FLOPs per token
(``ModelConfig.flops_per_token``, recorded) while the MoE holds 4x the FFN parameters. Three runs, one
after another in one process, each seeded alike and fed the same windows:

- ``dense``: the recipe with ``model.family: llama`` and no ``moe`` section;
- ``moe``: the recipe as it is, DeepSeek-V3's aux-loss-free bias balancing the experts (γ = 1e-3);
- ``moe_unbalanced``: the same without the bias (``model.moe.bias_update_rate: 0``), no balancing at all.

Recorded per run: the final validation loss, the median tokens/s after the first step, the peak memory the
loop logs, parameters (total and active) and FLOPs per token, and per step each MoE layer's largest and
smallest expert share and load entropy, which the figure (docs/img/moe.png) draws: the loss curves, and
the most loaded expert's share with and without the bias. Whichever model wins is reported as it is.

    .venv/bin/python benchmarks/moe.py                # ~10 min on 2 idle CPU cores
    .venv/bin/python benchmarks/moe.py --quick        # a smoke run: 4 steps
    .venv/bin/python scripts/write_benchmark_docs.py  # then the table of the JSON into docs/architectures.md

Tokens/s and memory depend on the machine and its load (recorded beside them); the losses and loads do not.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from record import header, load_average, machine_line, made_once, now, parse_training_args, replotted, write_result

from lmforge.core.config import load_config
from lmforge.core.untrusted import read_yaml
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/moe/pretrain.yaml"
TOKENIZER, PREPARE = "recipes/mup/tokenizer.yaml", "recipes/mup/prepare.yaml"
RESULTS = "benchmarks/results/moe.json"
PLOT = "docs/img/moe.png"
RUNS = {"dense": [], "moe": [], "moe_unbalanced": ["model.moe.bias_update_rate=0"]}
QUICK = ["train.max_steps=4", "train.warmup_steps=1", "train.eval_every=4", "train.eval_batches=2"]


def dense_recipe(path: Path) -> Path:
    """The recipe as the Llama family's, without its ``moe`` section, written beside the runs."""
    import yaml

    data = read_yaml(REPO / RECIPE)
    data["model"].pop("moe")
    data["model"]["family"] = "llama"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def train(name: str, recipe: Path, run_dir: Path, extra: list[str]) -> dict:
    print(f"== {name}", flush=True)
    loads_before = load_average()
    started = time.perf_counter()
    cfg = load_config(PretrainRecipe, recipe, [f"run_dir={run_dir}", "train.resume=never", *RUNS[name], *extra])
    run_pretrain(cfg)
    seconds = time.perf_counter() - started
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    counts = cfg.model.param_counts()
    layers = sorted({k.split("/")[1] for r in steps for k in r if k.startswith("moe/layer")})
    curve = [{"step": r["step"], "loss": r["loss"],
              **({"load_max": statistics.fmean(r[f"moe/{layer}/load_max"] for layer in layers),
                  "load_min": statistics.fmean(r[f"moe/{layer}/load_min"] for layer in layers),
                  "entropy": statistics.fmean(r[f"moe/{layer}/entropy"] for layer in layers)} if layers else {})}
             for r in steps]
    run = {"name": name, "steps": len(steps), "val_loss": evals[-1]["val_loss"] if evals else math.nan,
           "val_curve": [{"step": r["step"], "val_loss": r["val_loss"]} for r in evals],
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[1:]) if len(steps) > 1 else math.nan,
           "memory_bytes": max((r.get("memory_bytes") or 0) for r in steps) or None,
           "params": cfg.model.num_params(), "active_matmul_params": counts.matmul,
           "flops_per_token": cfg.model.flops_per_token(cfg.data.seq_len), "tokens": steps[-1]["tokens"],
           "seconds": round(seconds, 1), "load_average": [loads_before, load_average()], "curve": curve}
    if layers:
        last = steps[-1]
        run["final_load"] = {layer: {k: last[f"moe/{layer}/{k}"] for k in ("load_min", "load_max", "entropy", "dropped")}
                             for layer in layers}
    print(f"   validation loss {run['val_loss']:.4f}, {run['tokens_per_s']:.0f} tokens/s ({seconds:.0f} s)", flush=True)
    return run


def draw_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, load_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for run in result["runs"]:
        steps = [p["step"] for p in run["curve"]]
        loss_ax.plot(steps, [p["loss"] for p in run["curve"]], lw=0.8, alpha=0.6, label=f"{run['name']} (train)")
        if run["val_curve"]:
            loss_ax.plot([p["step"] for p in run["val_curve"]], [p["val_loss"] for p in run["val_curve"]], marker="o",
                         ms=4, label=f"{run['name']} (validation)")
        if "load_max" in run["curve"][0]:
            load_ax.plot(steps, [p["load_max"] for p in run["curve"]], label=f"{run['name']}: most loaded expert")
            load_ax.plot(steps, [p["load_min"] for p in run["curve"]], ls="--", label=f"{run['name']}: least loaded")
    experts = result["experts"]
    load_ax.axhline(1 / experts, color="grey", lw=0.8, ls=":", label=f"even: 1/{experts}")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss (nats/token)")
    loss_ax.legend(fontsize=7)
    load_ax.set_xlabel("step")
    load_ax.set_ylabel("expert share of assignments (layer mean)")
    load_ax.legend(fontsize=7)
    fig.suptitle(f"{result['recipe']}: dense vs MoE of equal active FLOPs, {result['steps']} steps\n"
                 f"{machine_line(result)}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parse_training_args(p, "moe", RESULTS, PLOT, "4 steps", argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if replotted(args, draw_plot):
        return
    extra = (QUICK if args.quick else []) + args.set
    made_once(TOKENIZER, PREPARE, extra)
    started = now()
    dense = dense_recipe(args.runs / "dense.yaml")
    runs = [train(name, dense if name == "dense" else REPO / RECIPE, args.runs / name, extra) for name in RUNS]
    by = {r["name"]: r for r in runs}
    moe_cfg = read_yaml(REPO / RECIPE)["model"]["moe"]
    summary = {"val_loss_moe_minus_dense": by["moe"]["val_loss"] - by["dense"]["val_loss"],
               "tokens_per_s_moe_over_dense": by["moe"]["tokens_per_s"] / by["dense"]["tokens_per_s"],
               "flops_moe_over_dense": by["moe"]["flops_per_token"] / by["dense"]["flops_per_token"],
               "winner": "moe" if by["moe"]["val_loss"] < by["dense"]["val_loss"] else "dense",
               "final_load_max": {name: statistics.fmean(x["load_max"] for x in by[name]["final_load"].values())
                                  for name in ("moe", "moe_unbalanced")}}
    result = {**header("moe", "moe.py", argv, started), "recipe": RECIPE, "steps": by["dense"]["steps"],
              "experts": moe_cfg["n_experts"], "top_k": moe_cfg["n_experts_per_token"], "overrides": extra,
              "figure": "training and validation loss per step, and the most and least loaded experts' shares",
              "runs": runs, "summary": summary}
    write_result(result, args.out)
    draw_plot(result, args.plot)
    print(f"MoE - dense validation loss {summary['val_loss_moe_minus_dense']:+.4f}; tokens/s ratio "
          f"{summary['tokens_per_s_moe_over_dense']:.2f}; most loaded expert at the end: {summary['final_load_max']}")
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
