"""Rollout throughput: lmforge's rollouts (``rl.rollout.sample_rollouts`` through the engine)
against transformers' ``generate(do_sample=True, num_return_sequences=n)``, same weights.

    python benchmarks/rollout.py [--prompts 64] [--samples 8] [--new-tokens 128] [--max-batch 512 64] [--repeats 2]
    python benchmarks/rollout.py --smoke          # a tiny model and shape, for tests/test_benchmarks.py

Both sides hold the same weights (lmforge's random init of the ``tiny`` preset, mapped with
``lmforge.model.hf`` by ``benchmarks/generate.py``'s ``build_pair``) and sample ``--samples``
continuations of each of ``--prompts`` prompts (random ids, ``--prompt-len`` long) at
temperature 1 with top-k and top-p off, for exactly ``--new-tokens`` tokens (no stop token;
transformers with ``min_new_tokens``). lmforge's side is a whole rollout step: per-prompt seeded
generators, each prompt's prefill shared by its samples, rows of ``--max-batch`` decoding
together with continuous batching, every token's log-prob recorded, and the trainer's padded
batch (``rollout_batch``) built; the peer's figure is its token ids alone (no log-probs).
Figures are generated tokens per second of the whole call; the sides alternate and the best of
``--repeats`` is kept. The machine's load average is recorded before and after: on a shared
machine the figures move with it. Target ratio: >= 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers
from generate import DTYPES, build_pair, model_config  # this folder is the script's first import path
from record import command, commit, machine, now

from lmforge.rl.prompts import Prompt
from lmforge.rl.rollout import RolloutConfig, RolloutState, rollout_batch, sample_rollouts

TARGET = 3.0
SMOKE = ["--model", "d_model=64", "n_layers=1", "n_heads=4", "n_kv_heads=1", "ffn_hidden=128", "vocab_size=512",
         "--prompts", "2", "--samples", "2", "--new-tokens", "4", "--prompt-len", "4", "--max-batch", "4",
         "--repeats", "1"]


def measure(args: argparse.Namespace) -> dict:
    ours, theirs = build_pair(model_config(args))
    ours.to(DTYPES[args.dtype])
    theirs.to(DTYPES[args.dtype])
    ids = torch.randint(3, ours.cfg.vocab_size, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(0))
    prompts = [Prompt(row, f"bench:{i}", "", {}) for i, row in enumerate(ids.tolist())]
    rows, n = args.prompts * args.samples, args.new_tokens

    def run_lmforge(max_batch: int, new_tokens: int = n):
        cfg = RolloutConfig(n=args.samples, max_new_tokens=new_tokens, stop_token_ids=[], max_batch=max_batch)
        groups = sample_rollouts(ours, None, prompts, cfg, RolloutState(cfg.seed, len(prompts)), len(prompts))
        flat = [r for g in groups for r in g]
        assert len(flat) == rows and all(len(r.response_ids) == new_tokens for r in flat)
        rollout_batch(flat, 0)

    @torch.inference_mode()
    def run_transformers(new_tokens: int = n):
        out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, do_sample=True,
                              num_return_sequences=args.samples, temperature=1.0, top_k=0, top_p=1.0)
        assert out.shape == (rows, args.prompt_len + new_tokens)

    sides = {f"lmforge_max_batch_{b}": (lambda b=b: run_lmforge(b)) for b in args.max_batch}
    sides["transformers"] = run_transformers
    run_lmforge(args.max_batch[0], new_tokens=2)  # warm-ups: lmforge builds its decoding layout on its first call
    run_transformers(new_tokens=2)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            print(f"  {name}: {rows * n / times[name][-1]:.1f} tokens/s ({times[name][-1]:.1f} s)", flush=True)
    tps = {name: rows * n / min(t) for name, t in times.items()}
    peer = tps["transformers"]
    return {"tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
            "ratio": {k: round(v / peer, 3) for k, v in tps.items() if k != "transformers"},
            "times_s": {k: [round(t, 3) for t in v] for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--model", nargs="+", default=[], metavar="KEY=VALUE", help="model fields over the preset's")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-batch", type=int, nargs="+", default=[RolloutConfig.max_batch],
                        help="lmforge's rows decoding together (each value measured; default: rollout.max_batch's)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and shape (tests/test_benchmarks.py)")
    parser.add_argument("--out", default="benchmarks/results/rollout.json")
    argv = sys.argv[1:]
    args = parser.parse_args([*SMOKE, *argv] if "--smoke" in argv else argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    started, load_before = now(), os.getloadavg()
    figures = measure(args)
    load_after = os.getloadavg()
    result = {
        "benchmark": "rollout",
        "date": started,
        "command": command("rollout.py", None),
        "commit": commit(),
        "machine": {**machine(), "transformers": transformers.__version__},
        "model": {"preset": args.preset, "overrides": args.model, "params": model_config(args).num_params(),
                  "init": "random (seed 0)", "dtype": args.dtype},
        "shape": {"prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
                  "prompt_len": args.prompt_len},
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "figure": "generated tokens per second, whole call (lmforge: rollouts with log-probs + the padded batch; "
                  "transformers: generate's token ids), best of repeats",
        "target_ratio": TARGET,
        **figures,
        "load_average_1m": {"before": round(load_before[0], 2), "after": round(load_after[0], 2)},
    }
    print(f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, {args.dtype}")
    print(f"{'side':>24} {'tokens/s':>10} {'ratio':>6}")
    for name, value in figures["tokens_per_s"].items():
        ratio = figures["ratio"].get(name)
        print(f"{name:>24} {value:>10.1f} {'' if ratio is None else f'{ratio:.2f}':>6}")
    print(f"target ratio >= {TARGET}; load average {load_before[0]:.1f} -> {load_after[0]:.1f} on "
          f"{os.cpu_count()} CPUs ({result['machine']['cpu']}, {torch.get_num_threads()} threads)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
