"""Fine-tuning cost of full, LoRA and QLoRA training of the same model, side by side.

    python benchmarks/finetune.py                         # tiny preset (17M), batch 4 x 256, bf16 autocast
    python benchmarks/finetune.py --precision fp32 --batch 8
    python benchmarks/finetune.py --model n_layers=1 --batch 1 --seq 16 --steps 1 --rounds 1   # smoke run

Each mode runs in its own child process (so peak memory is that mode's alone) with the
same model, batch and precision: forward, backward, clip, AdamW on the trainable
parameters. Reported: tokens/s (best median of rounds), peak resident memory (CPU) or
peak allocated memory (GPU), and the bytes held by weights, gradients and optimizer
state. LoRA and QLoRA adapt every attention and MLP projection with r=16, alpha=32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("full", "lora", "qlora")


def child(args: argparse.Namespace) -> dict:
    import torch

    from lmforge.core.config import load_config
    from lmforge.model.config import ModelConfig
    from lmforge.model.families import build as build_model
    from lmforge.objectives.clm import CausalLMObjective
    from lmforge.peft.lora import LoraConfig, apply_lora
    from lmforge.train.metrics import peak_memory_bytes
    from lmforge.train.optim import build_adamw
    from lmforge.train.step import StepRunner

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = load_config(ModelConfig, None, [f"preset={args.preset}", f"max_seq_len={max(256, args.seq)}", *args.model])
    with torch.device(device):
        model = build_model(cfg)
    if args.mode != "full":
        apply_lora(model, LoraConfig(r=16, alpha=32, quantize_base=args.mode == "qlora"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_adamw(model, 1e-4, (0.9, 0.95), 1e-8, 0.0)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    runner = StepRunner(model, CausalLMObjective(), opt, args.precision, 1.0)

    def step() -> None:
        runner.run_step([batch])

    times = []
    for _ in range(2):
        step()
    for _ in range(args.rounds):
        round_times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            round_times.append(time.perf_counter() - t0)
        times.append(statistics.median(round_times))
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    trainable = sum(p.numel() for p in params)
    opt_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return {
        "mode": args.mode,
        "tokens_per_s": round(args.batch * args.seq / min(times), 1),
        "peak_memory_bytes": peak_memory_bytes(device),
        "weights_and_buffers_bytes": weight_bytes,
        "trainable_params": trainable,
        "gradient_bytes": trainable * 4,
        "optimizer_state_bytes": opt_bytes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model", nargs="+", default=[], metavar="KEY=VALUE",
                   help="model fields set over the preset's (QLoRA needs matrices of a multiple of 64 x 256 elements)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", default="benchmarks/results/finetune.json")
    args = p.parse_args()
    if args.mode:
        print(json.dumps(child(args)))
        return
    from record import command, commit, machine, now  # torch: in this parent only, not in each mode's child

    started, rows = now(), []
    for mode in MODES:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"the {mode} run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    full = rows[0]
    print(f"{'mode':<7}{'tokens/s':>10}{'vs full':>9}{'peak MB':>10}{'weights MB':>12}{'trainable':>12}{'optim MB':>10}")
    for r in rows:
        r["speed_vs_full"] = round(r["tokens_per_s"] / full["tokens_per_s"], 3)
        r["peak_memory_vs_full"] = round(r["peak_memory_bytes"] / full["peak_memory_bytes"], 3)
        print(f"{r['mode']:<7}{r['tokens_per_s']:>10.0f}{r['speed_vs_full']:>9.2f}{r['peak_memory_bytes'] / 2**20:>10.0f}"
              f"{r['weights_and_buffers_bytes'] / 2**20:>12.1f}{r['trainable_params']:>12,}{r['optimizer_state_bytes'] / 2**20:>10.1f}")
    result = {
        "benchmark": "finetune",
        "date": started,
        "command": command("finetune.py", None),
        "commit": commit(),
        "machine": machine(args.device),
        "config": {k: v for k, v in vars(args).items() if k not in ("mode", "out")},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
