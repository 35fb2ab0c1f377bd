"""A smaller KV cache, side by side: bytes per token, decode tokens/s and held-out perplexity at
1024-token contexts for each way of storing the cache (``kv_cache_dtype``: fp32, bf16, int8, int4),
for grouped-query attention, for a sliding window, and a row for a latent (MLA) cache.

    .venv/bin/python benchmarks/kv_cache.py            # trains its model first (once), then measures
    .venv/bin/python benchmarks/kv_cache.py --quick    # a smoke run: a tiny model, a few steps (~40 s)
    .venv/bin/python scripts/write_benchmark_docs.py   # then its table into docs/serving.md

The model is trained here, briefly, on the demo corpus (data/pretrain/: a 2048-token BPE, shards,
then ``lmforge pretrain recipes/demo/pretrain.yaml`` narrowed to 4 layers of 2 heads of 64 at
``max_seq_len`` 1024: 240 steps of one 1024-token window); a finished run under --runs is reused,
and one stopped short of its steps by ``train.max_minutes`` is resumed (``train.resume=auto``) until done.
On 2 cores shared with other work (load average 5-8) the training took 13 min (stopped once at
8 min and resumed) and the measuring 6 min of wall time for 2.5 min of CPU time. Each row:

- bytes per token: of one position of one row over every layer, from the cache's tensors
  (``KVCache.bytes_per_token``: keys, values, and a quantised cache's scales and minima);
  ``at 1024``: a row's whole cache at 1024 positions (a ring holds only its window);
- perplexity: exp of the mean next-token NLL over held-out 1024-token windows (the validation
  split, never trained on), each window one cached forward: every key and value attention reads
  comes back from the cache, rounded as stored (a query reads the rounded keys of its own step
  too, so this is what token-by-token decoding would score); beside it, how far each row's
  predictions are from the fp32 cache's on the same windows: the mean KL divergence (nats per
  prediction) and the largest change of a log-probability;
- decode tokens/s: ``--batch`` rows, a prefill of 1024 - ``--new-tokens`` tokens, then ``--new-tokens``
  greedy decode steps on the engine's decoding layout, best of ``--repeats``; the model in
  float32, so only the cache's storage differs between rows. The machine is shared with other
  work: timings are noisy (the load average before and after is in the JSON).

The GQA row is its own model of the same width with one KV head, and the MLA row (``kind: latent``) its own
model of multi-head latent attention of the same width (the ``deepseek_v3`` family, every layer dense; a
latent of d_model/4 and a RoPE key of head_dim/4 per layer, DeepSeek-V2-Lite's latent ratio), whose cache
stores only those two per token and decodes in the absorbed form: each trained exactly as the multi-head
model, on the same windows (``VARIANTS``), so their perplexities compare the architectures, and their
divergence from the fp32 cache (another model's) is not given. The sliding-window row is the trained
multi-head model (full attention in training) decoding with a window of ``--window`` positions into a
ring: bytes per token as bf16, but memory flat past the window.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
from record import header, load_average, now, write_result

from lmforge.checkpoints.load import load_model
from lmforge.data.shards import open_shards
from lmforge.inference.engine import decode_step, decoding_view, prefill
from lmforge.model.families import build as build_model
from lmforge.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/kv_cache.json"
CONTEXT = 1024
STORAGE = ("fp32", "bf16", "int8", "int4")  # the storage rows, fp32 (the model's dtype here) the reference
MODEL = ["model.vocab_size=2048", "model.d_model=128", "model.n_heads=2", "model.n_kv_heads=2", "model.n_layers=4",
         "model.ffn_hidden=384", f"model.max_seq_len={CONTEXT}"]
TRAIN = [f"data.seq_len={CONTEXT}", "train.micro_batch_size=1", "train.batch_tokens=1024", "train.max_steps=240",
         "train.warmup_steps=10", "train.lr=3e-3", "train.eval_every=240", "train.eval_batches=16", "train.log_every=20",
         "train.checkpoint_every=240", "train.compile=false", "train.max_minutes=8"]
# the models the table compares, each trained alike on the same windows: the multi-head model (its cache
# stored four ways, and decoding with a window), grouped-query attention of one KV head, and multi-head latent
# attention of the same width (family deepseek_v3, every layer dense: a latent of d_model/4 and a RoPE key of
# head_dim/4 per layer, DeepSeek-V2-Lite's latent ratio; heads of head_dim for queries, keys and values)
VARIANTS = {"pretrain": [], "gqa": ["model.n_kv_heads=1"],
            "mla": ["model.family=deepseek_v3", "model.kv_lora_rank=32", "model.qk_rope_head_dim=16",
                    "model.qk_nope_head_dim=48", "model.v_head_dim=64", "model.moe.first_dense_layers=4"]}
QUICK_TRAIN = ["data.seq_len=256", "model.max_seq_len=256", "train.micro_batch_size=2", "train.batch_tokens=null",
               "train.max_steps=3", "train.warmup_steps=1", "train.eval_every=3", "train.eval_batches=1",
               "train.log_every=1", "train.checkpoint_every=3", "train.compile=false"]


# ---------------------------------------------------------------------------------- the model


def lmforge(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "lmforge.cli.main", *argv], cwd=REPO, check=True)


def trained_model(runs: Path, quick: bool, variant: str = "pretrain") -> tuple[Path, Path]:
    """A ``VARIANTS`` model's pretrain run and the prepared data: tokenizer, shards and a short pre-training, each
    skipped when done."""
    tokenizer, data, pretrain = runs / "tokenizer", runs / "data", runs / variant
    if not (tokenizer / "tokenizer.json").is_file():
        lmforge("tokenizer", "recipes/demo/tokenizer.yaml", f"run_dir={tokenizer}", "tokenizer.vocab_size=2048",
                *(["data.paths=[data/pretrain/milton.jsonl]"] if quick else []))
    if not (data / "manifest.json").is_file():
        paths = "data/pretrain/milton.jsonl" if quick else "data/pretrain/*.jsonl"
        lmforge("prepare", "recipes/demo/prepare.yaml", f"run_dir={data}", f"tokenizer={tokenizer}", f"data.paths=[{paths}]")
    train = QUICK_TRAIN if quick else TRAIN
    steps = int(next(a for a in reversed(train) if a.startswith("train.max_steps=")).split("=")[1])
    summary = pretrain / "summary.json"
    before = -1
    while True:  # not trained, or stopped at train.max_minutes: resume until it has its steps
        done = json.loads(summary.read_text()).get("step", 0) if summary.is_file() else None
        if done is not None and done >= steps:
            return pretrain, data
        if done is not None and done <= before:
            raise RuntimeError(f"{pretrain} stays at step {done} of {steps} when resumed; see its log")
        before = -1 if done is None else done
        lmforge("pretrain", "recipes/demo/pretrain.yaml", f"run_dir={pretrain}", f"tokenizer={tokenizer}",
                f"data.datasets=[{{path: {data}, weight: 1.0}}]", *MODEL, *VARIANTS[variant], *train,
                *(["train.resume=auto"] if done is not None else []))


def heldout_windows(data: Path, n: int, length: int) -> torch.Tensor:
    """(n, length + 1) consecutive tokens of the validation split, windows side by side from its start."""
    shards = open_shards(data, "val")
    tokens = torch.cat([torch.from_numpy(s.tokens[:].astype("int64")) for s in shards])
    n = min(n, (len(tokens) - 1) // length)
    return torch.stack([tokens[i * length : i * length + length + 1] for i in range(n)])


# ---------------------------------------------------------------------------------- the figures


@torch.inference_mode()
def window_logprobs(model: Transformer, windows: torch.Tensor, kind: str, batch: int = 4) -> torch.Tensor:
    """(N, length, vocab) float32 next-token log-probabilities of the windows (N, length + 1), each
    window one cached forward into a ``kind`` cache."""
    out = []
    for rows in windows.split(batch):
        x = rows[:, :-1]
        cache = model.new_kv_cache(len(rows), x.shape[1], torch.float32, "cpu", kind)
        out.append(torch.log_softmax(model(x, kv_cache=cache).float(), dim=-1))
    return torch.cat(out)


def perplexity(logprobs: torch.Tensor, windows: torch.Tensor) -> float:
    """exp(mean next-token NLL) of the windows' targets under ``logprobs``."""
    return math.exp(-float(logprobs.gather(-1, windows[:, 1:, None]).mean()))


def divergence(logprobs: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference || this) in nats per prediction, and the largest |log-probability| change."""
    kl = (reference.exp() * (reference - logprobs)).sum(dim=-1).mean()
    return float(kl), float((reference - logprobs).abs().max())


@torch.inference_mode()
def decode_tokens_per_s(model: Transformer, kind: str, args: argparse.Namespace) -> float:
    """Greedy decode steps per second times rows, after a prefill to ``context - new_tokens`` tokens."""
    net = decoding_view(model)
    length = model.cfg.max_seq_len - args.new_tokens
    prompts = torch.randint(3, model.cfg.vocab_size, (args.batch, length), generator=torch.Generator().manual_seed(0))
    best = math.inf
    for _ in range(args.repeats):
        batch = prefill(net, prompts.tolist(), args.new_tokens, kv_cache_dtype=kind)
        t0 = time.perf_counter()
        for _ in range(args.new_tokens):
            decode_step(net, batch.logits.argmax(dim=-1), batch)
        best = min(best, time.perf_counter() - t0)
    return args.batch * args.new_tokens / best


def cache_figures(model: Transformer, kind: str, context: int) -> dict:
    cache = model.new_kv_cache(1, context, torch.float32, "cpu", kind)
    return {"bytes_per_token": cache.bytes_per_token(), "cache_bytes_at_context": cache.nbytes(),
            "capacity": cache.capacity}


def with_config(model: Transformer, **fields) -> Transformer:
    """The same weights under a config with ``fields`` changed (a window the model was not trained with)."""
    other = build_model(dataclasses.replace(model.cfg, **fields)).eval()
    other.load_state_dict(model.state_dict())
    return other


def scored(model: Transformer, windows: torch.Tensor, kind: str, reference: torch.Tensor | None) -> dict:
    """Perplexity of the windows over a ``kind`` cache, and how far its predictions are from ``reference``'s."""
    logprobs = window_logprobs(model, windows, kind)
    kl, worst = divergence(logprobs, reference) if reference is not None else (0.0, 0.0)
    return {"perplexity": perplexity(logprobs, windows), "kl_to_fp32": kl, "max_logprob_change": worst}


OTHER_MODEL = {"kl_to_fp32": None, "max_logprob_change": None}  # another model's predictions: no divergence from fp32's


def rows_of(model: Transformer, windows: torch.Tensor, args: argparse.Namespace, gqa: Transformer,
            mla: Transformer) -> list[dict]:
    context = model.cfg.max_seq_len
    reference = window_logprobs(model, windows, "fp32")
    rows = []
    for kind in STORAGE:
        rows.append({"kind": "storage", "name": kind, "kv_cache_dtype": kind, **cache_figures(model, kind, context),
                     **scored(model, windows, kind, reference),
                     "decode_tokens_per_s": decode_tokens_per_s(model, kind, args)})
    rows.append({"kind": "gqa", "name": f"GQA, {gqa.cfg.n_kv_heads} KV head of {gqa.cfg.n_heads}", "kv_cache_dtype": "bf16",
                 **cache_figures(gqa, "bf16", context), **scored(gqa, windows, "bf16", None), **OTHER_MODEL,
                 "decode_tokens_per_s": decode_tokens_per_s(gqa, "bf16", args),
                 "note": "its own model, trained alike on the same windows"})
    window = min(args.window, context)
    slid = with_config(model, sliding_window=window)
    rows.append({"kind": "sliding_window", "name": f"sliding window {window}", "kv_cache_dtype": "bf16",
                 **cache_figures(slid, "bf16", context), **scored(slid, windows, "bf16", reference),
                 "decode_tokens_per_s": decode_tokens_per_s(slid, "bf16", args),
                 "note": "the full-attention model decoding with a window it was not trained with"})
    rows.append({"kind": "latent", "name": "MLA latent cache", "kv_cache_dtype": "bf16", **cache_figures(mla, "bf16", context),
                 **scored(mla, windows, "bf16", None), **OTHER_MODEL, "decode_tokens_per_s": decode_tokens_per_s(mla, "bf16", args),
                 "note": f"its own model (latent {mla.cfg.kv_lora_rank} + RoPE key {mla.cfg.qk_rope_head_dim} per layer), "
                         "trained alike on the same windows"})
    bf16 = next(r for r in rows if r["name"] == "bf16")["bytes_per_token"]
    for r in rows:
        r["bytes_vs_bf16"] = None if r["bytes_per_token"] is None else round(r["bytes_per_token"] / bf16, 4)
        for key, digits in (("perplexity", 4), ("decode_tokens_per_s", 1), ("kl_to_fp32", 8), ("max_logprob_change", 5)):
            r[key] = None if r[key] is None else round(r[key], digits)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="runs/kv_cache", help="where the tokenizer, shards and model are made")
    parser.add_argument("--windows", type=int, default=16, help="held-out windows of the context scored")
    parser.add_argument("--window", type=int, default=256, help="the sliding-window row's window")
    parser.add_argument("--batch", type=int, default=4, help="rows decoding together in the speed figure")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps timed after the prefill")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few steps, a 256-token context")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started, load_before = now(), load_average()
    runs = Path(args.runs) / ("quick" if args.quick else "")
    pretrain, data = trained_model(runs, args.quick)
    model, checkpoint = load_model(str(pretrain), device="cpu")
    model = model.float().eval()
    gqa, mla = (load_model(str(trained_model(runs, args.quick, v)[0]), device="cpu")[0].float().eval() for v in ("gqa", "mla"))
    windows = heldout_windows(data, args.windows, model.cfg.max_seq_len)
    rows = rows_of(model, windows, args, gqa, mla)
    summary = json.loads((pretrain / "summary.json").read_text())
    cfg = model.cfg
    result = {
        **header("kv_cache", "kv_cache.py", argv, started),
        "model": {"checkpoint": str(checkpoint), "params": cfg.num_params(), "n_layers": cfg.n_layers,
                  "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                  "vocab_size": cfg.vocab_size, "steps": summary.get("step"), "val_loss": summary.get("val_loss")},
        "context": cfg.max_seq_len, "windows": len(windows), "decode": {"batch": args.batch, "new_tokens": args.new_tokens,
                                                                      "repeats": args.repeats, "threads": args.threads},
        "load_average": [load_before, load_average()],
        "figure": "bytes per token of the KV cache, held-out perplexity and decode tokens/s for each way of storing it",
        "rows": rows,
    }
    print(f"{'row':<28} {'bytes/token':>11} {'vs bf16':>7} {'ppl':>9} {'KL to fp32':>10} {'decode tok/s':>12}")
    for r in rows:
        print(f"{r['name']:<28} {r['bytes_per_token'] or '-':>11} {r['bytes_vs_bf16'] or '-':>7} "
              f"{r['perplexity'] or '-':>9} {r['kl_to_fp32'] if r['kl_to_fp32'] is not None else '-':>10} "
              f"{r['decode_tokens_per_s'] or '-':>12}")
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
