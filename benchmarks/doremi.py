"""DoReMi's domain weights against uniform and stratified mixtures on the demo's pre-training domains.

The demo's four pre-training domains (Shakespeare, Milton, the Python docs and the curated web pages)
are prepared one dataset each; then, with the recipes of recipes/mixtures/:

- a reference model pre-trained on the uniform mixture (reference.yaml);
- the DoReMi proxy (doremi.yaml: Group DRO against the reference) for three seeds, each writing
  its domain weights (the mean over its updates);
- the main model (main.yaml) trained on each mixture on the same budget (steps, tokens a step, model)
  for three seeds (initialisation and data order): uniform (its seed 0 is the reference run itself),
  stratified (each domain's share of the training tokens) and DoReMi (seed s: proxy seed s's weights).

Recorded: each mixture's weights, each main model's validation loss per domain (the same validation
windows for every mixture), their unweighted mean over the domains (the paper's average) and the worst
domain, per run and as each mixture's mean over its seeds (a tiny model's loss at a fixed step moves
with the seed); the three proxies' weights and their spread. The
figure (docs/img/doremi.png) draws both.

    .venv/bin/python benchmarks/doremi.py            # ~15-25 min on 2 CPU cores
    .venv/bin/python benchmarks/doremi.py --quick --tokenizer T --domains a=SHARDS b=SHARDS   # a smoke run
    .venv/bin/python scripts/write_benchmark_docs.py # then its tables into docs/mixtures.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from record import header, load_average, now, parse_training_args, replotted, write_result

from lmforge.core.config import load_config
from lmforge.data.shards import read_manifest
from lmforge.stages.curate import RECIPE as CurateRecipe
from lmforge.stages.curate import run as run_curate
from lmforge.stages.doremi import DoReMiRecipe, run_doremi
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.stages.tokenizer import TokenizerRecipe, run_tokenizer

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes" / "mixtures"
TOKENIZER = "recipes/mup/tokenizer.yaml"
CURATE = "recipes/demo/curate.yaml"
RESULTS = "benchmarks/results/doremi.json"
PLOT = "docs/img/doremi.png"
SOURCES = {"shakespeare": ["data/pretrain/shakespeare.jsonl"], "milton": ["data/pretrain/milton.jsonl"],
           "python_docs": ["data/pretrain/python_docs.jsonl"], "web": None}  # web: the demo curation's output
SEEDS = (0, 1, 2)
QUICK = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
         "model.ffn_hidden=64", "model.max_seq_len=32", "data.seq_len=32", "train.max_steps=3", "train.warmup_steps=1",
         "train.micro_batch_size=4", "train.batch_tokens=256", "train.eval_batches=1", "train.checkpoint_every=3"]


def prepared_domains(runs: Path) -> dict[str, Path]:
    """The tokenizer, the curated web pages and each domain's token shards under ``runs/data``, made once."""
    tokenizer = load_config(TokenizerRecipe, REPO / TOKENIZER)
    if not (REPO / tokenizer.run_dir / "tokenizer.json").is_file():
        run_tokenizer(tokenizer)
    out = {}
    for name, paths in SOURCES.items():
        if paths is None:
            curated = runs / "curate"
            if not list((curated / "output").glob("*.parquet")):
                run_curate(load_config(CurateRecipe, REPO / CURATE, [f"run_dir={curated}"]))
            paths = [str(curated / "output" / "*.parquet")]
        out[name] = runs / "data" / name
        if not (out[name] / "manifest.json").is_file():
            run_prepare(load_config(PrepareRecipe, None, [
                f"run_dir={out[name]}", f"tokenizer={REPO / tokenizer.run_dir}", "val_fraction=0.05",
                f"data.paths=[{', '.join(str(REPO / p) if not Path(p).is_absolute() else p for p in paths)}]"]))
    return out


def datasets_key(domains: dict[str, Path], weights: dict[str, float] | None = None) -> str:
    entries = [f"{{path: {p}, name: {n}" + (f", weight: {weights[n]!r}" if weights else "") + "}"
               for n, p in domains.items()]
    return "data.datasets=[" + ", ".join(entries) + "]"


def stratified(domains: dict[str, Path]) -> dict[str, float]:
    """Each domain's share of the training tokens."""
    tokens = {n: read_manifest(p)["splits"]["train"]["n_tokens"] for n, p in domains.items()}
    return {n: t / sum(tokens.values()) for n, t in tokens.items()}


def evaluated(summary: dict, names: list[str]) -> dict:
    """A main run's validation loss and bits per byte per domain, their mean over the domains and the worst."""
    loss = {n: summary[f"val/{n}/loss"] for n in names}
    bpb = {n: summary.get(f"val/{n}/bpb") for n in names}
    return {"val_loss": loss, "val_bpb": bpb, "mean_loss": sum(loss.values()) / len(loss),
            "worst_loss": max(loss.values()), "worst_domain": max(loss, key=loss.get)}


def mixture_row(label: str, runs: list[dict], names: list[str]) -> dict:
    """A mixture's main runs (one per seed) as their means, with the range of the mean over the domains."""
    mean = {n: sum(r["val_loss"][n] for r in runs) / len(runs) for n in names}
    means = [r["mean_loss"] for r in runs]
    return {"mixture": label, "seeds": [r["seed"] for r in runs], "val_loss": mean,
            "mean_loss": sum(means) / len(means), "mean_loss_range": [min(means), max(means)],
            "worst_loss": sum(r["worst_loss"] for r in runs) / len(runs), "worst_domain": max(mean, key=mean.get)}


def draw_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = result["domains"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rows = result["rows"]
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        xs = [j + i * width for j in range(len(names) + 1)]
        lo, hi = row["mean_loss_range"]
        left.bar(xs, [row["val_loss"][n] for n in names] + [row["mean_loss"]], width, label=row["mixture"])
        left.errorbar(xs[-1], row["mean_loss"], yerr=[[row["mean_loss"] - lo], [hi - row["mean_loss"]]],
                      color="black", capsize=3)
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(names) + 1)], [*names, "mean"], fontsize=8)
    low = min(min(r["val_loss"].values()) for r in rows)
    left.set_ylim(low * 0.9, max(max(r["worst_loss"], r["mean_loss_range"][1]) for r in rows) * 1.03)
    left.set_ylabel("validation loss (nats/token)")
    left.set_title(f"main model per mixture, same budget (mean of {result['seeds_per_mixture']} seeds)")
    left.legend(fontsize=7, loc="lower left")
    weights = [("uniform", result["uniform"]), ("stratified", result["stratified"])] + [
        (f"DoReMi seed {s['seed']}", s["weights"]) for s in result["seeds"]]
    width = 0.8 / len(weights)
    for i, (label, w) in enumerate(weights):
        right.bar([j + i * width for j in range(len(names))], [w[n] for n in names], width, label=label)
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, fontsize=8)
    right.set_ylabel("domain weight")
    right.set_title("the mixtures' weights (DoReMi: three seeds)")
    right.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", help="a tokenizer folder (default: recipes/mup/tokenizer.yaml's, made if missing)")
    p.add_argument("--domains", nargs="*", help="name=prepared shards of each domain (default: the demo's four, "
                   "prepared once under <runs>/data)")
    args = parse_training_args(p, "doremi", RESULTS, PLOT, "a tiny model, 3 steps a run", argv)
    if replotted(args, draw_plot):
        return
    started = now()
    if args.domains:
        domains = {k: Path(v) for k, v in (d.split("=", 1) for d in args.domains)}
    else:
        domains = prepared_domains(args.runs)
    names = list(domains)
    tokenizer = Path(args.tokenizer) if args.tokenizer else REPO / load_config(TokenizerRecipe, REPO / TOKENIZER).run_dir
    common = [f"tokenizer={tokenizer}", *(QUICK if args.quick else []), *args.set]
    loads = [load_average()]

    def pretrain(run_dir: Path, *keys: str) -> dict:
        return run_pretrain(load_config(PretrainRecipe, RECIPES / "main.yaml", [
            f"run_dir={run_dir}", *common, "data.weights_from=null", datasets_key(domains), *keys]))

    reference = args.runs / "reference"
    reference_summary = pretrain(reference)
    seeds = []
    for seed in SEEDS:
        run_dir = args.runs / f"doremi-seed{seed}"
        run_doremi(load_config(DoReMiRecipe, RECIPES / "doremi.yaml", [
            f"run_dir={run_dir}", f"reference={reference}", *common, datasets_key(domains),
            f"train.seed={seed}", f"data.seed={seed}"]))
        written = json.loads((run_dir / "domain_weights.json").read_text())
        seeds.append({"seed": seed, "weights": written["weights"], "final": written["final"],
                      "updates": written["updates"], "weights_file": str(run_dir / "domain_weights.json")})
        print(f"DoReMi seed {seed}: " + ", ".join(f"{n} {w:.3f}" for n, w in written["weights"].items()), flush=True)
        loads.append(load_average())
    uniform = {n: 1 / len(names) for n in names}
    # (mixture, run name, weights, weights file, main seed); the uniform mixture's seed-0 run is the reference
    plan = [("uniform", "uniform", uniform, None, seed) for seed in SEEDS]
    plan += [("stratified", "stratified", stratified(domains), None, seed) for seed in SEEDS]
    plan += [("DoReMi", "doremi", s["weights"], s["weights_file"], s["seed"]) for s in seeds]
    runs = []
    for label, name, weights, weights_file, seed in plan:
        run_dir = reference if (name, seed) == ("uniform", 0) else args.runs / f"main-{name}-seed{seed}"
        keys = [f"data.weights_from={weights_file}"] if weights_file else [datasets_key(domains, weights)]
        summary = reference_summary if run_dir == reference else pretrain(run_dir, *keys, f"train.seed={seed}",
                                                                          f"data.seed={seed}")
        runs.append({"mixture": label, "seed": seed, "weights": weights, **evaluated(summary, names),
                     "run_dir": str(run_dir)})
        print(f"{label:10s} seed {seed}: mean val loss {runs[-1]['mean_loss']:.4f}, worst {runs[-1]['worst_loss']:.4f} "
              f"({runs[-1]['worst_domain']})", flush=True)
        loads.append(load_average())
    rows = [mixture_row(label, [r for r in runs if r["mixture"] == label], names)
            for label in ("uniform", "stratified", "DoReMi")]
    spread = {n: max(s["weights"][n] for s in seeds) - min(s["weights"][n] for s in seeds) for n in names}
    recipe = load_config(PretrainRecipe, RECIPES / "main.yaml", [*common, "data.weights_from=null",
                                                                 datasets_key(domains)])
    tokens_per_step = recipe.train.batch_tokens or recipe.train.micro_batch_size * recipe.data.seq_len
    result = {**header("doremi", "doremi.py", argv, started), "domains": names, "seeds_per_mixture": len(SEEDS),
              "steps": recipe.train.max_steps, "tokens_per_step": tokens_per_step, "seq_len": recipe.data.seq_len,
              "model": {"d_model": recipe.model.d_model, "n_layers": recipe.model.n_layers,
                        "vocab_size": recipe.model.vocab_size},
              "eval_windows_per_domain": recipe.train.eval_batches * recipe.train.micro_batch_size,
              "step_size": 1.0, "smoothing": 1e-3, "uniform": uniform, "stratified": plan[len(SEEDS)][2],
              "seeds": seeds, "weight_spread": spread, "rows": rows, "runs": runs,
              "summary": {"best_mean": min(rows, key=lambda r: r["mean_loss"])["mixture"],
                          "best_worst": min(rows, key=lambda r: r["worst_loss"])["mixture"],
                          **{f"{r['mixture'].lower()}_mean_loss": r["mean_loss"] for r in rows},
                          "largest_spread": max(spread.values())},
              "load_average": loads,
              "figure": "validation loss per domain of the main model per mixture (mean and range over three seeds), "
                        "and the mixtures' weights"}
    write_result(result, args.out)
    draw_plot(result, args.plot)
    print(f"lowest mean validation loss (mean over seeds): {result['summary']['best_mean']}; largest spread of a domain's weight over "
          f"the seeds {result['summary']['largest_spread']:.3f}")
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
