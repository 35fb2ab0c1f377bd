"""AdamW, Muon and LAMB on the demo's pre-training budget, side by side: each optimizer at each of
three peak learning rates, the same model, data, schedule, batch and steps (recipes/demo/pretrain.yaml),
one run after another (interleaved: each optimizer's first rate, then each one's second, ...) in its
own process on this machine. Validation loss at equal steps (the last evaluation) and at equal wall
time (each optimizer's best run, interpolated at the training time of the fastest of them), in one table and one plot.

    .venv/bin/python benchmarks/optimizers.py                # 9 runs of the demo's pre-training (~35 min, 2 CPU cores)
    .venv/bin/python benchmarks/optimizers.py --quick        # a smoke run: tiny model, 6 steps, one rate each (~1 min)
    .venv/bin/python scripts/write_benchmark_docs.py         # then the table of the JSON into the README and docs

It needs the demo's tokenizer and shards (`make demo`, or its tokenizer and prepare stages). Muon's
rate is that of the blocks' matrices (train.muon.lr); the parameters it leaves to AdamW keep the
recipe's train.lr. Training time is the sum of the steps' times (compiling included, evaluation
not), so the equal-time comparison charges each optimizer its own step cost; each run records the
machine's load average before and after it, since a busy machine slows whichever run it meets.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from record import header, load_average, machine_line, now, parse_training_args, replotted, write_result

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/demo/pretrain.yaml"
RESULTS = "benchmarks/results/optimizers.json"
PLOT = "docs/img/optimizers.png"
# each optimizer's key for its rate, and the three rates tried (the recipe's AdamW rate in the middle)
RATE_KEY = {"adamw": "train.lr", "muon": "train.muon.lr", "lamb": "train.lr"}
GRID = {"adamw": [1e-3, 2e-3, 4e-3], "muon": [0.01, 0.02, 0.04], "lamb": [3e-3, 1e-2, 3e-2]}
QUICK = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=128", "train.max_steps=6",
         "train.warmup_steps=1", "train.eval_every=3", "train.eval_batches=2", "train.compile=false",
         "train.precision=fp32"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def curve(records: list[dict]) -> list[dict]:
    """(step, training seconds so far, validation loss) at every evaluation of a run."""
    points, seconds = [], 0.0
    for r in records:
        seconds += r.get("step_s", 0.0)
        if "val_loss" in r:
            points.append({"step": r["step"], "train_s": round(seconds, 3), "val_loss": r["val_loss"]})
    return points


def loss_at_time(points: list[dict], t: float) -> float:
    """The validation loss of a run at training time ``t``, linear between its evaluations."""
    if t <= points[0]["train_s"]:
        return points[0]["val_loss"]
    for a, b in zip(points, points[1:]):
        if a["train_s"] <= t <= b["train_s"]:
            w = (t - a["train_s"]) / max(b["train_s"] - a["train_s"], 1e-9)
            return a["val_loss"] + w * (b["val_loss"] - a["val_loss"])
    return points[-1]["val_loss"]


def summarise(runs: list[dict]) -> dict:
    """Each optimizer's best rate (lowest final validation loss) and the equal-time comparison."""
    best = {}
    for run in runs:
        if run["optimizer"] not in best or run["final_val_loss"] < best[run["optimizer"]]["final_val_loss"]:
            best[run["optimizer"]] = run
    t = min(run["curve"][-1]["train_s"] for run in best.values())
    return {"equal_time_s": round(t, 3),
            "best": {name: {"lr": run["lr"], "final_val_loss": run["final_val_loss"], "train_s": run["curve"][-1]["train_s"],
                            "tokens_per_s": run["tokens_per_s"], "val_loss_at_equal_time": round(loss_at_time(run["curve"], t), 4)}
                     for name, run in best.items()}}


def draw_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"adamw": "tab:blue", "muon": "tab:orange", "lamb": "tab:green"}
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in result["runs"]:
        is_best = result["summary"]["best"][run["optimizer"]]["lr"] == run["lr"]
        style = dict(color=colors[run["optimizer"]], alpha=1.0 if is_best else 0.35, linewidth=2 if is_best else 1,
                     label=f"{run['optimizer']} lr {run['lr']:g}")
        by_step.plot([p["step"] for p in run["curve"]], [p["val_loss"] for p in run["curve"]], marker="o", ms=3, **style)
        if is_best:
            by_time.plot([p["train_s"] for p in run["curve"]], [p["val_loss"] for p in run["curve"]], marker="o", ms=3,
                         **style)
    by_time.axvline(result["summary"]["equal_time_s"], color="lightgray", linewidth=0.8)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training time (s)")
    for ax in (by_step, by_time):
        ax.set_ylabel("validation loss")
    by_step.set_title("every rate, by step")
    by_time.set_title("each optimizer's best rate, by wall time")
    by_step.legend(fontsize=7)
    fig.suptitle(f"{result['recipe']}, {result['steps']} steps\n{machine_line(result)}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train(optimizer: str, lr: float, run_dir: Path, args: argparse.Namespace) -> dict:
    overrides = [f"run_dir={run_dir}", f"train.optimizer={optimizer}", f"{RATE_KEY[optimizer]}={lr}",
                 "train.max_minutes=null", "train.checkpoint_every=0", "train.keep_checkpoints=1",
                 f"train.eval_every={args.eval_every}", "train.resume=never", "train.tensorboard=false",
                 *(QUICK if args.quick else []), *args.set]
    command = [sys.executable, "-m", "lmforge", "pretrain", args.recipe, *overrides]
    print(f"== {optimizer} lr {lr:g}: {' '.join(command[3:])}", flush=True)
    load_before = load_average()
    subprocess.run(command, cwd=REPO, check=True, stdout=None if args.verbose else subprocess.DEVNULL)
    records = read_metrics(run_dir)
    points = curve(records)
    tps = [r["tokens_per_s"] for r in records[1:] if "tokens_per_s" in r]
    run = {"optimizer": optimizer, "lr": lr, "run_dir": str(run_dir), "steps": records[-1]["step"], "curve": points,
           "final_val_loss": points[-1]["val_loss"],
           "load_average": [load_before, load_average()], "tokens_per_s": round(sorted(tps)[len(tps) // 2], 1) if tps else 0.0}
    print(f"   final validation loss {run['final_val_loss']:.4f} after {points[-1]['train_s']:.0f} s of training, "
          f"{run['tokens_per_s']:.0f} tokens/s", flush=True)
    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=RECIPE, help="the pre-training recipe every run shares")
    p.add_argument("--optimizers", nargs="+", default=list(GRID), choices=list(GRID))
    p.add_argument("--eval-every", type=int, default=25, help="steps between validations (the curves' points)")
    p.add_argument("--verbose", action="store_true", help="show each run's console")
    args = parse_training_args(p, "optimizers", RESULTS, PLOT, "a tiny model, 6 steps, the middle rate only", argv)
    if args.quick:
        args.eval_every = 3
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if replotted(args, draw_plot):
        return
    started = now()
    # interleaved (every optimizer's first rate, then every second rate, ...), so that a change in the
    # machine's load over the session falls on each optimizer alike
    rates = [(i, name, lr) for name in args.optimizers for i, lr in enumerate(GRID[name][1:2] if args.quick else GRID[name])]
    runs = [train(name, lr, args.runs / f"{name}-lr{lr:g}", args) for _, name, lr in sorted(rates, key=lambda r: r[0])]
    runs.sort(key=lambda r: (args.optimizers.index(r["optimizer"]), r["lr"]))
    steps = runs[0]["steps"]
    result = {**header("optimizers", "optimizers.py", argv, started),
              "recipe": args.recipe, "steps": steps, "overrides": args.set + (QUICK if args.quick else []),
              "figure": "validation loss at the last step and at equal training time, each optimizer at its best rate",
              "runs": runs, "summary": summarise(runs)}
    write_result(result, args.out)
    draw_plot(result, args.plot)
    for name, b in result["summary"]["best"].items():
        print(f"{name}: best rate {b['lr']:g}, validation loss {b['final_val_loss']:.4f} at the last step, "
              f"{b['val_loss_at_equal_time']:.4f} at {result['summary']['equal_time_s']:.0f} s of training")
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
