"""The utility cost of privacy, measured: the demo's SFT (``recipes/demo/sft.yaml`` from ``make
demo``'s pre-trained model) trained with DP-SGD at ε = 1, 3 and 8, and without it (ε = ∞), on
the same budget: the same steps, learning rate, LoRA adapters and (expected) batch of rows.

    python benchmarks/dp.py                    # results/dp.json (needs make demo's runs/demo/pretrain)
    python benchmarks/dp.py --steps 2 ...      # a smoke run (tests/test_benchmarks.py)

Every run trains unpacked rows (``data.packing=false``: DP-SGD clips each example's gradient, so
a row must be one example), padded to ``data.max_length`` (96: the demo's longest example is 95
tokens), so the non-private run differs from the private ones only by its step: the plain
mean-per-token gradient of a fixed batch, against Poisson-sampled examples' gradients clipped to
``dp.max_grad_norm`` with Gaussian noise of σ chosen by the RDP accountant for the ε at ``dp.delta``
over the planned steps. Recorded per ε: σ, the ε the accountant reports spent, validation loss
(nats per assistant token) and held-out exact match after training (before: the base's, the same
for each), and the run's tokens/s (padded rows, as the loop counts them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

EPSILONS = ("1", "3", "8", "inf")
RESULTS = "benchmarks/results/dp.json"


def run_one(args: argparse.Namespace, epsilon: str) -> dict:
    from lmforge.core.config import load_config
    from lmforge.stages.sft import SFTRecipe, run_sft

    private = epsilon != "inf"
    dp = [f"dp={{epsilon: {epsilon}, delta: {args.delta}, max_grad_norm: {args.max_grad_norm}}}"] if private else []
    recipe = load_config(SFTRecipe, Path(args.recipe), [
        f"checkpoint={args.base}", f"run_dir={Path(args.runs) / f'eps-{epsilon}'}", "data.packing=false",
        f"data.max_length={args.max_length}", f"lora={{r: {args.r}, alpha: {2 * args.r}}}", f"train.lr={args.lr}",
        f"train.max_steps={args.steps}", f"train.warmup_steps={min(10, args.steps // 10)}",
        f"train.micro_batch_size={args.batch}", f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}",
        "train.resume=never", f"score.max_examples={args.examples}", *dp, *args.set])
    summary = run_sft(recipe)
    before, after = summary["before"], summary["after"]
    spent = summary.get("dp", {})
    row = {"epsilon": float(epsilon) if private else None, "noise_multiplier": spent.get("noise_multiplier"),
           "epsilon_spent": spent.get("epsilon"), "sample_rate": spent.get("sample_rate"),
           "val_loss_before": before.get("val_loss"), "val_loss_after": after.get("val_loss"),
           "exact_match_before": before.get("exact_match", {}).get("exact_match"),
           "exact_match_after": after.get("exact_match", {}).get("exact_match"),
           "examples_scored": after.get("exact_match", {}).get("examples"),
           "tokens_per_s": round(summary["tokens_per_s"], 1), "steps": summary["step"],
           "train_examples": summary["train_examples"], "wall_s": round(summary["wall_s"], 1)}
    sigma = "-" if row["noise_multiplier"] is None else f"{row['noise_multiplier']:.3f}"
    print(f"ε={epsilon:<4} σ={sigma:<6} val {row['val_loss_after']:.4f}  exact {row['exact_match_after']}"
          f"  {row['tokens_per_s']:.0f} tok/s", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="runs/demo/pretrain", help="the model fine-tuned (make demo's)")
    p.add_argument("--recipe", default="recipes/demo/sft.yaml", help="the SFT recipe")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of every run")
    p.add_argument("--batch", type=int, default=8, help="rows per step (DP: the expected size of a Poisson sample)")
    p.add_argument("--lr", type=float, default=3e-3, help="the learning rate of every run (the demo's LoRA rate)")
    p.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r)")
    p.add_argument("--max-length", type=int, default=96, help="data.max_length: rows padded to it")
    p.add_argument("--delta", type=float, default=1e-4, help="dp.delta (below 1/N: the demo has N = 641)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="dp.max_grad_norm, C")
    p.add_argument("--examples", type=int, default=70, help="held-out tasks scored for exact match")
    p.add_argument("--epsilons", nargs="*", default=list(EPSILONS), choices=EPSILONS, help="the rows to run")
    p.add_argument("--runs", default="runs/dp", help="where the runs write")
    p.add_argument("--set", nargs="*", default=[], help="more dotted overrides of every run")
    p.add_argument("--out", default=RESULTS, help="the results JSON")
    args = p.parse_args(argv)

    from record import header, now, write_result

    started = now()
    rows = [run_one(args, e) for e in args.epsilons]
    config = {k: getattr(args, k) for k in ("base", "recipe", "steps", "batch", "lr", "r", "max_length", "delta",
                                            "max_grad_norm", "examples", "set")}
    write_result({**header("dp", "dp.py", argv, started), "config": config, "rows": rows, "accountant": "rdp"},
                 Path(args.out))


if __name__ == "__main__":
    main()
