"""Curricula against the plain shuffled loader on the demo's pre-training budget, at equal tokens.

``recipes/demo/pretrain.yaml`` as it is (its model, 300 steps of 4,096 tokens, schedule, mixture of the
prose and web pages at 0.75 with the chat tasks at 0.25), but for ``train.compile`` (off: a warm-up's
shorter rows would compile a graph per length) and ``train.max_minutes`` (off: every run takes every
step). Four runs, one after another, seeded alike, on shards holding the same tokens (their sha256
compared):

- ``shuffled``: the plain loader, windows in a seeded order per epoch;
- ``seq_len_warmup``: ``data.seq_len_warmup`` (Li et al. 2022), rows of 32 tokens growing to 256 over
  the first fifth of the steps; a step keeps its 4,096 tokens and targets, cut into more, shorter rows;
- ``easy_to_hard`` and ``hard_to_easy``: ``data.score_order`` ascending and descending by each
  document's quality score, the curation stage's perplexity score (``lmforge.curate.quality``'s
  ``PerplexityScore``, CCNet's filter, in bits per byte) under the ``shuffled`` run's model, kept
  per document by ``prepare``'s ``data.score_field``. The reference model is the first run's, so the
  ordered runs come after it; its compute is not counted in their budget.

Recorded per run: the validation loss (mean and per dataset) at each evaluation, with the tokens seen
there (the same for every run), the final figures, tokens/s and the load average. The table and
figure (docs/img/curriculum.png: validation loss against tokens) are rendered into docs/curricula.md
by scripts/write_benchmark_docs.py. Whichever loader wins is reported as it is.

    .venv/bin/python benchmarks/curriculum.py                # ~30 min on 2 idle CPU cores
    .venv/bin/python benchmarks/curriculum.py --quick        # a smoke run: 4 steps
    .venv/bin/python scripts/write_benchmark_docs.py         # then the table into docs/curricula.md

It makes what it needs once (kept for later runs): the demo tokenizer (recipes/demo/tokenizer.yaml)
and the demo curation's web pages (recipes/demo/curate.yaml), unless ``--documents`` or ``--tokenizer``
name others.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
import sys
import time
from pathlib import Path

from record import header, load_average, machine_line, now, parse_training_args, replotted, write_result

from lmforge.core.config import load_config
from lmforge.data.documents import DocumentsConfig, read_documents
from lmforge.data.shards import read_manifest
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/demo/pretrain.yaml"
TOKENIZER_RECIPE, CURATE_RECIPE = "recipes/demo/tokenizer.yaml", "recipes/demo/curate.yaml"
PROSE = ["data/pretrain/*.jsonl"]
CURATED = "runs/demo/curate/output/*.parquet"
CHAT = ["data/sft/train_large.jsonl", "data/sft/conversations.jsonl"]
RESULTS = "benchmarks/results/curriculum.json"
PLOT = "docs/img/curriculum.png"
WARMUP_SHARE, WARMUP_START = 0.2, 32  # the warm-up's steps (a share of max_steps) and first row length
RUNS = {"shuffled": "the plain loader: windows in a seeded order",
        "seq_len_warmup": "sequence-length warm-up: rows of 32 tokens growing to 256 over the first fifth",
        "easy_to_hard": "ordered by quality score, lowest perplexity first",
        "hard_to_easy": "ordered by quality score, highest perplexity first"}
QUICK = ["train.max_steps=4", "train.warmup_steps=1", "train.eval_every=2", "train.eval_batches=2"]
FIXED = ["train.compile=false", "train.max_minutes=null", "train.checkpoint_every=0"]


def tokenizer_dir(args: argparse.Namespace) -> Path:
    """``--tokenizer``, or the demo tokenizer, trained once."""
    if args.tokenizer:
        return Path(args.tokenizer)
    from lmforge.stages.tokenizer import TokenizerRecipe, run_tokenizer

    recipe = load_config(TokenizerRecipe, REPO / TOKENIZER_RECIPE)
    if not (REPO / recipe.run_dir / "tokenizer.json").is_file():
        run_tokenizer(recipe)
    return REPO / recipe.run_dir


def documents(args: argparse.Namespace) -> list[str]:
    """``--documents``, or the demo's pre-training documents: the bundled prose and the web pages its
    curation keeps (curated once)."""
    if args.documents:
        return args.documents
    if not glob.glob(str(REPO / CURATED)):
        from lmforge.stages import curate

        curate.run(load_config(curate.RECIPE, REPO / CURATE_RECIPE))
    return [str(REPO / p) for p in PROSE] + [str(REPO / CURATED)]


def prepare(out: Path, tokenizer: Path, cfg: DocumentsConfig) -> Path:
    if not (out / "manifest.json").is_file():
        run_prepare(PrepareRecipe(run_dir=str(out), tokenizer=str(tokenizer), data=cfg, val_fraction=0.05,
                                  shard_tokens=1_000_000))
    return out


def shard_hashes(directory: Path) -> list[str]:
    splits = read_manifest(directory)["splits"]
    return [s["sha256"] for split in ("train", "val") for s in splits[split]["shards"]]


def scored_copy(directory: Path, docs: DocumentsConfig, checkpoint: Path, out: Path) -> Path:
    """``docs`` again, each with its perplexity score (bits per byte) under ``checkpoint``, as JSONL of
    the same ids and texts (so the same split and tokens), prepared with ``data.score_field``."""
    from lmforge.curate.quality import PerplexityConfig, PerplexityScore

    if (out / "manifest.json").is_file():
        return out
    read = list(read_documents(docs))
    scorer = PerplexityScore(PerplexityConfig(checkpoint=str(checkpoint), unit="bits_per_byte", max_tokens=256))
    scores = [float(s) for start in range(0, len(read), 256) for s in scorer.score_documents(read[start:start + 256])]
    jsonl = out.parent / f"{out.name}.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    with jsonl.open("w", encoding="utf-8") as f:
        for doc, score in zip(read, scores):
            f.write(json.dumps({"id": doc.id, "text": doc.text, "quality": score if math.isfinite(score) else 0.0},
                               ensure_ascii=False) + "\n")
    manifest = json.loads((directory / "manifest.json").read_text())
    run_prepare(PrepareRecipe(run_dir=str(out), tokenizer=manifest["tokenizer"], val_fraction=0.05,
                              shard_tokens=1_000_000, data=DocumentsConfig(paths=[str(jsonl)], score_field="quality")))
    if shard_hashes(out) != shard_hashes(directory):
        raise SystemExit(f"{out}: the scored documents' shards differ from {directory}'s: not the same tokens")
    return out


def datasets(data: dict[str, Path]) -> str:
    return f"[{{path: {data['data']}, weight: 0.75, name: data}}, {{path: {data['chat']}, weight: 0.25, name: chat}}]"


def train(name: str, run_dir: Path, keys: list[str], extra: list[str]) -> dict:
    print(f"== {name}", flush=True)
    loads_before = load_average()
    started = time.perf_counter()
    cfg = load_config(PretrainRecipe, REPO / RECIPE, [f"run_dir={run_dir}", *FIXED, *keys, *extra])
    reused = bool(run_pretrain(cfg).get("already_complete"))  # --keep-runs and a run complete before
    seconds = time.perf_counter() - started
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    names = sorted(k.split("/")[1] for k in evals[-1] if k.startswith("val/") and k.endswith("/loss")) if evals else []
    curve = [{"step": r["step"], "tokens": r["tokens"], "val_loss": r["val_loss"],
              **{n: r[f"val/{n}/loss"] for n in names}} for r in evals]
    run = {"name": name, "what": RUNS[name], "steps": len(steps), "tokens": steps[-1]["tokens"],
           "val_loss": evals[-1]["val_loss"] if evals else math.nan,
           "val_by_dataset": {n: evals[-1][f"val/{n}/loss"] for n in names} if evals else {},
           "val_bpb": evals[-1].get("val_bpb", math.nan) if evals else math.nan, "val_curve": curve,
           "train_curve": [{"step": r["step"], "loss": r["loss"], **{k: r[k] for k in ("data/seq_len", "data/score")
                                                                     if k in r}} for r in steps],
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[1:]) if len(steps) > 1 else math.nan,
           "seconds": round(seconds, 1), "reused": reused, "load_average": [loads_before, load_average()]}
    print(f"   validation loss {run['val_loss']:.4f} after {run['tokens']} tokens ({seconds:.0f} s)", flush=True)
    return run


def side_by_side(jobs: int, calls: list[tuple]) -> list[dict]:
    """``train(*call)`` for each call, one after another, or with ``jobs=2`` in two processes at once."""
    if jobs == 1:
        return [train(*call) for call in calls]
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return pool.starmap(train, calls)


def draw_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in result["runs"]:
        ax.plot([p["tokens"] / 1e6 for p in run["val_curve"]], [p["val_loss"] for p in run["val_curve"]], marker="o",
                ms=3, label=f"{run['name']} ({run['val_loss']:.3f})")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation loss (nats/token, mixture mean)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle(f"{result['recipe']}: curricula against the shuffled loader at equal tokens\n{machine_line(result)}",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", nargs="*", help="the pre-training documents (default: the demo's prose and web pages)")
    p.add_argument("--chat", nargs="*", default=CHAT, help="the chat tasks as documents (TRL messages)")
    p.add_argument("--tokenizer", help="a tokenizer directory (default: the demo's, trained once)")
    p.add_argument("--keep-runs", action="store_true",
                   help="a run already complete in its run directory is read, not trained again (train.resume=auto)")
    p.add_argument("--jobs", type=int, default=1, choices=(1, 2),
                   help="2: the shuffled and warm-up runs side by side, then the two orders (their tokens/s shared)")
    return parse_training_args(p, "curriculum", RESULTS, PLOT, "4 steps", argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if replotted(args, draw_plot):
        return
    extra = (QUICK if args.quick else []) + [f"train.resume={'auto' if args.keep_runs else 'never'}", *args.set]
    started = now()
    tok = tokenizer_dir(args)
    docs = {"data": DocumentsConfig(paths=documents(args)),
            "chat": DocumentsConfig(paths=[str(REPO / p) if not Path(p).is_absolute() else p for p in args.chat],
                                    messages_field="messages")}
    plain = {name: prepare(args.runs / "data" / name, tok, cfg) for name, cfg in docs.items()}
    common = [f"tokenizer={tok}", f"data.datasets={datasets(plain)}"]
    max_steps = load_config(PretrainRecipe, REPO / RECIPE, extra).train.max_steps
    warmup = f"data.seq_len_warmup={{steps: {max(1, round(WARMUP_SHARE * max_steps))}, start: {WARMUP_START}}}"
    runs = side_by_side(args.jobs, [("shuffled", args.runs / "shuffled", common, extra),
                                    ("seq_len_warmup", args.runs / "seq_len_warmup", [*common, warmup], extra)])
    scored = {name: scored_copy(plain[name], cfg, args.runs / "shuffled", args.runs / "data" / f"{name}_scored")
              for name, cfg in docs.items()}
    ordered = [f"tokenizer={tok}", f"data.datasets={datasets(scored)}"]
    runs += side_by_side(args.jobs, [(name, args.runs / name, [*ordered, f"data.score_order={order}"], extra)
                                     for name, order in (("easy_to_hard", "ascending"), ("hard_to_easy", "descending"))])
    base = runs[0]
    summary = {"val_loss_minus_shuffled": {r["name"]: r["val_loss"] - base["val_loss"] for r in runs[1:]},
               "best": min(runs, key=lambda r: r["val_loss"])["name"],
               "same_tokens": len({r["tokens"] for r in runs}) == 1}
    result = {**header("curriculum", "curriculum.py", argv, started), "recipe": RECIPE, "steps": base["steps"],
              "tokens": base["tokens"], "overrides": [*FIXED, *extra], "warmup": warmup,
              "score": "perplexity score (bits per byte, the first 256 tokens) under the shuffled run's final model",
              "figure": "validation loss (mixture mean) against training tokens", "runs": runs, "summary": summary}
    write_result(result, args.out)
    draw_plot(result, args.plot)
    for r in runs:
        print(f"{r['name']:>16}: validation loss {r['val_loss']:.4f} {r['val_by_dataset']}")
    print(f"best: {summary['best']}; wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
