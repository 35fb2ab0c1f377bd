"""What a benchmark's JSON records about the run beside its numbers: the machine (``lmforge doctor``'s
CPU description: model, the speed-relevant flags such as AMX, cores, torch threads), the date, the
command and the commit, so a figure in the docs names where and how it was measured; and what the
training benchmarks share (their options, the data their recipes name, a figure's provenance line)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lmforge.stages.doctor import cpu_info

REPO = Path(__file__).resolve().parents[1]


def machine(device: str | torch.device | None = None) -> dict:
    """The CPU, and with ``device`` (the benchmark's torch device) its name: a GPU's model."""
    cpu = cpu_info()
    flags = f" ({', '.join(cpu['flags'])})" if cpu["flags"] else ""
    name = None if device is None else (
        torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else str(device))
    on = f", {name}" if name and name != "cpu" else ""
    return {"platform": platform.platform(), "cpu": cpu["model"], "flags": cpu["flags"], "cpus": cpu["usable_cores"],
            "torch": torch.__version__, "torch_threads": cpu["torch_threads"], "python": platform.python_version(),
            **({"device": name} if name else {}),
            "summary": f"{cpu['model']}{flags}, {cpu['usable_cores']} cores, torch {torch.__version__}{on}"}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def command(script: str, argv: list[str] | None) -> str:
    return " ".join([f"python benchmarks/{script}", *(argv if argv is not None else sys.argv[1:])])


def commit() -> str | None:
    """HEAD, marked when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return head + ("+uncommitted changes" if dirty else "")


def header(benchmark: str, script: str, argv: list[str] | None, started: str) -> dict:
    """The keys every results JSON opens with: what ran, when (``started``, of ``now``), where, from
    which commit and by which command."""
    return {"benchmark": benchmark, "date": started, "machine": machine(), "commit": commit(),
            "command": command(script, argv)}


def write_result(result: dict, path: Path, indent: int = 1) -> None:
    """``result`` as the JSON file ``path`` (its folder made as needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


# --------------------------------------------------------------------------- what the training benchmarks share


def parse_training_args(p: argparse.ArgumentParser, name: str, results: str, plot: str, quick: str,
                        argv: list[str] | None) -> argparse.Namespace:
    """``p``'s options and those every training benchmark shares, parsed: ``--quick`` (``quick`` says what
    it runs), ``--replot``, ``--set`` (dotted overrides for every run), ``--runs`` (runs/<name>, or
    runs/<name>_quick), ``--out`` and ``--plot`` (``results`` and ``plot``; a quick run's beside its runs)."""
    p.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    p.add_argument("--replot", action="store_true", help="draw the figure again from --out's JSON, then stop")
    p.add_argument("--set", nargs="*", default=[], help="more dotted overrides for every run (e.g. train.max_steps=300)")
    p.add_argument("--runs", help=f"where the runs write (default runs/{name}, --quick runs/{name}_quick)")
    p.add_argument("--out", help=f"results JSON (default {results}; --quick: <runs>/{name}.json)")
    p.add_argument("--plot", help=f"the figure (default {plot}; --quick: <runs>/{name}.png)")
    args = p.parse_args(argv)
    args.runs = Path(args.runs or (f"runs/{name}_quick" if args.quick else f"runs/{name}"))
    args.out = Path(args.out or (args.runs / f"{name}.json" if args.quick else results))
    args.plot = Path(args.plot or (args.runs / f"{name}.png" if args.quick else plot))
    return args


def replotted(args: argparse.Namespace, draw_plot: Callable[[dict, Path], None]) -> bool:
    """With ``--replot``: the figure drawn again from ``--out``'s JSON (True: the benchmark stops there)."""
    if args.replot:
        draw_plot(json.loads(args.out.read_text()), args.plot)
        print(f"wrote {args.plot}")
    return args.replot


def made_once(tokenizer_recipe: str, prepare_recipe: str, overrides: list[str]) -> None:
    """The tokenizer and token shards the benchmark's recipes name, made once (kept for later runs);
    nothing when ``overrides`` bring a tokenizer or datasets of their own."""
    from lmforge.core.config import load_config
    from lmforge.stages.prepare import PrepareRecipe, run_prepare
    from lmforge.stages.tokenizer import TokenizerRecipe, run_tokenizer

    if any(k.startswith(("tokenizer=", "data.datasets=")) for k in overrides):
        return
    tokenizer = load_config(TokenizerRecipe, REPO / tokenizer_recipe)
    if not (REPO / tokenizer.run_dir / "tokenizer.json").is_file():
        run_tokenizer(tokenizer)
    prepare = load_config(PrepareRecipe, REPO / prepare_recipe)
    if not (REPO / prepare.run_dir / "manifest.json").is_file():
        run_prepare(prepare)


def machine_line(result: dict) -> str:
    """A figure's provenance: the CPU, its cores, torch, and the date of ``result`` (a results JSON)."""
    m = result["machine"]
    return f"{m['cpu']}, {m['cpus']} cores, torch {m['torch']}, {result['date'][:10]}"
