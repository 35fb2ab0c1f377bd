"""Every alignment method from the same SFT checkpoint on the same budget, in one table.

Each method runs as users run it: its demo recipe through the stage CLI, as a subprocess
(`python -m lmforge <verb> recipes/demo/<verb>.yaml overrides`), into its own run directory,
with the same starting checkpoint and the same number of optimizer steps (`--steps`); every
other setting (learning rate, batch, β, group size, ...) is the recipe's own. The methods:

  dpo (and the preference variants ipo, cdpo, rdpo, hinge, simpo, orpo, cpo, dpo+sft)
      recipes/demo/dpo.yaml on data/preference pairs
  kto      recipes/demo/kto.yaml on the same pairs unpaired
  ppo      recipes/demo/ppo.yaml against the demo reward model (`--reward-model`, lmforge reward)
  grpo     recipes/demo/grpo.yaml with the demo's exact-answer verifier
  rs       recipes/demo/rs.yaml (best of 8 correct answers per training task), then
           recipes/demo/sft.yaml on its output for the step budget

Then the SFT model and every method's final model are scored by one scorer
(`lmforge.stages.scoring.held_out_scores`) on the held-out tasks (`--tasks`): their greedy
answers' exact match (the demo checker, as the stages' `score: exact_match`), the demo reward
model's mean score of those answers, and the KL to the SFT model along them (exact over the
vocabulary at each answer token, `rl.kl.exact_kl`; the mean over answers of the per-token
mean). Also reported: each method's optimizer steps, its wall time (the subprocesses, the
scoring not included) and the load average around it. Writes benchmarks/results/alignment.json
and prints a markdown table (the one in docs/rl.md).

  PYTHONPATH=. .venv/bin/python benchmarks/alignment.py                  # dpo kto ppo grpo rs
  PYTHONPATH=. .venv/bin/python benchmarks/alignment.py --methods dpo ppo --steps 20
  PYTHONPATH=. .venv/bin/python benchmarks/alignment.py --quick          # a smoke run: 2 steps, 8 tasks
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from record import command, commit, machine, now

from lmforge.checkpoints.load import load_model, resolve_checkpoint
from lmforge.data.tokenizer import Tokenizer
from lmforge.rl.prompts import read_prompts
from lmforge.rl.rewards import Reward, RewardComponentConfig, RewardConfig
from lmforge.stages.scoring import held_out_scores

MAX_NEW_TOKENS = 24  # the stages' score.max_new_tokens on the demo

# the preference losses: dpo.yaml with these overrides, β as each method's reference implementation defaults it
PREFERENCE = {
    "dpo": ["objective.loss=dpo", "objective.beta=0.1"],
    "dpo+sft": ["objective.loss=dpo", "objective.beta=0.1", "objective.sft_weight=1.0"],
    "ipo": ["objective.loss=ipo", "objective.beta=0.1"],
    "cdpo": ["objective.loss=cdpo", "objective.beta=0.1", "objective.label_smoothing=0.1"],
    "rdpo": ["objective.loss=rdpo", "objective.beta=0.1", "objective.label_smoothing=0.1"],
    "hinge": ["objective.loss=hinge", "objective.beta=0.1"],
    "simpo": ["objective.loss=simpo", "objective.beta=2.0", "objective.simpo_gamma=1.0"],
    "orpo": ["objective.loss=orpo", "objective.beta=0.1"],
    "cpo": ["objective.loss=cpo", "objective.beta=0.1"],
}
METHODS = [*PREFERENCE, "kto", "ppo", "grpo", "rs"]
DEFAULT = ["dpo", "kto", "ppo", "grpo", "rs"]


@dataclass
class Stage:
    """One CLI call: ``python -m lmforge verb recipe overrides``; ``trains``: it takes the step budget."""

    verb: str
    recipe: str
    overrides: list[str] = field(default_factory=list)
    trains: bool = True


def stages_of(name: str, args: argparse.Namespace, out: Path) -> list[Stage]:
    """The CLI calls of one method, writing into ``out``; the last one's ``final/`` is the method's model."""
    data = Path(args.data)
    if name in PREFERENCE:
        return [Stage("dpo", "recipes/demo/dpo.yaml", [*PREFERENCE[name], f"data.train=[{data / 'train.jsonl'}]",
                                                       f"data.val=[{data / 'val.jsonl'}]"])]
    if name == "kto":
        return [Stage("kto", "recipes/demo/kto.yaml", [f"data.train=[{data / 'kto_train.jsonl'}]",
                                                       f"data.val=[{data / 'kto_val.jsonl'}]",
                                                       f"pairs=[{data / 'val.jsonl'}]"])]
    prompts = [f"data.train=[{args.prompts}]", f"data.val=[{args.tasks}]"]
    if name == "ppo":
        return [Stage("ppo", "recipes/demo/ppo.yaml",
                      [*prompts, f"reward.components=[{{kind: reward_model, path: {args.reward_model}}}]"])]
    if name == "grpo":
        return [Stage("grpo", "recipes/demo/grpo.yaml", prompts)]
    if name == "rs":
        sample = [f"data.prompts=[{args.prompts}]"] + ([f"data.max_prompts={args.rs_prompts}"] if args.rs_prompts else [])
        # the second SFT as recipes/demo/rs.yaml's lifecycle runs it: the RS answers only, lr 2e-4
        samples = out.with_name(out.name + "-samples")
        return [Stage("rs", "recipes/demo/rs.yaml", [f"run_dir={samples}", *sample], trains=False),
                Stage("sft", "recipes/demo/sft.yaml", [f"data.train=[{samples / 'sft.jsonl'}]",
                                                       f"data.val=[{args.tasks}]", "train.lr=2.0e-4"])]
    raise ValueError(f"unknown method {name!r}")


def budget_overrides(stage: Stage, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The same start, step budget and run settings for every training stage (scored here, not by the stage)."""
    if not stage.trains:
        return [f"checkpoint={args.checkpoint}"]
    warmup = (yaml.safe_load(Path(stage.recipe).read_text()).get("train") or {}).get("warmup_steps", 0)
    # dpo/kto: the reference's log-probs of only the pairs the budget reaches, not of the whole data set first
    reference = ["precompute_reference=false"] if stage.verb in ("dpo", "kto") else []
    return [*reference, f"checkpoint={args.checkpoint}", f"run_dir={run_dir}", f"train.max_steps={args.steps}",
            f"train.checkpoint_every={args.steps}", "train.eval_every=0", "train.tensorboard=false",
            "train.resume=never", "score.name=none", *([f"train.warmup_steps={args.steps // 4}"]
                                                       if warmup >= args.steps else [])]


def run_method(name: str, args: argparse.Namespace) -> dict:
    """Run the method's stages; its run directory, steps, wall time and the load average around it."""
    out = Path(args.out) / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))}
    load_before, wall, run_dir, commands = os.getloadavg()[0], 0.0, out, []
    for stage in stages_of(name, args, out):
        command = [sys.executable, "-m", "lmforge", stage.verb, stage.recipe, *stage.overrides,
                   *budget_overrides(stage, args, out)]
        commands.append(" ".join(["lmforge", *command[3:]]))
        print(f"[{name}] {commands[-1]}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        wall += time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"{name}: `{commands[-1]}` exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"method": name, "commands": commands, "run_dir": str(run_dir), "steps": summary.get("step"),
            "wall_s": wall, "load_before": load_before, "load_after": os.getloadavg()[0],
            "final_checkpoint": summary.get("final_checkpoint", str(run_dir / "final"))}


def score_all(rows: list[dict], args: argparse.Namespace) -> dict:
    """``held_out_scores`` of the SFT model and of each method's final model; the SFT model's figures."""
    tok = Tokenizer.load(resolve_checkpoint(args.checkpoint))
    prompts = read_prompts([args.tasks], tok)[: args.eval_examples]
    reward = Reward(RewardConfig(components=[RewardComponentConfig(kind="reward_model", path=args.reward_model)]),
                    tok, MAX_NEW_TOKENS)
    reference = load_model(args.checkpoint)[0]
    start = held_out_scores(reference, tok, prompts, MAX_NEW_TOKENS, reward=reward, reference=reference)
    for row in rows:
        row |= held_out_scores(load_model(row["final_checkpoint"])[0], tok, prompts, MAX_NEW_TOKENS, reward=reward,
                               reference=reference)
    return start


def table(start: dict, rows: list[dict]) -> str:
    lines = [f"| method | exact match on {start['examples']} held-out tasks | reward model score | "
             "KL to SFT per token (nats) | steps | wall |", "|---|---|---|---|---|---|",
             f"| SFT (start) | {100 * start['exact_match']:.1f}% | {start['reward_mean']:.2f} | 0 | - | - |"]
    for r in rows:
        lines.append(f"| {r['method']} | {100 * r['exact_match']:.1f}% | {r['reward_mean']:.2f} | "
                     f"{r['kl_per_token']:.3f} | {r['steps']} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/demo/sft", help="the SFT model every method starts from")
    parser.add_argument("--reward-model", default="runs/demo/reward", help="lmforge reward's run: PPO's reward, a column")
    parser.add_argument("--methods", nargs="+", default=DEFAULT, choices=METHODS)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of every method (rs: of its SFT)")
    parser.add_argument("--data", default="data/preference",
                        help="directory of train.jsonl and val.jsonl pairs, kto_train.jsonl and kto_val.jsonl")
    parser.add_argument("--prompts", default="data/sft/train.jsonl", help="training tasks of ppo, grpo and rs")
    parser.add_argument("--tasks", default="data/sft/val.jsonl", help="held-out tasks, scored greedily")
    parser.add_argument("--eval-examples", type=int, default=75, help="held-out tasks scored")
    parser.add_argument("--rs-prompts", type=int, default=None, help="rs: sample this many prompts (default: the recipe's)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 steps, 8 held-out tasks, rs on 16 prompts")
    parser.add_argument("--out", default="runs/bench-alignment")
    parser.add_argument("--json", default="benchmarks/results/alignment.json")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.eval_examples, args.rs_prompts = 2, 8, args.rs_prompts or 16
    started, t0 = now(), time.perf_counter()
    rows = [run_method(name, args) for name in args.methods]
    start = score_all(rows, args)
    print(table(start, rows))
    result = {"benchmark": "alignment", "date": started, "command": command("alignment.py", None), "commit": commit(),
              "machine": machine(), "checkpoint": args.checkpoint, "reward_model": args.reward_model,
              "tasks": args.tasks, "steps": args.steps, "kl": "exact KL(policy || SFT) over the vocabulary at each "
              "greedy answer token, mean per answer, then over answers", "start": start, "results": rows,
              "wall_s": time.perf_counter() - t0}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
