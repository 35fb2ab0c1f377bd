"""Forgetting in continued pre-training, and how much EWC, self-distillation and replay keep (issue 38's
part (a); LoRA + merge is not a row yet, nor part (b), the demo's SFT).

A model is pre-trained on the bundled prose (Shakespeare and Milton), then continued on the Python docs
for the same number of steps in each setting, from the same weights, on the same windows:

- ``naive``: the continuation alone;
- ``ewc λ=...``: with ``ewc: {fisher, lambda_}``, the Fisher of the prose model on its own training
  windows (``lmforge fisher``, labels sampled from the model: the true Fisher), for several λ;
- ``ewc empirical λ=...``: the same with the empirical Fisher (the data's labels) at one λ;
- ``self-distill α=...``: with ``distill: {teacher, alpha, temperature}``, the prose model as the teacher
  of its own continuation (Hinton's τ²·KL at τ = 2 on the new windows, weight α), for two α;
- ``replay share=...``: with ``data.replay: [{path: <the prose>, share}]``, that share of the
  continuation's windows drawn from the prose again (the same steps and tokens, fewer of them new), for
  several shares.

Recorded per setting: bits per byte on the prose's and the Python docs' validation windows after the
continuation, their change from the prose model (forgetting: the prose's rise; gain: the docs' fall), and
the penalty (EWC) or τ²·KL to the teacher (self-distillation) at the last step; the figure (docs/img/forgetting.png) draws forgetting against gain.

    .venv/bin/python benchmarks/forgetting.py            # ~6 min on one CPU core
    .venv/bin/python benchmarks/forgetting.py --quick --tokenizer T --old SHARDS --new SHARDS   # a smoke run
    .venv/bin/python scripts/write_benchmark_docs.py     # then its table into docs/continual-learning.md

The tokenizer is the µP sweep's (recipes/mup/tokenizer.yaml, 512 tokens over all of data/pretrain), made
once if missing; the two datasets are prepared into runs/forgetting/ once.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from record import header, load_average, now, write_result

from lmforge.checkpoints.load import load_model
from lmforge.core.config import load_config
from lmforge.data.loader import DatasetSource, LoaderConfig, TokenLoader
from lmforge.data.tokenizer import Tokenizer, token_byte_lengths
from lmforge.objectives.clm import causal_lm_loss
from lmforge.stages.fisher import FisherRecipe, run_fisher
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.stages.tokenizer import TokenizerRecipe, run_tokenizer
from lmforge.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = "recipes/mup/tokenizer.yaml"
OLD = ["data/pretrain/shakespeare.jsonl", "data/pretrain/milton.jsonl"]
NEW = ["data/pretrain/python_docs.jsonl"]
RESULTS = "benchmarks/results/forgetting.json"
PLOT = "docs/img/forgetting.png"
LAMBDAS = (1.0, 10.0, 100.0, 1000.0)
EMPIRICAL_LAMBDA = 100.0
DISTILL_ALPHAS = (0.5, 0.9)
DISTILL_TEMPERATURE = 2.0
REPLAY_SHARES = (0.1, 0.25, 0.5)
MODEL = {"model.vocab_size": 512, "model.d_model": 96, "model.n_layers": 2, "model.n_heads": 4,
         "model.n_kv_heads": 2, "model.ffn_hidden": 256, "model.max_seq_len": 128}
QUICK_MODEL = {"model.vocab_size": 512, "model.d_model": 32, "model.n_layers": 1, "model.n_heads": 2,
               "model.n_kv_heads": 1, "model.ffn_hidden": 64, "model.max_seq_len": 64}


def prepared(paths: list[str], run_dir: Path, tokenizer: Path) -> Path:
    """Token shards of ``paths`` in ``run_dir`` (made once)."""
    if not (run_dir / "manifest.json").is_file():
        run_prepare(load_config(PrepareRecipe, None, [f"run_dir={run_dir}", f"tokenizer={tokenizer}",
                                                      f"data.paths=[{', '.join(str(REPO / p) for p in paths)}]",
                                                      "val_fraction=0.05"]))
    return run_dir


def pretrain(run_dir: Path, tokenizer: Path, shards: Path, steps: int, args, **extra) -> Path:
    """A pre-training run (or continuation, with ``init``) of ``steps``; its final checkpoint."""
    seq = 32 if args.quick else 128
    keys = {"run_dir": str(run_dir), "tokenizer": str(tokenizer), **(QUICK_MODEL if args.quick else MODEL),
            "data.datasets": f"[{{path: {shards}}}]", "data.seq_len": seq, "train.max_steps": steps,
            "train.warmup_steps": min(20, steps // 4), "train.micro_batch_size": 8, "train.batch_tokens": 16 * seq,
            "train.lr": 3e-3,
            "train.precision": "fp32", "train.device": "cpu", "train.compile": False, "train.eval_every": 0,
            "train.checkpoint_every": steps, "train.tensorboard": False, "train.log_every": 10, **extra}
    run_pretrain(load_config(PretrainRecipe, None, [f"{k}={v}" for k, v in keys.items()]))
    return load_model(run_dir)[1]


def bits_per_byte(checkpoint: Path, shards: Path, tok: Tokenizer, seq: int, windows: int) -> float:
    """Bits per byte of ``checkpoint`` on the first ``windows`` validation windows of ``shards``."""
    model, _ = load_model(checkpoint)
    token_bytes = torch.tensor(token_byte_lengths(tok) + [0] * (model.cfg.vocab_size - tok.vocab_size))
    loader = TokenLoader(LoaderConfig(datasets=[DatasetSource(str(shards))], seq_len=seq, shuffle=False), 8,
                         split="val", loop=False)
    nats = n_bytes = 0.0
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i * 8 >= windows:
                break
            nats += float(causal_lm_loss(model(batch[:, :-1]), batch[:, 1:]))
            n_bytes += float(token_bytes[batch[:, 1:]].sum())
    return nats / math.log(2) / n_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: a tiny model, a few steps")
    p.add_argument("--steps", type=int, default=None, help="steps of the prose run and of each continuation "
                   "(default 200; --quick 4)")
    p.add_argument("--tokenizer", help="a tokenizer folder (default: recipes/mup/tokenizer.yaml's, made if missing)")
    p.add_argument("--old", help="prepared shards of the first task (default: the prose, prepared once)")
    p.add_argument("--new", help="prepared shards of the second task (default: the Python docs, prepared once)")
    p.add_argument("--runs", help="where the runs write (default runs/forgetting, --quick runs/forgetting_quick)")
    p.add_argument("--out", help=f"results JSON (default {RESULTS}; --quick: <runs>/forgetting.json)")
    p.add_argument("--plot", help=f"the figure (default {PLOT}; --quick: <runs>/forgetting.png)")
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 200)
    args.runs = Path(args.runs or ("runs/forgetting_quick" if args.quick else "runs/forgetting"))
    args.out = Path(args.out or (args.runs / "forgetting.json" if args.quick else RESULTS))
    args.plot = Path(args.plot or (args.runs / "forgetting.png" if args.quick else PLOT))
    return args


def draw_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in result["rows"]:
        ax.scatter(row["gain_bpb"], row["forgetting_bpb"], color="tab:red" if row["setting"] == "naive" else "tab:blue")
        ax.annotate(row["setting"], (row["gain_bpb"], row["forgetting_bpb"]), fontsize=7, xytext=(4, 2),
                    textcoords="offset points")
    ax.set_xlabel("gain on the Python docs (bits per byte, lower loss = right)")
    ax.set_ylabel("forgetting of the prose (bits per byte)")
    ax.set_title("continued pre-training: forgetting against gain")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = now()
    if args.tokenizer is None:
        recipe = load_config(TokenizerRecipe, REPO / TOKENIZER)
        if not (REPO / recipe.run_dir / "tokenizer.json").is_file():
            run_tokenizer(recipe)
        args.tokenizer = str(REPO / recipe.run_dir)
    tokenizer = Path(args.tokenizer)
    old = Path(args.old) if args.old else prepared(OLD, args.runs / "prose", tokenizer)
    new = Path(args.new) if args.new else prepared(NEW, args.runs / "python_docs", tokenizer)
    tok = Tokenizer.load(tokenizer)
    seq, windows = (32, 16) if args.quick else (128, 128)
    loads = [load_average()]
    base = pretrain(args.runs / "base", tokenizer, old, args.steps, args)
    fishers = {}
    for labels in ("sampled", "empirical"):
        out = args.runs / f"fisher-{labels}.safetensors"
        fishers[labels] = run_fisher(load_config(FisherRecipe, None, [
            f"checkpoint={base}", f"data.shards={old}", f"data.seq_len={seq}", f"labels={labels}",
            f"max_tokens={2048 if args.quick else 16384}", f"out={out}"]))
    base_old, base_new = bits_per_byte(base, old, tok, seq, windows), bits_per_byte(base, new, tok, seq, windows)
    settings = [("naive", None, None)] + [(f"ewc λ={lam:g}", "sampled", lam) for lam in LAMBDAS] + [
        (f"ewc empirical λ={EMPIRICAL_LAMBDA:g}", "empirical", EMPIRICAL_LAMBDA)] + [
        (f"self-distill α={alpha:g}", "distill", alpha) for alpha in DISTILL_ALPHAS] + [
        (f"replay share={share:g}", "replay", share) for share in REPLAY_SHARES]
    rows = []
    for setting, labels, lam in settings:
        extra = {"init": str(base)}
        if labels == "distill":  # the prose model teaches its own continuation
            extra["distill"] = f"{{teacher: {base}, alpha: {lam}, temperature: {DISTILL_TEMPERATURE}}}"
        elif labels == "replay":  # the prose drawn again at that share of the continuation's windows
            extra["data.replay"] = f"[{{path: {old}, share: {lam}, name: replay}}]"
        elif labels is not None:
            extra["ewc"] = f"{{fisher: {fishers[labels]['out']}, lambda_: {lam}}}"
        run_dir = args.runs / ("continue-naive" if labels is None else f"continue-{labels}-{lam:g}")
        final = pretrain(run_dir, tokenizer, new, args.steps, args, **extra)
        old_bpb, new_bpb = bits_per_byte(final, old, tok, seq, windows), bits_per_byte(final, new, tok, seq, windows)
        last = [r for r in read_metrics(run_dir) if "loss" in r][-1]
        distilled, replayed = labels == "distill", labels == "replay"
        rows.append({"setting": setting, "fisher": None if distilled or replayed else labels,
                     "lambda": None if distilled or replayed else lam, "distill_alpha": lam if distilled else None,
                     "replay_share": lam if replayed else None, "old_bpb": old_bpb, "new_bpb": new_bpb,
                     "forgetting_bpb": old_bpb - base_old, "gain_bpb": base_new - new_bpb,
                     "final_penalty": last.get("ewc/penalty", last.get("distill/kd")), "final_loss": last["loss"]})
        print(f"{setting:24s} prose {old_bpb:.4f} bpb (forgetting {old_bpb - base_old:+.4f}), python docs "
              f"{new_bpb:.4f} bpb (gain {base_new - new_bpb:+.4f})", flush=True)
        loads.append(load_average())
    naive = rows[0]
    kept = [r for r in rows[1:] if r["gain_bpb"] >= 0.75 * naive["gain_bpb"]]
    best = min(kept, key=lambda r: r["forgetting_bpb"]) if kept else None
    summary = {"naive_forgetting_bpb": naive["forgetting_bpb"], "naive_gain_bpb": naive["gain_bpb"],
               "best_setting": best["setting"] if best else None,
               "best_forgetting_over_naive": best["forgetting_bpb"] / naive["forgetting_bpb"]
               if best and naive["forgetting_bpb"] > 0 else None}
    result = {**header("forgetting", "forgetting.py", argv, started), "steps": args.steps,
              "model": {k.removeprefix("model."): v for k, v in (QUICK_MODEL if args.quick else MODEL).items()},
              "seq_len": seq, "tokens_per_step": 16 * seq, "validation_windows": windows,
              "old": "bundled prose (Shakespeare, Milton)" if args.old is None else str(old),
              "new": "Python docs" if args.new is None else str(new),
              "fisher_tokens": fishers["sampled"]["tokens"], "distill_temperature": DISTILL_TEMPERATURE, "base_old_bpb": base_old, "base_new_bpb": base_new,
              "load_average": loads, "rows": rows, "summary": summary,
              "figure": "forgetting of the prose against gain on the Python docs, per setting"}
    write_result(result, args.out)
    draw_plot(result, args.plot)
    print(f"the prose model: prose {base_old:.4f} bpb, python docs {base_new:.4f} bpb; best setting keeping 3/4 of "
          f"naive's gain: {summary['best_setting']}")
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
