"""Pre-training step throughput: lmforge against transformers' LlamaForCausalLM, side by side.

    python benchmarks/train_step.py                       # CPU: 6 layers, width 384, seq 256, batch 8
    python benchmarks/train_step.py --device cuda --preset gpt2-124m --batch 16 --seq 1024 --compile
    python benchmarks/train_step.py --device cuda --preset llama3-1b --batch 4 --seq 2048 --compile --peer none
    python benchmarks/train_step.py --preset llama3-1b --model d_model=64 n_layers=2 n_heads=4 n_kv_heads=1 \
        --batch 2 --seq 32 --rounds 1 --steps 1          # smoke run: the preset's architecture, tiny

Both models have the same configuration and weights; each step is forward, backward,
gradient clipping at 1.0 and a fused AdamW step on the same batch, under the same dtype
policy and thread count (on a CPU without AMX lmforge's bf16 attention runs on fp32
upcasts, ``lmforge.model.transformer.attend``; the peer's runs PyTorch's bf16 kernel).
Runs alternate and the best median-of-steps is kept. MFU counts 6N + 12·L·H·Dh·T FLOPs
per token against the measured matmul peak (CPU; cached by `lmforge bench peak`) or the
data-sheet peak (GPU). The JSON is rewritten after every round, so a run stopped part-way
(e.g. by a time limit) keeps the rounds it finished.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from record import command, commit, machine, now

from lmforge.core.config import load_config
from lmforge.model.config import ModelConfig
from lmforge.model.families import build as build_model
from lmforge.model.hf import hf_config_dict, state_dict_to_hf
from lmforge.model.transformer import Transformer
from lmforge.objectives.clm import CausalLMObjective
from lmforge.train.forward import DTYPES, autocast_context
from lmforge.train.metrics import peak_flops, peak_memory_bytes, utilization
from lmforge.train.optim import build_adamw
from lmforge.train.step import StepRunner


def hf_model(cfg: ModelConfig, ours: Transformer, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = hf_config_dict(cfg)
    for key in ("architectures", "model_type", "torch_dtype", "dtype"):
        d.pop(key, None)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**d, attn_implementation="sdpa"))
    model.load_state_dict(state_dict_to_hf(ours.state_dict(), cfg), strict=False)
    if cfg.tie_embeddings:
        model.tie_weights()
    return model


def make_steps(cfg: ModelConfig, batch: torch.Tensor, precision: str, device: torch.device, compile_: bool,
               peer_name: str) -> dict:
    """A zero-argument training step for lmforge (the loop's own ``StepRunner.run_step``) and for the peer."""
    torch.manual_seed(0)
    with torch.device(device):
        ours = build_model(cfg)
    peer = hf_model(cfg, ours, device) if peer_name == "transformers" else None
    ours_opt = build_adamw(ours, 1e-4, (0.9, 0.95), 1e-8, 0.1)
    runner = StepRunner(ours, CausalLMObjective(), ours_opt, precision, 1.0, compile=compile_)
    steps = {"lmforge": lambda: runner.run_step([batch])}
    if peer is not None:
        peer_params = list(peer.parameters())
        peer_opt = build_adamw(peer, 1e-4, (0.9, 0.95), 1e-8, 0.1)

        def peer_step() -> None:
            with autocast_context(device, precision):
                loss = peer(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss  # HF shifts labels itself
            loss.backward()
            torch.nn.utils.clip_grad_norm_(peer_params, 1.0)
            peer_opt.step()
            peer_opt.zero_grad(set_to_none=True)

        steps["transformers"] = peer_step
    return steps


def time_steps(step, n_steps: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(n_steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def result_rows(precision: str, best: dict[str, float], tokens: int, flops_per_token: int, peak: float | None) -> list[dict]:
    return [{"precision": precision, "model": name, "step_s": round(t, 4), "tokens_per_s": round(tokens / t, 1),
             "mfu": float(f"{mfu:.4g}") if (mfu := utilization(flops_per_token * tokens / t, peak)) is not None else None}
            for name, t in best.items()]


def ratios_of(rows: list[dict]) -> dict[str, float]:
    ratios = {}
    for precision in dict.fromkeys(row["precision"] for row in rows):
        r = {row["model"]: row for row in rows if row["precision"] == precision}
        if "lmforge" in r and "transformers" in r:
            ratios[precision] = round(r["lmforge"]["tokens_per_s"] / r["transformers"]["tokens_per_s"], 3)
    return ratios


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model", nargs="+", default=[], metavar="KEY=VALUE",
                   help="model fields set over the preset's (e.g. d_model=64 n_layers=2 for a smoke run)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round (after 2 warm-up steps)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="compile lmforge's forward + loss (train.compile=true)")
    p.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    p.add_argument("--out", default=None, help="JSON output (default benchmarks/results/train_step_<device>.json)")
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")

    device = torch.device(args.device)
    precisions = args.dtypes.split(",")
    cfg = load_config(ModelConfig, None, [f"preset={args.preset}", f"max_seq_len={max(args.seq, 256)}", *args.model])
    flops_per_token = cfg.flops_per_token(args.seq)
    tokens = args.batch * args.seq
    out = Path(args.out or f"benchmarks/results/train_step_{device.type}.json")
    result = {
        "benchmark": "train_step",
        "date": now(),
        "command": command("train_step.py", None),
        "commit": commit(),
        "machine": machine(device),
        "config": {"preset": args.preset, "model_overrides": args.model, "batch": args.batch, "seq": args.seq,
                   "compile": args.compile, "params": cfg.num_params(), "flops_per_token": flops_per_token,
                   "rounds": args.rounds, "steps": args.steps},
        "rows": [],
        "ratio_lmforge_over_transformers": {},
        "rounds_done": {},
        "peak_memory_bytes": None,
        "targets": {"bf16_ratio": 1.25, "bf16_mfu": 0.55} if device.type == "cpu" else {"mfu_1b": 0.45},
        "peak_flops": {pr: peak_flops(device, DTYPES[pr], measure_if_missing=False) for pr in precisions},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    rows: list[dict] = []
    for precision in precisions:
        peak = peak_flops(device, DTYPES[precision])
        steps = make_steps(cfg, batch, precision, device, args.compile, args.peer)
        best = {name: float("inf") for name in steps}
        for done in range(1, args.rounds + 1):
            for name, step in steps.items():
                time_steps(step, 2, device)  # warm-up (and compilation)
                best[name] = min(best[name], statistics.median(time_steps(step, args.steps, device)))
            # rewritten every round: a run cut short keeps what it measured
            partial = rows + result_rows(precision, best, tokens, flops_per_token, peak)
            result.update(rows=partial, ratio_lmforge_over_transformers=ratios_of(partial),
                          peak_memory_bytes=peak_memory_bytes(device))
            result["rounds_done"][precision] = done
            out.write_text(json.dumps(result, indent=2) + "\n")
        rows += result_rows(precision, best, tokens, flops_per_token, peak)
        del steps
    print(f"{'precision':<10}{'model':<14}{'step s':>9}{'tokens/s':>11}{'MFU':>8}")
    for row in rows:
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-"
        print(f"{row['precision']:<10}{row['model']:<14}{row['step_s']:>9.3f}{row['tokens_per_s']:>11.0f}{mfu:>8}")
    for precision, ratio in result["ratio_lmforge_over_transformers"].items():
        print(f"{precision}: lmforge / transformers = {ratio:.3f}")
    print(f"peak memory {result['peak_memory_bytes'] / 2**30:.2f} GiB "
          f"({'allocated on the GPU' if device.type == 'cuda' else 'resident'}); wrote {out}")


if __name__ == "__main__":
    main()
