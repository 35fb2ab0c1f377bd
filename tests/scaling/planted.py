"""Runs simulated from known Chinchilla constants, for tests that recover them."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from lmforge.scaling.runs import Runs

TRUE = {"E": 1.7, "A": 400.0, "B": 1500.0, "alpha": 0.33, "beta": 0.30}


def law(n, d, k=TRUE):
    return k["E"] + k["A"] / np.asarray(n) ** k["alpha"] + k["B"] / np.asarray(d) ** k["beta"]


def runs_from(n, d, noise: float = 0.0, seed: int = 0) -> Runs:
    n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
    loss = law(n, d) * (np.exp(np.random.default_rng(seed).normal(0, noise, n.shape)) if noise else 1.0)
    return Runs([f"r{i}" for i in range(len(n))], n, d, 6 * n * d, loss, list(range(2, len(n) + 2)), "planted")


def isoflop_runs(budgets=(1e18, 1e19, 1e20, 1e21), sizes: int = 7, noise: float = 0.0, seed: int = 0) -> Runs:
    """Per budget, model sizes log-spaced over ±1 decade around the true compute-optimal N."""
    a = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
    g = (TRUE["alpha"] * TRUE["A"] / (TRUE["beta"] * TRUE["B"])) ** (1 / (TRUE["alpha"] + TRUE["beta"]))
    n, d = [], []
    for c in budgets:
        n_opt = g * (c / 6) ** a
        for size in np.geomspace(n_opt / 10, n_opt * 10, sizes):
            n.append(size)
            d.append(c / (6 * size))
    return runs_from(n, d, noise, seed)


def write_csv(path: Path, runs: Runs, flops: bool = True) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "params", "tokens", "flops", "loss"])
        for i in range(len(runs)):
            w.writerow([runs.names[i], runs.params[i], runs.tokens[i], runs.flops[i] if flops else "", runs.loss[i]])
    return path
