"""Asynchronous GRPO rollouts on the demo recipe (``rl.rollout_workers``, ``rl.max_off_policy_steps``;
``lmforge.rl.workers``): throughput, where a step's time goes, and reward against wall time.

Runs ``lmforge grpo recipes/demo/grpo.yaml`` from ``--checkpoint`` (``make demo``'s SFT model) for
``--steps`` optimizer steps in each setting, as a subprocess into its own run directory, every
other key the recipe's own:

  sync       rl.rollout_workers=0: in-process sampling, then training (today's GRPO), torch's
             default threads (the machine's cores)
  sync-1t    the same on one thread (OMP_NUM_THREADS=1): the trainer's share with one worker, to
             tell what the asynchrony gives from what a thread fewer gives (on a loaded machine a
             two-thread trainer waits on its threads)
  wW-kK      W rollout worker processes, rl.max_off_policy_steps=K (K = 0: synchronous through the
             workers; K >= 1: the workers sample the next rollout batches while the trainer trains)

Per setting, from metrics.jsonl: trained tokens per second over the steps after the first (the
first holds the workers' start), the mean seconds of a step, of its rollout wait (``time/rollout_s``:
in-process, the sampling itself; with workers, the trainer waiting for groups) and of its training
(forward, backward, optimizer, scoring forwards), the final reward (the mean ``reward_mean`` of the
last quarter of the steps), the largest age of a trained sample and the groups dropped as stale.
Reward against wall time is the figure. The settings run in turn (``--repeats`` rounds, the
figures their mean; the reward curve the first round's); the load average is recorded around
them: other processes on the machine slow every setting, the ones with more processes most.

  PYTHONPATH=. .venv/bin/python benchmarks/rl_async.py --steps 40
  PYTHONPATH=. .venv/bin/python benchmarks/rl_async.py --steps 4 --settings sync w1-k1 --runs /tmp/rl_async
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

from record import REPO, header, load_average, machine_line, now, replotted, write_result

RECIPE = "recipes/demo/grpo.yaml"
SETTINGS = {"sync": (0, 0), "sync-1t": (0, 0), **{f"w{w}-k{k}": (w, k) for w in (1, 2) for k in (0, 1, 2)}}
TRAIN_PHASES = ("reference", "old_logprobs", "forward_backward", "optimizer", "reward")


def run_setting(name: str, args: argparse.Namespace, run_dir: Path) -> dict:
    workers, staleness = SETTINGS[name]
    overrides = [f"checkpoint={args.checkpoint}", f"run_dir={run_dir}", f"train.max_steps={args.steps}",
                 "train.checkpoint_every=0", "train.log_every=1", "grpo.samples_every=0", "train.tensorboard=false",
                 "score.name=none", *args.set, f"rl.rollout_workers={workers}", f"rl.max_off_policy_steps={staleness}"]
    cmd = [sys.executable, "-m", "lmforge", "grpo", RECIPE, *overrides]
    began = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(REPO), **({"OMP_NUM_THREADS": "1"} if name == "sync-1t" else {})}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - began
    if done.returncode:
        sys.exit(f"{name}: lmforge grpo exited {done.returncode}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "reward_mean" in r]
    later = records[1:] or records

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in later)

    span_s = later[-1]["elapsed_s"] - records[0]["elapsed_s"] if len(records) > 1 else records[0]["step_s"]
    tokens = later[-1]["tokens"] - records[0]["tokens"] if len(records) > 1 else records[0]["tokens"]
    quarter = records[-max(1, len(records) // 4):]
    return {"setting": name, "workers": workers, "max_off_policy_steps": staleness,
            "command": f"lmforge grpo {RECIPE} " + " ".join(overrides), "wall_s": wall, "steps": len(records),
            "tokens_per_s": tokens / span_s, "step_s": mean("step_s"), "first_step_s": records[0]["step_s"],
            "rollout_s": mean("time/rollout_s"), "train_s": sum(mean(f"time/{p}_s") for p in TRAIN_PHASES),
            "final_reward": statistics.mean(r["reward_mean"] for r in quarter),
            "off_policy_steps_max": max((r.get("off_policy_steps_max", 0.0) for r in records), default=0.0),
            "stale_dropped": sum(r.get("stale_dropped", 0.0) for r in records),
            "curve": [[r["elapsed_s"], r["reward_mean"]] for r in records]}


def mean_rounds(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for key in ("wall_s", "tokens_per_s", "step_s", "first_step_s", "rollout_s", "train_s", "final_reward",
                "stale_dropped"):
        out[key] = statistics.mean(r[key] for r in runs)
    out["off_policy_steps_max"] = max(r["off_policy_steps_max"] for r in runs)
    out["rounds"] = len(runs)
    return out


def speedups(result: dict) -> dict[str, float]:
    """Each setting's tokens/s over the in-process synchronous run's."""
    base = next((x["tokens_per_s"] for x in result["settings"] if x["setting"] == "sync"), None)
    return {x["setting"]: x["tokens_per_s"] / base for x in result["settings"]} if base else {}


def table(result: dict) -> str:
    ratio = speedups(result)
    lines = ["| setting | workers | staleness | tokens/s | x sync | step (s) | rollout wait (s) | train (s) | "
             "final reward | oldest sample | stale dropped |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in result["settings"]:
        lines.append(f"| {x['setting']} | {x['workers']} | {x['max_off_policy_steps']} | {x['tokens_per_s']:.0f} | "
                     f"{ratio.get(x['setting'], float('nan')):.2f} | {x['step_s']:.3f} | {x['rollout_s']:.3f} | "
                     f"{x['train_s']:.3f} | {x['final_reward']:.3f} | {x['off_policy_steps_max']:.0f} | "
                     f"{x['stale_dropped']:.0f} |")
    return "\n".join(lines)


def draw_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for x in result["settings"]:
        t = [c[0] for c in x["curve"]]
        r = [c[1] for c in x["curve"]]
        k = max(1, len(r) // 10)  # a running mean over a tenth of the steps
        smooth = [statistics.mean(r[max(0, i - k + 1): i + 1]) for i in range(len(r))]
        left.plot(t, smooth, label=x["setting"], linestyle="-" if x["workers"] < 2 else "--")
    left.set_xlabel("wall time (s)")
    left.set_ylabel("reward mean (running mean)")
    left.legend(fontsize=8)
    names = [x["setting"] for x in result["settings"]]
    wait = [x["rollout_s"] for x in result["settings"]]
    train = [x["train_s"] for x in result["settings"]]
    rest = [max(x["step_s"] - x["rollout_s"] - x["train_s"], 0.0) for x in result["settings"]]
    right.bar(names, wait, label="rollout wait")
    right.bar(names, train, bottom=wait, label="train")
    right.bar(names, rest, bottom=[a + b for a, b in zip(wait, train)], label="other")
    right.set_ylabel("seconds per step")
    right.legend(fontsize=8)
    right.tick_params(axis="x", labelrotation=45)
    fig.suptitle(f"{result['recipe']}, {result['steps']} steps: {machine_line(result)}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="runs/demo/sft", help="the policy to start from (make demo's SFT model)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=1, help="rounds of the settings, in turn")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--set", nargs="*", default=[], help="more overrides for every run (the tests' tiny data)")
    p.add_argument("--runs", default="runs/rl_async", help="where the runs write")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/rl_async.json"))
    p.add_argument("--plot", type=Path, default=Path("docs/img/rl_async.png"))
    p.add_argument("--replot", action="store_true", help="draw the figure again from --out's JSON, then stop")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if replotted(args, draw_plot):
        return
    started, load_before = now(), load_average()
    rounds: dict[str, list[dict]] = {name: [] for name in args.settings}
    for i in range(args.repeats):
        for name in args.settings:
            rounds[name].append(run_setting(name, args, Path(args.runs).resolve() / f"{name}-{i}"))
    result = {**header("rl_async", "rl_async.py", argv, started), "recipe": RECIPE, "checkpoint": args.checkpoint,
              "steps": args.steps, "repeats": args.repeats,
              "settings": [mean_rounds(rounds[name]) for name in args.settings],
              "load_before": load_before, "load_after": load_average()}
    write_result(result, args.out)
    draw_plot(result, args.plot)
    print(table(result))


if __name__ == "__main__":
    main()
