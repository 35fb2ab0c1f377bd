"""Long-context extension of the demo model, side by side: no scaling, position interpolation
(PI), NTK-aware scaling and YaRN, each applied zero-shot to the 256-token model and after a short
continued pre-training at 1024 (recipes/long_context/).

    .venv/bin/python benchmarks/long_context.py               # the recipes, then the evaluation (~15 min, 2 CPU cores)
    .venv/bin/python benchmarks/long_context.py --eval-only   # the evaluation of runs/long_context as it is
    .venv/bin/python benchmarks/long_context.py --quick       # a smoke run: a tiny model, a few steps (~30 s)
    .venv/bin/python scripts/write_benchmark_docs.py          # then its table into the README and docs/long-context.md

The recipes run as the lifecycle recipes/long_context/lifecycle.yaml runs them (a stage already
complete with the same config is skipped). Each model is then scored on:

- perplexity by position: held-out long documents (the validation split of the prepared prose,
  never trained on) cut into 1024-token windows; the prediction at position t (having read tokens
  0..t of the window) falls in bucket [lo, hi) when lo <= t < hi, and a bucket's perplexity is
  exp of the mean next-token NLL over its predictions, every window's together.
- passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"): a 5-digit key in a sentence
  hidden among repeated filler sentences, at a depth of 10-90% of the filler, the prompt ending
  "What is the pass key? The pass key is" at a total length of 256, 512 or 1024 tokens. Scored
  by log-likelihood ranking: a trial is right when the true key's log-likelihood beats (strictly)
  that of each of 9 other random keys, so chance is 10%. A 9M-parameter model seldom decodes all
  five digits greedily; the ranking still shows whether it reads back to the needle. Greedy
  exactness (every digit the argmax) is reported beside it.

"no scaling" is the 256-token model as it is at every length (plain RoPE past the positions it
was trained on); "dynamic NTK" (transformers' ``dynamic``, factor 4) is scored zero-shot only,
its intended use (recipes/long_context/extend_ntk.yaml says why NTK trains with a static base).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from record import command, commit, machine, now

from lmforge.checkpoints.files import build_model
from lmforge.checkpoints.load import read_checkpoint_weights, resolve_checkpoint
from lmforge.core.config import load_config
from lmforge.core.run import setup_logging
from lmforge.data.shards import open_shards
from lmforge.data.tokenizer import Tokenizer
from lmforge.model.config import ModelConfig
from lmforge.stages.lifecycle import LifecycleRecipe, resolve_stages, run_stages

REPO = Path(__file__).resolve().parents[1]
LIFECYCLE = "recipes/long_context/lifecycle.yaml"
RECIPE_ROOT = "runs/long_context"  # where the recipes write; --runs moves every path under it
RESULTS = "benchmarks/results/long_context.json"
PLOT = "docs/img/long_context.png"

BUCKETS = ((0, 256), (256, 512), (512, 1024))
LENGTHS = (256, 512, 1024)
DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
EXTENSIONS = {"PI": "extend_pi", "NTK": "extend_ntk", "YaRN": "extend_yarn"}  # method -> its lifecycle stage

# --quick: a tiny model and a few steps on one file of the prose, for a smoke test of every piece
QUICK_OVERRIDES = {
    "tokenizer": ["tokenizer.vocab_size=512", "data.paths=[data/pretrain/milton.jsonl]"],
    "prepare": ["data.paths=[data/pretrain/milton.jsonl]", "val_fraction=0.1"],
    "pretrain": ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=128",
                 "model.vocab_size=512", "train.max_steps=2", "train.warmup_steps=1", "train.micro_batch_size=1",
                 "train.batch_tokens=null", "train.eval_batches=1", "train.log_every=1"],
}

# the passkey prompt of Mohtashami & Jaggi (2023), in their words
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.", " There and back again.")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"


# ---------------------------------------------------------------------------------- the recipes


def rebased(value, old: str, new: str):
    """``value`` (a config dataclass tree) with every path under ``old`` moved under ``new``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {}
        for f in dataclasses.fields(value):
            if f.init and (moved := rebased(getattr(value, f.name), old, new)) is not getattr(value, f.name):
                changed[f.name] = moved
        return dataclasses.replace(value, **changed) if changed else value
    if isinstance(value, list):
        moved = [rebased(v, old, new) for v in value]
        return moved if any(m is not v for m, v in zip(moved, value)) else value
    if isinstance(value, str) and (value == old or value.startswith(old + "/")):
        return new + value[len(old):]
    return value


def lifecycle_plans(runs: str, quick: bool) -> tuple[LifecycleRecipe, list[tuple]]:
    """The lifecycle of recipes/long_context/ with its paths under ``runs`` (and, ``quick``, the
    smoke run's overrides): ``(recipe, plans)`` as ``lmforge run`` resolves them."""
    recipe = load_config(LifecycleRecipe, REPO / LIFECYCLE, [f"run_dir={runs}"])
    if quick:
        for stage in recipe.stages:
            stage.overrides = [*stage.overrides, *QUICK_OVERRIDES.get(stage.verb, [])]
    plans = [(stage, module, rebased(cfg, RECIPE_ROOT, runs), Path(rebased(str(stage_dir), RECIPE_ROOT, runs)))
             for stage, module, cfg, stage_dir in resolve_stages(recipe)]
    return recipe, plans


def stage_configs(plans: list[tuple]) -> dict:
    return {stage.name: cfg for stage, _, cfg, _ in plans}


def training_summary(cfgs: dict) -> dict:
    """Steps, tokens, time and final validation loss of each training stage, from its summary.json."""
    out = {}
    for name, cfg in cfgs.items():
        path = Path(getattr(cfg, "run_dir", "")) / "summary.json"
        if hasattr(cfg, "model") and path.is_file():
            s = json.loads(path.read_text())
            out[name] = {k: s.get(k) for k in ("step", "tokens_per_step", "wall_s", "tokens_per_s", "val_loss", "val_bpb")}
            out[name]["seq_len"] = cfg.data.seq_len
    return out


# ---------------------------------------------------------------------------------- models


@dataclass
class Variant:
    method: str  # none, dynamic NTK, PI, NTK, YaRN
    trained: bool  # after the continued pre-training at 1024, else the 256-token model zero-shot
    checkpoint: str
    model: ModelConfig

    @property
    def label(self) -> str:
        return f"{self.method} ({'continued at 1024' if self.trained else 'zero-shot'})"


def variants(cfgs: dict, max_len: int) -> list[Variant]:
    """Every model scored: the 256-token model as it is and with dynamic NTK, then each extension's
    RoPE keys zero-shot on the 256-token weights and on its own continued weights."""
    base = cfgs["pretrain"]
    plain = dataclasses.replace(base.model, max_seq_len=max_len)
    dynamic = dataclasses.replace(plain, rope_scaling="dynamic", rope_factor=max_len / base.data.seq_len,
                                  rope_original_max_seq_len=base.data.seq_len)
    out = [Variant("none", False, base.run_dir, plain), Variant("dynamic NTK", False, base.run_dir, dynamic)]
    for method, stage in EXTENSIONS.items():
        model = cfgs[stage].model
        out += [Variant(method, False, base.run_dir, model), Variant(method, True, cfgs[stage].run_dir, model)]
    return out


def load_variant(v: Variant) -> torch.nn.Module:
    """``v.checkpoint``'s weights in a model of ``v.model``: RoPE's tables are the config's, not weights."""
    directory = resolve_checkpoint(v.checkpoint)
    model = build_model(v.model, read_checkpoint_weights(directory), str(directory))
    return model.eval()


def rope_keys(cfg: ModelConfig) -> dict:
    """The context keys of ``cfg`` set away from their defaults, and its max_seq_len."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return {k: v for k, v in dataclasses.asdict(cfg).items()
            if k == "max_seq_len" or (k.startswith("rope_") and v != defaults.get(k))}


# ---------------------------------------------------------------------------------- perplexity by position


def heldout_windows(data_dir: str | Path, seq_len: int, max_windows: int) -> torch.Tensor:
    """(N, seq_len + 1) token windows of the validation documents at least that long: each
    document's consecutive windows from its start, taken round-robin over the documents (every
    document's first window, then every second...) until ``max_windows``."""
    per_doc = []
    for shard in open_shards(data_dir, "val"):
        starts = np.asarray(shard.doc_starts)
        for begin, end in zip(starts[:-1], starts[1:]):
            n = (int(end) - int(begin)) // (seq_len + 1)
            per_doc.append([shard.tokens[int(begin) + i * (seq_len + 1): int(begin) + (i + 1) * (seq_len + 1)]
                            for i in range(n)])
    rows = [d[i] for i in range(max((len(d) for d in per_doc), default=0)) for d in per_doc if i < len(d)][:max_windows]
    if not rows:
        raise SystemExit(f"{data_dir}: no validation document of {seq_len + 1} tokens: nothing to measure at {seq_len}")
    return torch.from_numpy(np.stack(rows).astype(np.int64))


@torch.inference_mode()
def position_nll(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """(N, T) next-token NLL of (N, T + 1) windows: column t is -log p(token t+1 | tokens 0..t)."""
    out = []
    for chunk in windows.split(batch_size):
        logits = model(chunk[:, :-1]).float()
        out.append(F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none"))
    return torch.cat(out)


def bucket_perplexity(nll: torch.Tensor, buckets=BUCKETS) -> dict[str, float]:
    """exp of the mean NLL of the predictions at positions lo <= t < hi, per bucket ``lo-hi``."""
    return {f"{lo}-{hi}": math.exp(float(nll[:, lo:hi].mean())) for lo, hi in buckets if hi <= nll.shape[1]}


# ---------------------------------------------------------------------------------- passkey retrieval


def passkey_prompt(tok: Tokenizer, key: str, depth: float, length: int) -> tuple[list[int], list[int], int]:
    """(context ids, answer ids, the needle's first token) of a prompt of ``length`` tokens in all:
    BOS, the intro, filler sentences with the needle after ``depth`` of them (cut at a sentence
    boundary), the question; the answer is the key. The filler is cut at its end to fit."""
    intro, needle, question = tok.encode(INTRO), tok.encode(NEEDLE.format(key=key)), tok.encode(QUESTION)
    answer = tok.encode(ANSWER.format(key=key))
    room = length - 1 - len(intro) - len(needle) - len(question) - len(answer)
    if room < 0:
        raise ValueError(f"a passkey prompt of {length} tokens has no room for filler (needs {length - room})")
    sentences = [tok.encode(s) for s in FILLER]
    filler, cuts, i = [], [0], 0
    while len(filler) < room:
        filler += sentences[i % len(sentences)]
        cuts.append(len(filler))
        i += 1
    filler = filler[:room]
    at = min((c for c in cuts if c <= room), key=lambda c: abs(c - depth * room))
    context = [tok.bos_id, *intro, *filler[:at], *needle, *filler[at:], *question]
    return context, answer, 1 + len(intro) + at


def packed_rows(context: list[int], continuations: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence scoring every continuation after a shared context in one forward: tokens and
    positions (S,) and the attention mask (S, S), True = may attend. The context is causal; each
    continuation follows it at positions len(context).. and sees the context and itself only, so
    its logits equal those of the context + that continuation alone."""
    P = len(context)
    tokens = list(context) + [t for c in continuations for t in c]
    positions = list(range(P)) + [P + j for c in continuations for j in range(len(c))]
    S = len(tokens)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    start = P
    for c in continuations:
        mask[start: start + len(c), P:start] = False  # not the continuations before it
        start += len(c)
    return torch.tensor(tokens), torch.tensor(positions), mask


@torch.inference_mode()
def continuation_scores(model: torch.nn.Module, prompts: list[tuple[list[int], list[list[int]]]],
                        batch_size: int = 8) -> list[list[tuple[float, bool]]]:
    """For each (context, continuations): per continuation (log p(continuation | context), whether
    every token of it is the argmax). Prompts of the same shape share a batch."""
    out: list[list[tuple[float, bool]] | None] = [None] * len(prompts)
    shapes: dict[tuple, list[int]] = {}
    for i, (ctx, conts) in enumerate(prompts):
        shapes.setdefault((len(ctx), tuple(len(c) for c in conts)), []).append(i)
    for (P, _), members in shapes.items():
        for at in range(0, len(members), batch_size):
            chunk = members[at: at + batch_size]
            rows = [packed_rows(*prompts[i]) for i in chunk]
            tokens = torch.stack([r[0] for r in rows])
            positions = torch.stack([r[1] for r in rows])
            logits = model(tokens, positions=positions, attn_mask=rows[0][2][None, None]).float()
            logp = torch.log_softmax(logits, dim=-1)
            for row, i in enumerate(chunk):
                scores, start = [], P
                for c in prompts[i][1]:
                    # continuation token j is predicted at the position before it: the context's
                    # last token for j = 0, else the continuation's token j - 1
                    at_ = torch.tensor([P - 1] + list(range(start, start + len(c) - 1)))
                    target = torch.tensor(c)
                    pred = logp[row, at_]
                    scores.append((float(pred.gather(1, target[:, None]).sum()), bool((pred.argmax(-1) == target).all())))
                    start += len(c)
                out[i] = scores
    return out  # type: ignore[return-value]


def passkey_trials(tok: Tokenizer, lengths=LENGTHS, depths=DEPTHS, keys: int = 3, candidates: int = 10,
                   seed: int = 0) -> list[dict]:
    """The trials: for each length and depth, ``keys`` random 5-digit keys, each with
    ``candidates - 1`` other random keys; the same for every model."""
    rng = random.Random(seed)
    trials = []
    for length in lengths:
        for depth in depths:
            for _ in range(keys):
                pool = rng.sample(range(10000, 100000), candidates)
                key, others = str(pool[0]), [str(k) for k in pool[1:]]
                context, answer, needle_at = passkey_prompt(tok, key, depth, length)
                conts = [answer] + [tok.encode(ANSWER.format(key=k)) for k in others]
                if len({len(c) for c in conts}) != 1:
                    raise ValueError(f"the keys {key}, {', '.join(others)} encode to different numbers of tokens: "
                                     "ranked by log-likelihood, the shorter would win; use a tokenizer that splits "
                                     "numbers alike (the demo's digit_group: 1, a token per digit)")
                trials.append({"length": length, "depth": depth, "key": key, "needle_at": needle_at,
                               "context": context, "continuations": conts})
    return trials


def passkey_accuracy(model: torch.nn.Module, trials: list[dict]) -> dict:
    """Ranking accuracy (the true key, continuation 0, strictly most likely) and greedy exactness, by
    length and by (length, depth)."""
    scores = continuation_scores(model, [(t["context"], t["continuations"]) for t in trials])
    ranked: dict[int, list[bool]] = {}
    greedy: dict[int, list[bool]] = {}
    by_depth: dict[str, dict[str, list[bool]]] = {}
    for t, s in zip(trials, scores):
        right = all(s[0][0] > other for other, _ in s[1:])
        ranked.setdefault(t["length"], []).append(right)
        greedy.setdefault(t["length"], []).append(s[0][1])
        by_depth.setdefault(str(t["length"]), {}).setdefault(f"{t['depth']:.1f}", []).append(right)
    share = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"passkey": {str(k): share(v) for k, v in ranked.items()},
            "passkey_greedy": {str(k): share(v) for k, v in greedy.items()},
            "passkey_by_depth": {k: {d: share(v) for d, v in ds.items()} for k, ds in by_depth.items()}}


# ---------------------------------------------------------------------------------- report


def draw_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"none": "black", "dynamic NTK": "tab:gray", "PI": "tab:blue", "NTK": "tab:orange", "YaRN": "tab:green"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    buckets = [f"{lo}-{hi}" for lo, hi in result["config"]["buckets"]]
    lengths = [str(n) for n in result["config"]["passkey"]["lengths"]]
    for r in result["rows"]:
        style = dict(color=colors.get(r["method"], "tab:red"), linestyle="-" if r["trained"] else "--",
                     marker="o" if r["trained"] else "x", label=r["label"])
        left.plot(buckets, [r["perplexity"][b] for b in buckets], **style)
        right.plot([int(n) for n in lengths], [100 * r["passkey"][n] for n in lengths], **style)
    left.set_yscale("log")
    left.set_xlabel("position in the window (tokens)")
    left.set_ylabel("perplexity (log scale)")
    left.set_title("held-out long documents")
    right.axhline(100 / result["config"]["passkey"]["candidates"], color="lightgray", linewidth=0.8, label="chance")
    right.set_xscale("log", base=2)
    right.set_xticks([int(n) for n in lengths], lengths)
    right.set_xlabel("prompt length (tokens)")
    right.set_ylabel("passkey accuracy (%)")
    right.set_ylim(-3, 103)
    right.set_title("passkey retrieval, log-likelihood ranking")
    right.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"demo model ({result['config']['params'] / 1e6:.1f}M) pre-trained at 256, extended to 1024: "
                 "dashed zero-shot, solid after continued pre-training", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result: dict) -> None:
    """Each row's perplexity over all positions and passkey accuracy by length (the docs' table,
    by position, is scripts/write_benchmark_docs.py's)."""
    for r in result["rows"]:
        keys = ", ".join(f"{n} {100 * v:.0f}%" for n, v in r["passkey"].items())
        print(f"{r['label']}: perplexity {r['perplexity_all']:.1f}; passkey {keys}")


# ---------------------------------------------------------------------------------- main


def evaluate(cfgs: dict, args: argparse.Namespace) -> tuple[list[dict], dict]:
    tok = Tokenizer.load(cfgs["tokenizer"].run_dir)
    windows = heldout_windows(cfgs["prepare"].run_dir, args.max_len, args.windows)
    trials = passkey_trials(tok, args.lengths, args.depths, args.keys, args.candidates, args.seed)
    rows = []
    for v in variants(cfgs, args.max_len):
        t0 = time.time()
        torch.manual_seed(0)
        model = load_variant(v)
        nll = position_nll(model, windows)
        row = {"method": v.method, "trained": v.trained, "label": v.label, "checkpoint": v.checkpoint,
               "rope": rope_keys(v.model), "perplexity": bucket_perplexity(nll),
               "perplexity_all": math.exp(float(nll.mean())), **passkey_accuracy(model, trials)}
        row["eval_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(f"{v.label:<34} ppl " + " ".join(f"{b} {p:9.1f}" for b, p in row["perplexity"].items())
              + "  passkey " + " ".join(f"{n}: {100 * a:3.0f}%" for n, a in row["passkey"].items())
              + f"  ({row['eval_s']} s)", flush=True)
    return rows, {"windows": int(windows.shape[0]), "trials": len(trials)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model, 2 steps a stage, 2 windows, 3 depths")
    p.add_argument("--eval-only", action="store_true", help="score the recipes' outputs as they are; run nothing")
    p.add_argument("--runs", help=f"where the recipes write (default {RECIPE_ROOT}, --quick {RECIPE_ROOT}_quick)")
    p.add_argument("--out", help=f"results JSON (default {RESULTS}; --quick: <runs>/long_context.json)")
    p.add_argument("--plot", help=f"the figure (default {PLOT}; --quick: <runs>/long_context.png)")
    p.add_argument("--max-len", type=int, default=1024, help="the extended context: windows and the longest prompt")
    p.add_argument("--windows", type=int, default=None, help="held-out windows for perplexity (default 32, quick 2)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="passkey prompt lengths")
    p.add_argument("--depths", type=float, nargs="+", default=None, help="needle depths (default 0.1 .. 0.9)")
    p.add_argument("--keys", type=int, default=None, help="keys per length and depth (default 3, quick 1)")
    p.add_argument("--candidates", type=int, default=10, help="keys ranked per trial, the true one included")
    p.add_argument("--seed", type=int, default=0, help="of the passkey keys")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for training and scoring (default torch's; on a machine shared with other "
                        "jobs, 1 thread spins less than 2)")
    args = p.parse_args(argv)
    args.runs = args.runs or (RECIPE_ROOT + "_quick" if args.quick else RECIPE_ROOT)
    args.out = Path(args.out or (Path(args.runs) / "long_context.json" if args.quick else RESULTS))
    args.plot = Path(args.plot or (Path(args.runs) / "long_context.png" if args.quick else PLOT))
    args.windows = args.windows or (2 if args.quick else 32)
    args.depths = args.depths or ([0.1, 0.5, 0.9] if args.quick else list(DEPTHS))
    args.keys = args.keys or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    date, load_before = now(), os.getloadavg()
    started = time.time()
    recipe, plans = lifecycle_plans(args.runs, args.quick)
    cfgs = stage_configs(plans)
    stages_s = 0.0
    if not args.eval_only:
        run_stages(recipe, plans)
        stages_s = time.time() - started
    t_eval = time.time()
    rows, sizes = evaluate(cfgs, args)
    base = cfgs["pretrain"]
    result = {
        "benchmark": "long_context",
        "date": date,
        "command": command("long_context.py", argv),
        "commit": commit(),
        "machine": {**machine(), "load_average_1_5_15_min": {"start": [round(x, 2) for x in load_before],
                                                             "end": [round(x, 2) for x in os.getloadavg()]}},
        "config": {
            "lifecycle": LIFECYCLE, "runs": args.runs, "quick": args.quick, "params": base.model.num_params(),
            "pretrain_seq_len": base.data.seq_len, "max_len": args.max_len, "buckets": [list(b) for b in BUCKETS],
            "windows": sizes["windows"], "heldout": f"{cfgs['prepare'].run_dir} validation split",
            "passkey": {"lengths": args.lengths, "depths": args.depths, "keys": args.keys,
                        "candidates": args.candidates, "seed": args.seed, "trials": sizes["trials"],
                        "scoring": "log-likelihood ranking of the true key among the candidates (strictly highest); "
                                   "greedy: every digit the argmax"},
            "extensions": {m: {"recipe": f"recipes/long_context/{s}.yaml", "rope": rope_keys(cfgs[s].model)}
                           for m, s in EXTENSIONS.items()},
        },
        "training": training_summary(cfgs),
        "rows": rows,
        "wall_s": {"recipes": round(stages_s, 1), "evaluation": round(time.time() - t_eval, 1),
                   "total": round(time.time() - started, 1), "recipes_ran": not args.eval_only},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    draw_plot(result, args.plot)
    print_table(result)
    print(f"\nwrote {args.out} and {args.plot} in {result['wall_s']['total']:.0f} s")


if __name__ == "__main__":
    main()
