"""Multi-token prediction: what its modules cost and give in training, and how often their drafts are kept.

``recipes/mtp/pretrain.yaml``: 4 layers of width 128 on the µP sweep's 512-token shards of the bundled prose,
with DeepSeek-V3's sequential MTP modules (2 depths, λ = 0.3). Two runs, one after another in one process,
seeded alike and fed the same windows:

- ``plain``: the recipe with ``model.mtp.depth: 0``;
- ``mtp``: the recipe as it is.

Recorded per run: the main head's final validation loss (the MTP modules never enter validation), the
median training tokens/s after the first step, the parameters, and for ``mtp`` each depth's final training
loss. Then the ``mtp`` checkpoint decodes the first ``--prompt-len`` tokens of ``--prompts`` validation
windows greedily, one prompt at a time (batch 1), for exactly ``--new-tokens`` tokens, without drafting and
with 1 and 2 drafted tokens a step (``generate``'s ``draft_tokens``): tokens/s (best of ``--repeats``),
the speed-up over batch-1 greedy decoding, the share of drafts accepted, and whether the tokens are the
same as without drafting (they must be).

    .venv/bin/python benchmarks/mtp.py                # ~8 min on 2 idle CPU cores
    .venv/bin/python benchmarks/mtp.py --quick        # a smoke run: 4 steps
    .venv/bin/python benchmarks/mtp.py --reuse        # decoding measured again on the runs already trained
    .venv/bin/python scripts/write_benchmark_docs.py  # then the table of the JSON into docs/architectures.md

Tokens/s depend on the machine and its load (recorded beside them); the losses and acceptance do not.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from record import header, load_average, made_once, now, parse_training_args, write_result

from lmforge.checkpoints.load import load_model
from lmforge.core.config import load_config
from lmforge.data.loader import TokenDataset
from lmforge.inference.engine import Engine, GenerationConfig, Request
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/mtp/pretrain.yaml"
TOKENIZER, PREPARE = "recipes/mup/tokenizer.yaml", "recipes/mup/prepare.yaml"
RESULTS = "benchmarks/results/mtp.json"
RUNS = {"plain": ["model.mtp.depth=0"], "mtp": []}
QUICK = ["train.max_steps=4", "train.warmup_steps=1", "train.eval_every=4", "train.eval_batches=2"]


def train(name: str, run_dir: Path, extra: list[str], reuse: bool = False) -> dict:
    print(f"== {name}", flush=True)
    loads_before = load_average()
    started = time.perf_counter()
    cfg = load_config(PretrainRecipe, REPO / RECIPE, [f"run_dir={run_dir}", "train.resume=never", *RUNS[name], *extra])
    if reuse and (run_dir / "summary.json").is_file():
        print(f"   reusing the finished run in {run_dir}", flush=True)
    else:
        run_pretrain(cfg)
    seconds = time.perf_counter() - started
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    depths = sorted(k for k in steps[-1] if k.startswith("mtp/depth"))
    run = {"name": name, "depth": cfg.model.mtp.depth, "steps": len(steps),
           "val_loss": evals[-1]["val_loss"] if evals else math.nan,
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[1:]) if len(steps) > 1 else math.nan,
           "params": sum(p.numel() for p in load_model(run_dir)[0].parameters()), "tokens": steps[-1]["tokens"],
           "final_depth_losses": {k: steps[-1][k] for k in depths}, "seconds": round(seconds, 1),
           "load_average": [loads_before, load_average()]}
    print(f"   validation loss {run['val_loss']:.4f}, {run['tokens_per_s']:.0f} tokens/s ({seconds:.0f} s)", flush=True)
    return run


def held_out_prompts(n: int, length: int, data: Path = REPO / "runs/mup/data") -> list[list[int]]:
    """The first ``length`` tokens of ``n`` validation windows of ``data`` (the runs' shards), evenly spaced."""
    windows = TokenDataset(data, "val", length - 1, False)
    picks = np.linspace(0, len(windows) - 1, n).astype(int)
    return [windows.window(int(i)).tolist() for i in picks]


def measure_drafting(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, repeats: int,
                     draft_lengths: list[int]) -> list[dict]:
    """Greedy decoding of ``prompts`` one at a time for exactly ``new_tokens`` tokens, without drafting (0) and
    with each of ``draft_lengths``: tokens/s (best of ``repeats``, runs alternating), the speed-up over 0, the
    share of drafts accepted and whether every token equals decoding's without drafting."""
    config = GenerationConfig(max_new_tokens=new_tokens, temperature=0, stop_token_ids=[])

    def decode(draft: int) -> tuple[list[list[int]], list[int]]:
        engine = Engine(model, max_batch=1, draft_tokens=draft)
        ids = [engine.submit(Request(p, config)) for p in prompts]
        done = dict(engine.run())
        return [done[i][0].tokens for i in ids], engine.draft_stats

    lengths = [0, *draft_lengths]
    reference, _ = decode(0)  # also the warm-up (the decoding layout)
    times: dict[int, list[float]] = {d: [] for d in lengths}
    outputs = {}
    for _ in range(repeats):
        for d in lengths:
            began = time.perf_counter()
            outputs[d] = decode(d)
            times[d].append(time.perf_counter() - began)
    rows = []
    for d in lengths:
        tokens, (proposed, accepted) = outputs[d]
        tps = len(prompts) * new_tokens / min(times[d])
        rows.append({"draft_tokens": d, "tokens_per_s": round(tps, 1),
                     "speedup": round(min(times[0]) / min(times[d]), 3),
                     "acceptance": round(accepted / proposed, 4) if proposed else None,
                     "drafts_proposed": proposed, "drafts_accepted": accepted,
                     "identical_to_greedy": tokens == reference, "times_s": [round(t, 4) for t in times[d]]})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts decoded one at a time")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reuse", action="store_true", help="take the runs already finished in --runs (measure decoding again)")
    return parse_training_args(p, "mtp", RESULTS, "docs/img/mtp.png", "4 steps", argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    extra = (QUICK if args.quick else []) + args.set
    made_once(TOKENIZER, PREPARE, extra)
    started = now()
    runs = [train(name, args.runs / name, extra, args.reuse) for name in RUNS]
    by = {r["name"]: r for r in runs}
    model, _ = load_model(args.runs / "mtp")
    prompts = held_out_prompts(args.prompts, args.prompt_len)
    drafting = measure_drafting(model, prompts, args.new_tokens, args.repeats, list(range(1, model.cfg.mtp.depth + 1)))
    summary = {"val_loss_mtp_minus_plain": by["mtp"]["val_loss"] - by["plain"]["val_loss"],
               "tokens_per_s_mtp_over_plain": by["mtp"]["tokens_per_s"] / by["plain"]["tokens_per_s"],
               "best_speedup": max(r["speedup"] for r in drafting[1:]),
               "all_identical": all(r["identical_to_greedy"] for r in drafting)}
    result = {**header("mtp", "mtp.py", argv, started), "recipe": RECIPE, "steps": by["plain"]["steps"],
              "overrides": extra, "decoding": {"prompts": args.prompts, "prompt_len": args.prompt_len,
                                               "new_tokens": args.new_tokens, "repeats": args.repeats, "batch": 1},
              "runs": runs, "drafting": drafting, "summary": summary}
    write_result(result, args.out)
    for r in drafting:
        print(f"draft_tokens {r['draft_tokens']}: {r['tokens_per_s']:.1f} tokens/s, speed-up {r['speedup']:.2f}, "
              f"acceptance {r['acceptance']}, identical {r['identical_to_greedy']}")
    print(f"MTP - plain validation loss {summary['val_loss_mtp_minus_plain']:+.4f}; training tokens/s ratio "
          f"{summary['tokens_per_s_mtp_over_plain']:.2f}; wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
