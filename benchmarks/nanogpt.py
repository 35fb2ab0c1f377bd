"""nanoGPT's shakespeare_char CPU run beside lmforge, on the same characters and the same split.

nanoGPT's README trains a character-level GPT on a CPU with

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
      --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
      --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

and reports a validation loss of 1.88 after 2000 iterations. Given a nanoGPT checkout (``--nanogpt
PATH``; nothing is fetched), this runs that command on a copy of the five files of the checkout it
uses, in the run directory (the checkout is only read), then lmforge:

- ``lmforge_fast``: ``recipes/nanogpt/shakespeare_char_fast.yaml``, lmforge's best choices for the goal
  (llama-style blocks with QK-norm, Muon, a shallower model and a shorter schedule);
- ``lmforge_fast_compiled``: the same with ``train.compile=true`` and torch inductor's cache emptied
  first, as a first run compiles; ``lmforge_fast_compiled_warm`` once more on the cache that run left,
  as every later run compiles;
- ``lmforge_gpt2``: ``recipes/nanogpt/shakespeare_char.yaml``, nanoGPT's model (the gpt2 family),
  optimizer and schedule.

The goal: ``lmforge_fast`` reaches nanoGPT's 2000-step validation loss in at most a third of the wall
time nanoGPT took to report it, on the same CPU. Without a checkout the target is the README's 1.88 and
the time that of ``lmforge_gpt2`` at its last step (``reference``: a proxy).

The text. The repository bundles no tiny-shakespeare, so both sides read the same 1,115,394
characters (tiny-shakespeare's length) of eight whole plays from ``data/pretrain/shakespeare.jsonl``
(Open Shakespeare, public domain), written to ``<runs>/input.txt``: 78 distinct characters where
tiny-shakespeare has 65, other plays, other typography (``ROMEO.`` where it has ``ROMEO:``). So the
1.88 is a reference, not a target this text must meet; the target of a side-by-side run is the
loss nanoGPT reaches here. The split is nanoGPT's, ``data[:int(n * 0.9)]`` trains: nanoGPT's own
``prepare.py`` makes its ``train.bin``/``val.bin``, lmforge's ``prepare`` with ``split=source_tail``
its shards, and both are decoded and checked against the text, character for character.

The figures. Both losses are nats per character: nanoGPT's vocabulary is the text's characters, and
lmforge's byte-level tokenizer with no merges (``recipes/nanogpt/tokenizer.yaml``) encodes this ASCII
text one token a character (no BOS or EOS added). nanoGPT estimates its validation loss on 20 batches
of 12 random windows; lmforge's runs evaluate the whole validation split (``train.eval_batches=null``),
which costs them time that nanoGPT does not spend. A validation figure's time is when its line reached
this process, counted from the side's launch (imports, data loading and compilation included), with the
process's CPU seconds beside it; each side runs as a subprocess with ``--threads`` OpenMP threads (1:
two threads on two shared cores stall each other at every barrier), one side after the other, and the
load average before and after each is recorded.

    .venv/bin/python benchmarks/nanogpt.py --nanogpt ~/src/nanoGPT   # all five runs (~9 min on 2 cores)
    .venv/bin/python benchmarks/nanogpt.py                           # lmforge alone, against the README's 1.88
    .venv/bin/python benchmarks/nanogpt.py --quick                   # a smoke run: 40,000 characters, 8 steps
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from record import REPO, header, now, write_result

from lmforge.core.config import load_config
from lmforge.data.shards import open_shards
from lmforge.data.tokenizer import Tokenizer
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.stages.tokenizer import TokenizerRecipe, run_tokenizer
from lmforge.train.metrics import read_metrics

RESULTS, PLOT = "benchmarks/results/nanogpt.json", "docs/img/nanogpt.png"
SOURCE = "data/pretrain/shakespeare.jsonl"
# whole plays, in this order; the last 10% of the text is the end of the Shrew and most of the Tempest
PLAYS = ("coriolanus", "richard-iii", "romeo-and-juliet", "henry-vi-part-3", "winters-tale", "richard-ii",
         "taming-of-the-shrew", "tempest")
TEXT_CHARS = 1_115_394  # tiny-shakespeare's length
VAL_FRACTION = 0.1
README_LOSS = 1.88  # nanoGPT's README, after 2000 iterations of the command below, on tiny-shakespeare
GOAL_RATIO = 1 / 3
NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py")
NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
TOKENIZER, PREPARE = "recipes/nanogpt/tokenizer.yaml", "recipes/nanogpt/prepare.yaml"
FAST_RECIPE = "recipes/nanogpt/shakespeare_char_fast.yaml"
# name: (recipe, overrides, whether torch inductor's cache is emptied first: compiling counted cold)
RECIPES = {"lmforge_gpt2": ("recipes/nanogpt/shakespeare_char.yaml", [], True),
           "lmforge_fast": (FAST_RECIPE, [], True),
           "lmforge_fast_compiled": (FAST_RECIPE, ["train.compile=true"], True),
           "lmforge_fast_compiled_warm": (FAST_RECIPE, ["train.compile=true"], False)}  # the cold run's cache
SIDES = ("nanogpt", "lmforge_fast", "lmforge_fast_compiled", "lmforge_fast_compiled_warm", "lmforge_gpt2")  # in order
COMPILED = ("lmforge_fast_compiled", "lmforge_fast_compiled_warm")
FAST = "lmforge_fast"
QUICK = dict(chars=40_000, steps=8,
             nanogpt=["--max_iters=8", "--lr_decay_iters=8", "--warmup_iters=2", "--eval_interval=4", "--eval_iters=2"],
             lmforge=["train.max_steps=8", "train.warmup_steps=2", "train.eval_every=4", "train.compile=false"])
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
NANOGPT_ITER = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms")
LMFORGE_EVAL = re.compile(r"\bstep (\d+)/(\d+) .*\| val loss ([\d.]+)")


# -- the text and the split

def shakespeare_text(n_chars: int) -> str:
    """The first ``n_chars`` characters of ``PLAYS``, act after act, from the bundled Shakespeare."""
    acts: dict[str, list[str]] = {play: [] for play in PLAYS}
    with open(REPO / SOURCE, encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            play = doc["id"].split("/")[1]
            if play in acts:
                acts[play].append(doc["text"])
    text = "\n".join(act for play in PLAYS for act in acts[play])
    if len(text) < n_chars:
        raise SystemExit(f"{SOURCE}: the plays {PLAYS} hold {len(text)} characters, fewer than {n_chars}")
    return text[:n_chars]


def split_text(text: str) -> tuple[str, str]:
    cut = int(len(text) * (1 - VAL_FRACTION))  # nanoGPT's data[:int(n*0.9)]
    return text[:cut], text[cut:]


def prepare_lmforge(text_path: Path, out: Path) -> Path:
    """lmforge's character tokenizer and its shards of ``text_path``, 90/10 as nanoGPT cuts it."""
    paths = f"data.paths=[{text_path}]"
    run_tokenizer(load_config(TokenizerRecipe, REPO / TOKENIZER, [f"run_dir={out / 'tokenizer'}", paths]))
    run_prepare(load_config(PrepareRecipe, REPO / PREPARE, [
        f"run_dir={out / 'data'}", f"tokenizer={out / 'tokenizer'}", paths, "split=source_tail",
        f"val_fraction={VAL_FRACTION}", "add_bos=false", "add_eos=false"]))
    return out / "data"


def lmforge_split(data: Path, tokenizer: Path) -> dict[str, str]:
    tok = Tokenizer.load(tokenizer)
    return {split: "".join(tok.decode(s.tokens.tolist()) for s in open_shards(data, split)) for split in ("train", "val")}


def nanogpt_split(data: Path) -> dict[str, str]:
    with open(data / "meta.pkl", "rb") as f:  # written by the copy of prepare.py this run made
        itos = pickle.load(f)["itos"]
    return {split: "".join(itos[int(i)] for i in np.fromfile(data / f"{split}.bin", dtype=np.uint16))
            for split in ("train", "val")}


def check_split(text: str, decoded: dict[str, str], who: str) -> dict:
    """That ``who``'s train and val splits are the text's first 90% and last 10%, character for character."""
    train, val = split_text(text)
    if decoded["train"] != train or decoded["val"] != val:
        raise SystemExit(f"{who}: its split is not the text's {len(train)} + {len(val)} characters "
                         f"(got {len(decoded['train'])} + {len(decoded['val'])}, or other characters)")
    return {"train_chars": len(train), "val_chars": len(val), "identical": True}


# -- running a side

def run_timed(cmd: list[str], cwd: Path, env: dict[str, str], log_path: Path) -> tuple[list[tuple[float, float | None, str]], dict]:
    """Run ``cmd``; each output line with the seconds since launch and the process's CPU seconds then
    (its own and its finished children's, from /proc; None where there is none), and the totals."""
    load_before = os.getloadavg()
    started = time.perf_counter()
    lines = []
    with open(log_path, "w") as log, subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            lines.append((time.perf_counter() - started, cpu_seconds(proc.pid), line.rstrip("\n")))
            log.write(line)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = "\n".join(x[2] for x in lines[-20:])
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode} (log: {log_path}):\n{tail}")
    return lines, {"wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
                   "load_average": {"before": [round(x, 2) for x in load_before],
                                    "after": [round(x, 2) for x in os.getloadavg()]}}


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def side_env(threads: int, cache: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONDONTWRITEBYTECODE": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache)}


def nanogpt_workdir(checkout: Path, text_path: Path, out: Path) -> Path:
    """A copy of the files of ``checkout`` the run uses, with ``text_path`` as its input.txt: nanoGPT
    reads and writes data/, config/ and its out_dir relative to where it runs, here."""
    missing = [name for name in NANOGPT_FILES if not (checkout / name).is_file()]
    if missing:
        raise SystemExit(f"--nanogpt {checkout}: not a nanoGPT checkout (no {', '.join(missing)})")
    shutil.rmtree(out, ignore_errors=True)
    for name in NANOGPT_FILES:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(checkout / name, out / name)
    shutil.copyfile(text_path, out / "data/shakespeare_char/input.txt")  # prepare.py downloads only when absent
    return out


def checkout_version(checkout: Path) -> dict:
    """Which nanoGPT ran: the checkout's git commit where it is a git checkout, and the sha256 of each file copied."""
    git = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                         text=True).stdout.split()
    own = len(git) == 2 and Path(git[0]).resolve() == checkout.resolve()  # not a folder inside another repository
    return {"path": str(checkout), "git_commit": git[1] if own else None,
            "sha256": {name: hashlib.sha256((checkout / name).read_bytes()).hexdigest() for name in NANOGPT_FILES}}


def parse_nanogpt(lines: list[tuple[float, float | None, str]]) -> dict:
    """nanoGPT's evaluations (``step N: train loss X, val loss Y``) when they were printed, and its
    iterations' losses and times (``iter N: loss X, time Yms``)."""
    evals, iters = [], []
    for t, cpu, line in lines:
        if m := NANOGPT_EVAL.match(line):
            evals.append({"step": int(m[1]), "train_loss": float(m[2]), "val_loss": float(m[3]), "wall_s": round(t, 2),
                          "cpu_s": cpu})
        elif m := NANOGPT_ITER.match(line):
            iters.append({"step": int(m[1]), "loss": float(m[2]), "ms": float(m[3])})
    if not evals:
        raise SystemExit("nanoGPT printed no evaluation line (`step N: train loss X, val loss Y`)")
    return {"evals": evals, "median_iter_ms": float(np.median([x["ms"] for x in iters[1:]])) if len(iters) > 1 else None}


def run_nanogpt(checkout: Path, text: str, text_path: Path, runs: Path, python: str, threads: int, quick: bool) -> dict:
    work = nanogpt_workdir(checkout, text_path, runs / "nanogpt")
    env = side_env(threads, runs / "inductor-cache")
    subprocess.run([python, "data/shakespeare_char/prepare.py"], cwd=work, env=env, check=True, capture_output=True)
    split = check_split(text, nanogpt_split(work / "data/shakespeare_char"), "nanoGPT's prepare.py")
    args = NANOGPT_ARGS + (QUICK["nanogpt"] if quick else [])
    print(f"== nanogpt: python train.py {' '.join(args)}", flush=True)
    lines, totals = run_timed([python, "-u", "train.py", *args], work, env, runs / "nanogpt.log")
    return {"command": "python train.py " + " ".join(args), "checkout": checkout_version(checkout), "split": split,
            **totals, **parse_nanogpt(lines)}


def parse_lmforge(lines: list[tuple[float, float | None, str]], run_dir: Path) -> dict:
    """lmforge's evaluations, timed by their console line (printed once the evaluation is done), with
    the full-precision loss of metrics.jsonl."""
    losses = {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}
    evals = [{"step": int(m[1]), "val_loss": losses[int(m[1])], "wall_s": round(t, 2), "cpu_s": cpu}
             for t, cpu, line in lines if (m := LMFORGE_EVAL.search(line))]
    steps = [r for r in read_metrics(run_dir) if "step_s" in r]
    return {"evals": evals, "first_step_s": round(steps[0]["step_s"], 2) if steps else None,
            "median_step_ms": round(1000 * float(np.median([r["step_s"] for r in steps[1:]])), 2) if len(steps) > 1 else None}


def run_lmforge(name: str, data: Path, runs: Path, threads: int, extra: list[str]) -> dict:
    recipe, own, cold = RECIPES[name]
    run_dir = runs / name
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"run_dir={run_dir}", f"tokenizer={data.parent / 'tokenizer'}", f"data.datasets=[{{path: {data}}}]",
                 "train.resume=never", "train.eval_batches=null", *own, *extra]
    print(f"== {name}: lmforge pretrain {recipe} {' '.join(own + extra)}", flush=True)
    cache = runs / "inductor-cache"
    if cold:
        shutil.rmtree(cache, ignore_errors=True)  # compiling counted in full, as on a first run
    lines, totals = run_timed([sys.executable, "-m", "lmforge", "pretrain", recipe, *overrides], REPO,
                              side_env(threads, cache), runs / f"{name}.log")
    return {"recipe": recipe, "overrides": own + extra, "compile_cache": "emptied first" if cold else "kept",
            **totals, **parse_lmforge(lines, run_dir)}


# -- the verdict

def first_below(evals: list[dict], target: float) -> dict | None:
    """The first evaluation at or below ``target``."""
    return next((e for e in evals if e["val_loss"] <= target), None)


def summarise(sides: dict[str, dict]) -> dict:
    """The target (nanoGPT's last validation loss here, else the README's), the reference time (nanoGPT's,
    else lmforge's nanoGPT-shaped recipe's, at its last evaluation), and when each lmforge side got there."""
    if "nanogpt" in sides:
        last = sides["nanogpt"]["evals"][-1]
        target, target_from = last["val_loss"], f"nanoGPT's validation loss at its step {last['step']}, on this text"
        reference, reference_from = last, "nanogpt"
    else:
        target, target_from = README_LOSS, "nanoGPT's README (2000 iterations on tiny-shakespeare, not this text)"
        reference = sides["lmforge_gpt2"]["evals"][-1] if "lmforge_gpt2" in sides else None
        reference_from = "proxy: lmforge_gpt2, nanoGPT's model and schedule in lmforge" if reference else None
    out = {"target_val_loss": target, "target_from": target_from, "reference": reference_from,
           "reference_wall_s": reference["wall_s"] if reference else None,
           "reference_cpu_s": reference["cpu_s"] if reference else None, "goal_ratio": GOAL_RATIO, "sides": {}}
    for name, side in sides.items():
        if name == "nanogpt":
            continue
        hit = first_below(side["evals"], target)
        row = {"reached": hit is not None, "step": hit and hit["step"], "wall_s": hit and hit["wall_s"],
               "cpu_s": hit and hit["cpu_s"], "final_val_loss": side["evals"][-1]["val_loss"] if side["evals"] else None}
        if hit and reference:
            row["wall_ratio"] = round(hit["wall_s"] / reference["wall_s"], 3)
            if hit["cpu_s"] is not None and reference["cpu_s"]:
                row["cpu_ratio"] = round(hit["cpu_s"] / reference["cpu_s"], 3)
        row["goal_met"] = bool(hit and reference and row["wall_ratio"] <= GOAL_RATIO) if reference else None
        out["sides"][name] = row
    fast = out["sides"].get(FAST)
    out["goal_met"] = fast["goal_met"] if fast else None
    return out


# -- output

def draw_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for name, side in result["sides"].items():
        evals = side["evals"]
        line, = axes[0].plot([e["wall_s"] for e in evals], [e["val_loss"] for e in evals], marker="o", ms=3, label=name)
        later = [e for e in evals if e["step"] > 0]  # the step axis is logarithmic
        axes[1].plot([e["step"] for e in later], [e["val_loss"] for e in later], marker="o", ms=3, color=line.get_color())
    for ax in axes:
        ax.axhline(s["target_val_loss"], color="grey", ls="--", lw=0.8, label=f"target {s['target_val_loss']:.4f}")
    if s["reference_wall_s"]:
        axes[0].axvline(s["reference_wall_s"] * GOAL_RATIO, color="grey", ls=":", lw=0.8,
                        label=f"1/3 of the reference's {s['reference_wall_s']:.0f} s")
    axes[0].set_xlabel("wall time since launch (s)")
    axes[1].set_xlabel("optimizer step")
    axes[1].set_xscale("log")
    axes[0].set_ylabel("validation loss (nats per character)")
    axes[0].legend(fontsize=7)
    losses = [e["val_loss"] for side in result["sides"].values() for e in side["evals"] if e["step"] > 0]
    low = min([s["target_val_loss"], *losses]) - 0.05
    axes[0].set_ylim(low, min(max(losses, default=3.0), max(3.0, low + 1.0)) + 0.05)  # the first 4.x would flatten the rest
    m = result["machine"]
    fig.suptitle(f"nanoGPT's shakespeare_char CPU run and lmforge on the same {result['text']['chars']:,} characters; "
                 f"{m['cpu']}, {m['cpus']} cores, {result['threads']} thread(s) a run", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result: dict) -> None:
    s = result["summary"]
    print(f"target {s['target_val_loss']:.4f} ({s['target_from']}); reference time "
          f"{s['reference_wall_s']} s ({s['reference']})")
    print(f"{'side':24} {'last step':>9} {'last val':>9} {'to target: step':>15} {'wall s':>8} {'cpu s':>8} {'ratio':>6}")
    for name, side in result["sides"].items():
        last, row = side["evals"][-1], s["sides"].get(name, {})
        print(f"{name:24} {last['step']:>9} {last['val_loss']:>9.4f} {row.get('step') or '-':>15} "
              f"{row.get('wall_s') or '-':>8} {row.get('cpu_s') or '-':>8} {row.get('wall_ratio') or '-':>6}")
    print(f"goal (lmforge_fast at the target within {GOAL_RATIO:.3f} of the reference's wall time): {s['goal_met']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (read only; its files are copied into the run)")
    p.add_argument("--nanogpt-python", default=sys.executable, help="the Python that runs nanoGPT (torch, numpy, requests)")
    p.add_argument("--sides", nargs="+", choices=SIDES, help=f"which runs, of {', '.join(SIDES)} (default: all "
                   "there is a checkout for)")
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads of every side (default 1)")
    p.add_argument("--quick", action="store_true", help="smoke run: 40,000 characters, 8 steps a side, no compilation")
    p.add_argument("--runs", help="where the runs write (default runs/nanogpt_bench, --quick runs/nanogpt_bench_quick)")
    p.add_argument("--out", help=f"results JSON (default {RESULTS}; --quick: <runs>/nanogpt.json)")
    p.add_argument("--plot", help=f"the figure (default {PLOT}; --quick: <runs>/nanogpt.png)")
    args = p.parse_args(argv)
    args.runs = Path(args.runs or ("runs/nanogpt_bench_quick" if args.quick else "runs/nanogpt_bench")).resolve()
    args.out = Path(args.out or (args.runs / "nanogpt.json" if args.quick else REPO / RESULTS))
    args.plot = Path(args.plot or (args.runs / "nanogpt.png" if args.quick else REPO / PLOT))
    args.sides = args.sides or [s for s in SIDES if s != "nanogpt" or args.nanogpt]
    if "nanogpt" in args.sides and args.nanogpt is None:
        p.error("--sides nanogpt needs --nanogpt PATH (a nanoGPT checkout)")
    if args.quick and not argv_names(argv, "--sides"):  # --quick compiles nothing: they would be lmforge_fast again
        args.sides = [s for s in args.sides if s not in COMPILED]
    return args


def argv_names(argv: list[str] | None, flag: str) -> bool:
    return flag in (argv if argv is not None else sys.argv[1:])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.runs.mkdir(parents=True, exist_ok=True)
    text = shakespeare_text(QUICK["chars"] if args.quick else TEXT_CHARS)
    text_path = args.runs / "input.txt"
    text_path.write_text(text, encoding="utf-8")
    data = prepare_lmforge(text_path, args.runs)
    split = check_split(text, lmforge_split(data, args.runs / "tokenizer"), "lmforge's prepare")
    started, sides = now(), {}
    extra = QUICK["lmforge"] if args.quick else []
    for name in args.sides:
        if name == "nanogpt":
            sides[name] = run_nanogpt(args.nanogpt.resolve(), text, text_path, args.runs, args.nanogpt_python,
                                      args.threads, args.quick)
        else:
            sides[name] = run_lmforge(name, data, args.runs, args.threads, extra)
    result = {**header("nanogpt", "nanogpt.py", argv, started), "quick": args.quick, "threads": args.threads,
              "figure": "validation loss (nats per character, the same validation characters) against wall time, "
                        "nanoGPT's shakespeare_char CPU run and lmforge's recipes",
              "text": {"source": SOURCE, "plays": list(PLAYS), "chars": len(text), "distinct_chars": len(set(text)),
                       "sha256": hashlib.sha256(text.encode()).hexdigest(),
                       "split": split},
              "sides": sides}
    result["summary"] = summarise(sides)
    write_result(result, args.out)
    draw_plot(result, args.plot)
    print_table(result)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
