"""Fine-tuning cost of full, LoRA and QLoRA training of the same model, side by side; and, with
``--lowbit``, LoRA over bases of 4, 3 and 2 bits on the demo's SFT.

    python benchmarks/finetune.py                         # tiny preset (17M), batch 4 x 256, bf16 autocast
    python benchmarks/finetune.py --precision fp32 --batch 8
    python benchmarks/finetune.py --model n_layers=1 --batch 1 --seq 16 --steps 1 --rounds 1   # smoke run
    python benchmarks/finetune.py --lowbit                # results/finetune_lowbit.json (needs make demo's base)

Each mode runs in its own child process (so peak memory is that mode's alone) with the
same model, batch and precision: forward, backward, clip, AdamW on the trainable
parameters. Reported: tokens/s (best median of rounds), peak resident memory (CPU) or
peak allocated memory (GPU), and the bytes held by weights, gradients and optimizer
state. LoRA and QLoRA adapt every attention and MLP projection with r=16, alpha=32; QLoRA's base
is NF4 (``qlora``) or HQQ's 4, 3 or 2-bit integers (``qlora-int4`` ...).

``--lowbit`` runs ``lmforge sft recipes/demo/sft.yaml`` from ``--base`` (``make demo``'s pre-trained
model) with LoRA r=16, alpha=32 (the demo's LoRA command, lr 3e-3) for ``--sft-steps`` steps over
each base: full precision, NF4, and HQQ's int4, int3, int2 (groups of ``--group-size``), each
quantised base with the standard init (B = 0) and with LoftQ (``lora.init: loftq``). Recorded per
row: the frozen base's bytes (every weight but the adapters) and the adapted weights' bits, the
validation loss before training (on the quantised base with its adapters: LoftQ's start shows
here) and after, held-out exact match after (before, it is the full-precision base's, the same
for every row), and the run's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("full", "lora", "qlora", "qlora-int4", "qlora-int3", "qlora-int2")  # qlora: NF4; then HQQ's, groups of 64
# (row, lora.quantize_base, lora.init)
LOWBIT_ROWS = [("full precision", "false", "kaiming"), *((f, f, "kaiming") for f in ("nf4", "int4", "int3", "int2")),
               *((f"{f} + LoftQ", f, "loftq") for f in ("nf4", "int4", "int3", "int2"))]
LOWBIT_RESULTS = "benchmarks/results/finetune_lowbit.json"


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
        base = {"lora": False, "qlora": "nf4"}.get(args.mode, args.mode.removeprefix("qlora-"))
        apply_lora(model, LoraConfig(r=16, alpha=32, quantize_base=base))
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


def lowbit(args: argparse.Namespace) -> None:
    from record import header, now, write_result

    from lmforge.checkpoints.load import load_model
    from lmforge.core.config import load_config
    from lmforge.peft.lora import apply_lora
    from lmforge.peft.quant import base_memory
    from lmforge.stages.sft import SFTRecipe, run_sft

    started, rows = now(), []
    for name, fmt, init in [row for row in LOWBIT_ROWS if not args.rows or row[0] in args.rows]:
        slug = name.replace(" + ", "-").replace(" ", "-").lower()
        lora = f"lora={{r: 16, alpha: 32, quantize_base: {fmt}, init: {init}, group_size: {args.group_size}}}"
        recipe = load_config(SFTRecipe, Path(args.recipe), [
            f"checkpoint={args.base}", f"run_dir={Path(args.runs) / slug}", lora, "train.lr=3e-3",
            f"train.max_steps={args.sft_steps}", f"train.eval_every={args.sft_steps}",
            f"train.checkpoint_every={args.sft_steps}", *args.set])
        summary = run_sft(recipe)
        model, _ = load_model(args.base)
        apply_lora(model, recipe.lora)  # the same base and adapters, to measure what the run held
        memory = base_memory(model)
        before, after = summary["before"], summary["after"]
        rows.append({"row": name, "quantize_base": fmt, "init": init, **memory,
                     "val_loss_before": before.get("val_loss"), "val_loss_after": after.get("val_loss"),
                     "exact_match_before": before.get("exact_match", {}).get("exact_match"),
                     "exact_match_after": after.get("exact_match", {}).get("exact_match"),
                     "examples_scored": after.get("exact_match", {}).get("examples"),
                     "tokens_per_s": round(summary["tokens_per_s"], 1), "steps": summary["step"]})
        r = rows[-1]
        print(f"{name:<16}{r['base_bytes'] / 2**20:>9.1f} MB{r['bits_per_adapted_weight']:>7.2f} bits"
              f"  val {r['val_loss_before']:.4f} -> {r['val_loss_after']:.4f}  exact {r['exact_match_after']}"
              f"  {r['tokens_per_s']:.0f} tok/s", flush=True)
    config = {"base": str(args.base), "recipe": args.recipe, "sft_steps": args.sft_steps, "group_size": args.group_size,
              "r": 16, "alpha": 32, "lr": 3e-3, "set": args.set, "rows": args.rows}
    write_result({**header("finetune_lowbit", "finetune.py", None, started), "config": config, "rows": rows},
                 Path(args.out or LOWBIT_RESULTS))


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
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the modes to measure (full first)")
    p.add_argument("--out", help=f"results JSON (default benchmarks/results/finetune.json; --lowbit: {LOWBIT_RESULTS})")
    p.add_argument("--lowbit", action="store_true", help="the low-bit bases table on the demo's SFT instead")
    p.add_argument("--base", default="runs/demo/pretrain", help="--lowbit: the model fine-tuned (make demo's)")
    p.add_argument("--recipe", default="recipes/demo/sft.yaml", help="--lowbit: the SFT recipe")
    p.add_argument("--sft-steps", type=int, default=80, help="--lowbit: optimizer steps of each run")
    p.add_argument("--group-size", type=int, default=64, help="--lowbit: int4/int3/int2 weights per group")
    p.add_argument("--runs", default="runs/finetune_lowbit", help="--lowbit: where the runs write")
    p.add_argument("--set", nargs="*", default=[], help="--lowbit: more dotted overrides of every run")
    p.add_argument("--rows", nargs="*", choices=[r[0] for r in LOWBIT_ROWS], help="--lowbit: only these rows")
    args = p.parse_args()
    if args.lowbit:
        lowbit(args)
        return
    args.out = args.out or "benchmarks/results/finetune.json"
    if args.mode:
        print(json.dumps(child(args)))
        return
    from record import command, commit, machine, now  # torch: in this parent only, not in each mode's child

    started, rows = now(), []
    for mode in args.modes:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"the {mode} run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    full = rows[0]
    print(f"{'mode':<11}{'tokens/s':>10}{'vs full':>9}{'peak MB':>10}{'weights MB':>12}{'trainable':>12}{'optim MB':>10}")
    for r in rows:
        r["speed_vs_full"] = round(r["tokens_per_s"] / full["tokens_per_s"], 3)
        r["peak_memory_vs_full"] = round(r["peak_memory_bytes"] / full["peak_memory_bytes"], 3)
        print(f"{r['mode']:<11}{r['tokens_per_s']:>10.0f}{r['speed_vs_full']:>9.2f}{r['peak_memory_bytes'] / 2**20:>10.0f}"
              f"{r['weights_and_buffers_bytes'] / 2**20:>12.1f}{r['trainable_params']:>12,}{r['optimizer_state_bytes'] / 2**20:>10.1f}")
    result = {
        "benchmark": "finetune",
        "date": started,
        "command": command("finetune.py", None),
        "commit": commit(),
        "machine": machine(args.device),
        "config": {k: v for k, v in vars(args).items() if k in ("preset", "model", "batch", "seq", "precision", "device",
                                                                "steps", "rounds")},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
