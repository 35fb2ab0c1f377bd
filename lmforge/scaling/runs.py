"""The runs a scaling-law fit reads: one CSV row per training run (final loss), and optionally
the runs' training curves (one row per logged step).

    run,params,tokens,flops,loss          runs.csv (written by `lmforge sweep`, or by hand)
    run,step,params,tokens,flops,loss     curves.csv (for Approach 1's envelope)

``params`` is N, the non-embedding parameter count (every weight but the token embedding and
the output head, Kaplan et al. 2020's N) unless the sweep says otherwise; the fit does not care
which, but a plan reads its N the same way (``plan.params``). ``tokens`` is D, the training
tokens; ``flops`` is C, the training FLOPs: left empty, C = 6·N·D (Kaplan et al. 2020, eq. 2.1).
Either of tokens and flops may be missing, then it is derived from the other with the same rule.
Aliases: ``N``/``D``/``C``, and Epoch AI's extraction of Hoffmann et al.'s Figure 4
(``Model Size``, ``Training FLOP``).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.core.io import InputError

ALIASES = {
    "run": ("run", "name"),
    "step": ("step",),
    "params": ("params", "N", "Model Size"),
    "tokens": ("tokens", "D", "Training Tokens"),
    "flops": ("flops", "C", "Training FLOP"),
    "loss": ("loss", "L"),
}


@dataclass
class Runs:
    """Points (N, D, C, loss), one per run or per logged step of a run, with where each came from."""

    names: list[str]
    params: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    loss: np.ndarray
    lines: list[int]  # the CSV line of each point (the header is line 1)
    source: str
    steps: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.loss)

    def subset(self, keep: np.ndarray) -> Runs:
        idx = np.flatnonzero(keep) if keep.dtype == bool else keep
        return Runs([self.names[i] for i in idx], self.params[idx], self.tokens[idx], self.flops[idx],
                     self.loss[idx], [self.lines[i] for i in idx], self.source,
                     None if self.steps is None else self.steps[idx])


def _column(header: list[str], key: str) -> str | None:
    lowered = {h.strip().lower(): h for h in header}
    return next((lowered[a.lower()] for a in ALIASES[key] if a.lower() in lowered), None)


def _number(text: str, path: Path, line: int, column: str) -> float | None:
    text = (text or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{path}:{line}: column {column!r} = {text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"{path}:{line}: column {column!r} = {text!r}: a scaling-law fit needs a positive, "
                         "finite value (it takes logarithms)")
    return value


def _step(text: str | None, path: Path, line: int, column: str) -> int:
    try:
        return int((text or "").strip())
    except ValueError:
        raise InputError(f"{path}:{line}: column {column!r} = {text!r} is not a step number") from None


def read_runs(path: str | Path, curves: bool = False) -> Runs:
    """Read a runs CSV (or, with ``curves``, a training-curves CSV that also has ``step``)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file (a CSV with columns run,params,tokens,flops,loss)")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        cols = {key: _column(header, key) for key in ALIASES}
        need = ["params", "loss"] + (["step"] if curves else [])
        missing = [k for k in need if cols[k] is None]
        if cols["tokens"] is None and cols["flops"] is None:
            missing.append("tokens or flops")
        if missing:
            raise InputError(f"{path}:1: missing column(s) {', '.join(missing)}; found {header or 'no header'}. "
                             "A fit needs run,params,tokens,flops,loss (flops may be empty: C = 6·N·D)"
                             + (" and step for curves" if curves else ""))
        names, n, d, c, loss, lines, steps = [], [], [], [], [], [], []
        for line, row in enumerate(reader, start=2):
            values = {k: _number(row.get(cols[k]), path, line, cols[k]) if cols[k] else None
                      for k in ("params", "tokens", "flops", "loss")}
            for k in ("params", "loss"):
                if values[k] is None:
                    raise InputError(f"{path}:{line}: column {cols[k]!r} is empty")
            if values["tokens"] is None and values["flops"] is None:
                raise InputError(f"{path}:{line}: both tokens and flops are empty: give at least one (C = 6·N·D)")
            tokens = values["tokens"] if values["tokens"] is not None else values["flops"] / (6 * values["params"])
            flops = values["flops"] if values["flops"] is not None else 6 * values["params"] * tokens
            name = (row.get(cols["run"]) or "").strip() if cols["run"] else ""
            names.append(name or f"line {line}")
            n.append(values["params"])
            d.append(tokens)
            c.append(flops)
            loss.append(values["loss"])
            lines.append(line)
            if curves:
                steps.append(_step(row.get(cols["step"]), path, line, cols["step"]))
    if not loss:
        raise InputError(f"{path}: no rows after the header")
    return Runs(names, np.array(n), np.array(d), np.array(c), np.array(loss), lines, str(path),
                np.array(steps) if curves else None)


def require_points(runs: Runs, n_params: int, what: str) -> None:
    """A fit of ``n_params`` parameters needs more points than parameters."""
    if len(runs) <= n_params:
        raise InputError(f"{runs.source}: {len(runs)} point(s), but {what} has {n_params} parameters: "
                         f"it needs at least {n_params + 1} runs (more than 5 per parameter constrain it well)")
