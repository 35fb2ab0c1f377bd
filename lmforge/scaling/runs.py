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
(``Model Size``, ``Training FLOP``). Every value must lie in ``LIMITS`` (positive, finite, and
within what any training run has spent, by orders of magnitude): a fit takes logarithms and
powers of them, so a ``1e300`` overflows it; a value outside is refused naming its line.
"""

from __future__ import annotations

import csv
import io
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

# (low, high) of each value, far beyond any run trained so far (GPT-4-class runs: ~1e12 parameters,
# ~1e13 tokens, ~1e25 FLOPs), close enough that the fit's powers and logs stay finite
LIMITS = {"params": (1.0, 1e16), "tokens": (1.0, 1e18), "flops": (1.0, 1e36), "loss": (0.0, 100.0)}
MAX_STEP = 2**62


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


def _number(text: str, path: Path, line: int, column: str, key: str) -> float | None:
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
    _check_range(value, path, line, key, f"column {column!r} = {text!r}")
    return value


def _check_range(value: float, path: Path, line: int, key: str, what: str) -> None:
    low, high = LIMITS[key]
    if not low <= value <= high:
        unit = {"params": "parameters", "tokens": "tokens", "flops": "FLOPs", "loss": "nats per token"}[key]
        hint = " (is it a perplexity? give the loss, its logarithm)" if key == "loss" else ""
        raise InputError(f"{path}:{line}: {what} is outside {low:g} to {high:g} {unit}, the range a fit "
                         f"accepts{hint}; correct or remove the row")


def _step(text: str | None, path: Path, line: int, column: str) -> int:
    try:
        step = int((text or "").strip())
    except ValueError:
        raise InputError(f"{path}:{line}: column {column!r} = {text!r} is not a step number") from None
    if not 0 <= step <= MAX_STEP:
        raise InputError(f"{path}:{line}: column {column!r} = {text!r}: a step is a count from 0 to {MAX_STEP}")
    return step


def _text(path: Path) -> str:
    """The file as text; a binary or non-UTF-8 file is an error naming the line of its first bad byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise InputError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}): a runs CSV is text, "
                         "run,params,tokens,flops,loss") from None


def read_runs(path: str | Path, curves: bool = False) -> Runs:
    """Read a runs CSV (or, with ``curves``, a training-curves CSV that also has ``step``)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file (a CSV with columns run,params,tokens,flops,loss)")
    reader = csv.DictReader(io.StringIO(_text(path), newline=""))
    try:
        return _read_rows(reader, path, curves)
    except csv.Error as exc:
        raise InputError(f"{path}:{reader.line_num + 1}: not a readable CSV row ({exc})") from None


def _read_rows(reader: csv.DictReader, path: Path, curves: bool) -> Runs:
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
    for row in reader:
        line = reader.line_num
        values = {k: _number(row.get(cols[k]), path, line, cols[k], k) if cols[k] else None
                  for k in ("params", "tokens", "flops", "loss")}
        for k in ("params", "loss"):
            if values[k] is None:
                raise InputError(f"{path}:{line}: column {cols[k]!r} is empty")
        if values["tokens"] is None and values["flops"] is None:
            raise InputError(f"{path}:{line}: both tokens and flops are empty: give at least one (C = 6·N·D)")
        tokens = values["tokens"] if values["tokens"] is not None else values["flops"] / (6 * values["params"])
        flops = values["flops"] if values["flops"] is not None else 6 * values["params"] * tokens
        if values["tokens"] is None:
            _check_range(tokens, path, line, "tokens", f"tokens = flops / (6 params) = {tokens:.3g}")
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
