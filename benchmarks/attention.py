"""Training attention on the CPU: PyTorch's 16-bit flash-attention kernel against lmforge's ``attend``.

    python benchmarks/attention.py                          # results/attention.json
    python benchmarks/attention.py --shapes 2x4x1x16x16 --repeats 1   # smoke run

``lmforge.model.transformer.attend`` runs 16-bit attention over whole sequences in float32 (on
the same values, upcast) on a CPU without AMX. This measures why: forward plus backward of causal
``F.scaled_dot_product_attention`` on bf16/fp16 tensors, as the peer (what transformers'
``sdpa`` attention and autocast run), against ``attend`` on the same tensors, side by side,
alternating, best median of --repeats rounds. Shapes are BxHxKVxTxD (batch, query heads,
key/value heads, sequence, head dim); the first is the train_step benchmark's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from record import command, commit, machine, now

from lmforge.model.transformer import CPU_HAS_AMX, attend

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = ["8x6x6x256x64", "2x6x6x1024x64", "1x32x8x2048x64", "4x12x12x512x64"]


def peer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attend(q, k, v, None, True)


def time_round(fn, tensors: tuple[torch.Tensor, ...], grad: torch.Tensor, steps: int) -> float:
    times = []
    for _ in range(steps):
        for t in tensors:
            t.grad = None
        t0 = time.perf_counter()
        fn(*tensors).backward(grad)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=SHAPES, metavar="BxHxKVxTxD")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16"])
    p.add_argument("--steps", type=int, default=5, help="timed forward+backward passes per round")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; the best median is kept")
    p.add_argument("--out", default="benchmarks/results/attention.json")
    args = p.parse_args()

    started, rows = now(), []
    for shape in args.shapes:
        B, H, KV, T, D = (int(x) for x in shape.split("x"))
        for name in args.dtypes:
            dtype = DTYPES[name]
            torch.manual_seed(0)
            q = torch.randn(B, H, T, D, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(B, KV, T, D, dtype=dtype, requires_grad=True) for _ in range(2))
            grad = torch.randn(B, H, T, D, dtype=dtype)
            best = {"sdpa": float("inf"), "attend": float("inf")}
            for _ in range(args.repeats):
                for label, fn in (("sdpa", peer), ("attend", ours)):
                    time_round(fn, (q, k, v), grad, 1)  # warm-up
                    best[label] = min(best[label], time_round(fn, (q, k, v), grad, args.steps))
            rows.append({"shape": shape, "dtype": name, "sdpa_ms": round(1e3 * best["sdpa"], 3),
                         "attend_ms": round(1e3 * best["attend"], 3),
                         "speedup": round(best["sdpa"] / best["attend"], 3)})
            print(f"{shape:<18}{name:<6}sdpa {rows[-1]['sdpa_ms']:>9.2f} ms   attend {rows[-1]['attend_ms']:>9.2f} ms"
                  f"   {rows[-1]['speedup']:.2f}x")
    result = {
        "benchmark": "attention",
        "date": started,
        "command": command("attention.py", None),
        "commit": commit(),
        "figure": "forward + backward of causal attention, ms, best median of rounds",
        "cpu_has_amx": CPU_HAS_AMX,
        "rows": rows,
        "machine": machine(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
