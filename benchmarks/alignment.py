"""Compare the preference losses on one budget: every DPO variant, SimPO, ORPO, CPO and KTO
start from the same SFT checkpoint, see the same demo pairs (KTO: the same pairs unpaired)
for the same steps, batch and learning rate, and are scored on the same held-out tasks.

Reported per method: greedy exact match on the SFT validation tasks before and after,
the model's own pairwise preference on held-out pairs (log-prob of chosen > rejected),
the mean log-prob margin, and wall time. Writes benchmarks/results/alignment.json and
prints a markdown table (the README's).

  .venv/bin/python benchmarks/alignment.py --checkpoint runs/demo/sft
  .venv/bin/python benchmarks/alignment.py --methods dpo ipo kto --steps 60
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from lmforge.core.config import load_config
from lmforge.stages.dpo import DPORecipe, run_dpo
from lmforge.stages.kto import KTORecipe, run_kto

# loss -> overrides; β as each method's reference implementation defaults it (SimPO: its paper's range)
METHODS = {
    "dpo": ["objective.loss=dpo", "objective.beta=0.1"],
    "dpo+sft": ["objective.loss=dpo", "objective.beta=0.1", "objective.sft_weight=1.0"],
    "ipo": ["objective.loss=ipo", "objective.beta=0.1"],
    "cdpo": ["objective.loss=cdpo", "objective.beta=0.1", "objective.label_smoothing=0.1"],
    "rdpo": ["objective.loss=rdpo", "objective.beta=0.1", "objective.label_smoothing=0.1"],
    "hinge": ["objective.loss=hinge", "objective.beta=0.1"],
    "simpo": ["objective.loss=simpo", "objective.beta=2.0", "objective.simpo_gamma=1.0"],
    "orpo": ["objective.loss=orpo", "objective.beta=0.1"],
    "cpo": ["objective.loss=cpo", "objective.beta=0.1"],
    "kto": ["objective.beta=0.1"],
}


def run_method(name: str, args: argparse.Namespace) -> dict:
    data = Path(args.data)
    common = [f"checkpoint={args.checkpoint}", f"run_dir={Path(args.out) / name}", f"train.max_steps={args.steps}",
              f"train.lr={args.lr}", f"train.micro_batch_size={args.batch}", f"train.warmup_steps={min(10, args.steps)}",
              "train.eval_every=0", "train.checkpoint_every=100000", "train.tensorboard=false", "train.resume=never",
              "data.max_length=128", "score.name=exact_match", f"score.tasks=[{args.tasks}]",
              f"score.max_examples={args.eval_examples}", "score.max_new_tokens=24"]
    t0 = time.perf_counter()
    if name == "kto":
        recipe = load_config(KTORecipe, None, [*common, *METHODS[name], f"data.train=[{data / 'kto_train.jsonl'}]",
                                               f"data.val=[{data / 'kto_val.jsonl'}]", f"pairs=[{data / 'val.jsonl'}]"])
        summary = run_kto(recipe)
    else:
        recipe = load_config(DPORecipe, None, [*common, *METHODS[name], f"data.train=[{data / 'train.jsonl'}]",
                                               f"data.val=[{data / 'val.jsonl'}]"])
        summary = run_dpo(recipe)
    before, after = summary["before"], summary["after"]
    return {"method": name, "overrides": METHODS[name], "exact_match_before": before["exact_match"]["exact_match"],
            "exact_match_after": after["exact_match"]["exact_match"], "logp_accuracy_before": before["logp_accuracy"],
            "logp_accuracy_after": after["logp_accuracy"], "logp_margin_before": before["logp_margin"],
            "logp_margin_after": after["logp_margin"], "val_reward_margin_after": after.get("val_margin"),
            "wall_s": time.perf_counter() - t0}


def table(rows: list[dict]) -> str:
    lines = ["| method | exact match before → after | own preference (chosen > rejected) | log-prob margin | wall |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {100 * r['exact_match_before']:.1f}% → **{100 * r['exact_match_after']:.1f}%** "
                     f"| {100 * r['logp_accuracy_before']:.1f}% → {100 * r['logp_accuracy_after']:.1f}% "
                     f"| {r['logp_margin_before']:.2f} → {r['logp_margin_after']:.2f} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/demo/sft")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--data", default="data/preference",
                        help="directory of train.jsonl and val.jsonl pairs, kto_train.jsonl and kto_val.jsonl")
    parser.add_argument("--tasks", default="data/sft/val.jsonl", help="SFT-format tasks scored by greedy exact match")
    parser.add_argument("--eval-examples", type=int, default=75, help="tasks scored before and after")
    parser.add_argument("--out", default="runs/bench-alignment")
    parser.add_argument("--json", default="benchmarks/results/alignment.json")
    args = parser.parse_args()
    rows = [run_method(name, args) for name in args.methods]
    print(table(rows))
    result = {"benchmark": "alignment", "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "checkpoint": args.checkpoint, "data": args.data, "tasks": args.tasks, "eval_examples": args.eval_examples,
              "steps": args.steps, "lr": args.lr, "micro_batch_size": args.batch,
              "machine": platform.processor() or platform.machine(), "results": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
