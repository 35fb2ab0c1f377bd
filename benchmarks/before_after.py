"""The dense path's speed at two commits, side by side: greedy decoding and an eager training step of one
preset, each commit in its own subprocess, the two alternating, best of ``--repeats``.

    .venv/bin/python benchmarks/before_after.py BEFORE [AFTER] [--preset tiny] [--repeats 5]

BEFORE and AFTER are commits (AFTER defaults to the working tree); each is checked out with ``git worktree``
under ``--scratch`` (removed afterwards) and imported from there, with this checkout's virtual environment.
Figures: generated tokens/s of ``generate`` (batch 1 and 8, 64 new tokens after 32 prompt tokens, no stop),
and trained tokens/s of ``StepRunner.run_step`` (one micro-batch of 8 x 256 windows, fp32, AdamW, eager),
both after a warm-up call. The ratio AFTER / BEFORE is what a change did to the path it did not mean to
touch; the machine's load average is recorded beside it (a shared machine's timings are noisy).
The result goes to ``--out`` (default runs/before_after.json), not to benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from record import machine, now

REPO = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent('''
    import json, sys, time, torch
    from lmforge.core.config import load_config
    from lmforge.inference.engine import GenerationConfig, generate
    from lmforge.model import families
    from lmforge.model.config import ModelConfig
    from lmforge.objectives.clm import CausalLMObjective
    from lmforge.train.step import StepRunner
    preset, kind = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = families.build(load_config(ModelConfig, None, [f"preset={preset}"]))
    V = model.cfg.vocab_size
    if kind.startswith("decode"):
        batch = int(kind.removeprefix("decode"))
        model.eval()
        prompts = torch.randint(3, V, (batch, 32), generator=torch.Generator().manual_seed(0)).tolist()
        config = GenerationConfig(max_new_tokens=64, temperature=0, stop_token_ids=[])
        generate(model, prompts, config)
        t = time.perf_counter(); generate(model, prompts, config); s = time.perf_counter() - t
        print(json.dumps(batch * 64 / s))
    else:
        runner = StepRunner(model, CausalLMObjective(), torch.optim.AdamW(model.parameters(), lr=1e-4), "fp32", 1.0)
        model.train()
        windows = [torch.randint(0, V, (8, 257), generator=torch.Generator().manual_seed(0))]
        runner.run_step(windows)
        t = time.perf_counter(); runner.run_step(windows); s = time.perf_counter() - t
        print(json.dumps(8 * 256 / s))
''')
KINDS = ("decode1", "decode8", "train")


def measure(tree: Path, preset: str, kind: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", PROBE, preset, kind], cwd=tree, env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before")
    p.add_argument("after", nargs="?", help="a commit (default: the working tree)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scratch", default=None, help="where the worktrees go (default: a temporary folder)")
    p.add_argument("--out", default="runs/before_after.json")
    args = p.parse_args(argv)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="before_after_"))
    trees = {}
    try:
        for name, rev in (("before", args.before), ("after", args.after)):
            if rev is None:
                trees[name] = REPO
                continue
            trees[name] = scratch / name
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[name]), rev], cwd=REPO, check=True,
                           capture_output=True)
        loads = [os.getloadavg()[0]]
        best = {(n, k): 0.0 for n in trees for k in KINDS}
        for _ in range(args.repeats):
            for kind in KINDS:
                for name, tree in trees.items():
                    best[name, kind] = max(best[name, kind], measure(tree, args.preset, kind))
        loads.append(os.getloadavg()[0])
    finally:
        for tree in trees.values():
            if tree != REPO:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    rows = [{"figure": kind, "before_tokens_per_s": round(best["before", kind], 1),
             "after_tokens_per_s": round(best["after", kind], 1),
             "after_over_before": round(best["after", kind] / best["before", kind], 3)} for kind in KINDS]
    result = {"date": now(), "machine": machine(), "before": args.before, "after": args.after or "working tree",
              "preset": args.preset,
              "repeats": args.repeats, "load_average": loads, "rows": rows,
              "command": " ".join(["python benchmarks/before_after.py", *(argv if argv is not None else sys.argv[1:])])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(f"{r['figure']:>8}: before {r['before_tokens_per_s']:>9.1f} tok/s, after {r['after_tokens_per_s']:>9.1f}, "
              f"after/before {r['after_over_before']:.3f}")
    print(f"load average {loads[0]:.1f} -> {loads[1]:.1f}; wrote {args.out}")


if __name__ == "__main__":
    main()
