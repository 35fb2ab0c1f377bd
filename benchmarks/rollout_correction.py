"""The rollout/trainer mismatch on the demo GRPO recipe, and what skipping the trainer's separate
recomputation of the old log-probs saves (``rl.rollout_correction``, ``rl.old_logprobs``;
``lmforge.rl.correction``).

Runs ``lmforge grpo recipes/demo/grpo.yaml`` from ``--checkpoint`` (``make demo``'s SFT model) for
``--steps`` optimizer steps in each setting, as a subprocess into its own run directory, every
other key the recipe's own (its ``train.precision: auto`` is bf16 on CPUs that run bf16 matmuls
faster; the engine samples in fp32):

  recompute        π_old recomputed by the trainer (a no-grad bf16 forward over the batch), the
                   engine's log-probs dropped, no weight (the default of rl.old_logprobs: auto)
  token_truncate   the same recompute, TIS weight min(π_old/π_rollout, C = 2): logs the mismatch
  token_mask       the same recompute, MIS: a token whose ratio leaves [1/2, 2] masked (both sides counted)
  sequence_mask    the same recompute, the geometric-mean sequence ratio masked outside [1/2, 2]
  engine           rl.old_logprobs=engine: no recompute, π_old = the engine's log-probs (verl's
                   bypass mode); PPO's ratio is against the engine's (the demo recipe's choice)

The mismatch figures are the objective's, per step from metrics.jsonl: for the corrected
settings ``rollout_ratio_mean``/``_max``, ``rollout_corrected_share`` and ``rollout_kl`` (k3 of
KL(π_rollout ‖ π_old)); for ``engine``, ``approx_kl`` (the same k3, of π_θ against the engine's)
and ``ratio_max`` on the first step of each rollout batch, where π_θ is π_old; beside them, as
the scale to read them against, the same two figures on the later steps of each batch (how far
one optimizer step moves the policy: ``update``). The time split is
summary.json's mean ``time/<phase>_s`` over the steps after the first. The settings run in turn,
``--repeats`` rounds (figures: the mean over rounds); the load average is recorded around them.
With ``--score`` each run also scores greedy exact match on the held-out tasks after training.

  PYTHONPATH=. .venv/bin/python benchmarks/rollout_correction.py --steps 20 --repeats 2 --settings recompute token_truncate token_mask engine
  PYTHONPATH=. .venv/bin/python benchmarks/rollout_correction.py --steps 100 --score --settings recompute engine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from record import REPO, header, load_average, now, write_result

RECIPE = "recipes/demo/grpo.yaml"
SETTINGS = {  # each names every rl key, whatever the recipe sets
    "recompute": ["rl.rollout_correction=none", "rl.old_logprobs=trainer"],
    "token_truncate": ["rl.rollout_correction=token_truncate", "rl.old_logprobs=trainer"],
    "token_mask": ["rl.rollout_correction=token_mask", "rl.old_logprobs=trainer"],
    "sequence_mask": ["rl.rollout_correction=sequence_mask", "rl.old_logprobs=trainer"],
    "engine": ["rl.rollout_correction=none", "rl.old_logprobs=engine"],
}
PHASES = ("rollout", "reward", "reference", "old_logprobs", "forward_backward", "optimizer")
CORRECTED = ("rollout_ratio_mean", "rollout_ratio_max", "rollout_corrected_share", "rollout_kl")


def run_setting(name: str, args: argparse.Namespace, run_dir: Path) -> dict:
    overrides = [f"checkpoint={args.checkpoint}", f"run_dir={run_dir}", f"train.max_steps={args.steps}",
                 "train.checkpoint_every=0", "train.log_every=1", "grpo.samples_every=0", "train.tensorboard=false",
                 *([] if args.score else ["score.name=none"]), *args.set, *SETTINGS[name]]
    cmd = [sys.executable, "-m", "lmforge", "grpo", RECIPE, *overrides]
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - began
    if done.returncode:
        sys.exit(f"{name}: lmforge grpo exited {done.returncode}\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "reward_mean" in r]
    config = (run_dir / "config.yaml").read_text()
    mu = next((int(line.split(":")[1]) for line in config.splitlines() if line.strip().startswith("updates_per_batch:")), 1)
    out = {"setting": name, "command": f"lmforge grpo {RECIPE} " + " ".join(overrides), "wall_s": wall,
           "steps": summary["step"], "precision": summary.get("precision"),
           "time": {p: summary.get(f"time/{p}_s", 0.0) for p in PHASES},
           "step_s": statistics.mean(r["step_s"] for r in records[1:]) if len(records) > 1 else records[0]["step_s"],
           "reward_mean": statistics.mean(r["reward_mean"] for r in records)}
    if "rollout_kl" in records[0]:
        out["mismatch"] = {"ratio_mean": statistics.mean(r["rollout_ratio_mean"] for r in records),
                           "ratio_max": max(r["rollout_ratio_max"] for r in records),
                           "corrected_share": statistics.mean(r["rollout_corrected_share"] for r in records),
                           "kl": statistics.mean(r["rollout_kl"] for r in records),
                           "kl_max": max(r["rollout_kl"] for r in records)}
    elif name == "engine":  # the first step of each rollout batch: π_θ is π_old, so its ratio is the gap
        fresh = [r for r in records if (r["step"] - 1) % mu == 0]
        out["mismatch"] = {"ratio_mean": statistics.mean(r["ratio_mean"] for r in fresh),
                           "ratio_max": max(r["ratio_max"] for r in fresh), "corrected_share": None,
                           "kl": statistics.mean(r["approx_kl"] for r in fresh),
                           "kl_max": max(r["approx_kl"] for r in fresh)}
    later = [r for r in records if (r["step"] - 1) % mu]  # the later passes over a batch: π_θ has moved
    if later:  # the scale to read the mismatch against: how far one optimizer step moves the policy
        out["update"] = {"approx_kl": statistics.mean(r["approx_kl"] for r in later),
                         "ratio_max": max(r["ratio_max"] for r in later)}
    if args.score and summary.get("after"):
        out["exact_match"] = {"before": summary["before"]["exact_match"], "after": summary["after"]["exact_match"]}
    return out


def mean_rounds(runs: list[dict]) -> dict:
    """One setting's figures over its rounds: times and rewards averaged, maxima the largest."""
    first = runs[0]
    out = {**first, "rounds": len(runs), "wall_s": statistics.mean(r["wall_s"] for r in runs),
           "step_s": statistics.mean(r["step_s"] for r in runs),
           "reward_mean": statistics.mean(r["reward_mean"] for r in runs),
           "time": {p: statistics.mean(r["time"][p] for r in runs) for p in PHASES}}
    if "mismatch" in first:
        m = {k: statistics.mean(r["mismatch"][k] for r in runs) if first["mismatch"][k] is not None else None
             for k in first["mismatch"]}
        m["ratio_max"] = max(r["mismatch"]["ratio_max"] for r in runs)
        m["kl_max"] = max(r["mismatch"]["kl_max"] for r in runs)
        out["mismatch"] = m
    if "update" in first:
        out["update"] = {"approx_kl": statistics.mean(r["update"]["approx_kl"] for r in runs),
                         "ratio_max": max(r["update"]["ratio_max"] for r in runs)}
    if "exact_match" in first:
        out["exact_match"] = {k: statistics.mean(r["exact_match"][k] for r in runs) for k in ("before", "after")}
    return out


def table(result: dict) -> str:
    lines = ["| setting | step (s) | rollout | old log-probs | reference | forward+backward | optimizer | "
             "ratio mean | ratio max | corrected | KL k3 mean | KL k3 max | reward |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["settings"]:
        t, m = s["time"], s.get("mismatch") or {}
        share = m.get("corrected_share")
        lines.append(f"| {s['setting']} | {s['step_s']:.3f} | {t['rollout']:.3f} | {t['old_logprobs']:.3f} | "
                     f"{t['reference']:.3f} | {t['forward_backward']:.3f} | {t['optimizer']:.3f} | "
                     f"{m.get('ratio_mean', float('nan')):.6f} | {m.get('ratio_max', float('nan')):.4f} | "
                     f"{'-' if share is None else f'{100 * share:.2f}%'} | {m.get('kl', float('nan')):.2e} | "
                     f"{m.get('kl_max', float('nan')):.2e} | {s['reward_mean']:.3f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="runs/demo/sft", help="the policy to start from (make demo's SFT model)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=1, help="rounds of the settings, in turn")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--score", action="store_true", help="greedy exact match on the held-out tasks after training")
    p.add_argument("--set", nargs="*", default=[], help="more overrides for every run (the tests' tiny data)")
    p.add_argument("--runs", default="runs/rollout_correction", help="where the runs write")
    p.add_argument("--out", default="benchmarks/results/rollout_correction.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started, load_before = now(), load_average()
    rounds: dict[str, list[dict]] = {name: [] for name in args.settings}
    for i in range(args.repeats):
        for name in args.settings:
            rounds[name].append(run_setting(name, args, Path(args.runs).resolve() / f"{name}-{i}"))
    result = {**header("rollout_correction", "rollout_correction.py", argv, started), "recipe": RECIPE,
              "checkpoint": args.checkpoint, "steps": args.steps, "repeats": args.repeats,
              "settings": [mean_rounds(rounds[name]) for name in args.settings],
              "load_before": load_before, "load_after": load_average()}
    write_result(result, Path(args.out))
    print(table(result))


if __name__ == "__main__":
    main()
