"""What a benchmark's JSON records about the run beside its numbers: the machine (``lmforge doctor``'s
CPU description: model, the speed-relevant flags such as AMX, cores, torch threads), the date, the
command and the commit, so a figure in the docs names where and how it was measured."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
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
