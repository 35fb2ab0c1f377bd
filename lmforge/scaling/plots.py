"""The fit's figures (matplotlib, Agg): residuals of the parametric laws, the IsoFLOP profiles,
and N_opt against C from every approach."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmforge.scaling.analysis import Analysis
from lmforge.scaling.parametric import compute_optimal


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_residuals(result: Analysis, path: Path) -> None:
    plt = _pyplot()
    fits = [f for f in (result.chinchilla, result.kaplan) if f is not None]
    fig, axes = plt.subplots(1, len(fits), figsize=(5.5 * len(fits), 4), squeeze=False)
    for ax, fit in zip(axes[0], fits):
        sc = ax.scatter(result.runs.flops, fit.residuals, c=np.log10(result.runs.params), s=12, cmap="viridis")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs C")
        ax.set_ylabel("log L − log L̂")
        ax.set_title(f"{fit.form}: R² = {fit.r2:.4f}")
        fig.colorbar(sc, ax=ax, label="log10 N")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_isoflops(result: Analysis, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    cmap = plt.get_cmap("plasma")
    budgets = result.isoflop.budgets
    for i, b in enumerate(budgets):
        color = cmap(i / max(len(budgets) - 1, 1))
        n = result.runs.params[b.runs]
        ax.scatter(n, result.runs.loss[b.runs], s=10, color=color)
        grid = np.linspace(np.log(n.min()), np.log(n.max()), 50)
        ax.plot(np.exp(grid), np.polyval(b.coeffs, grid), color=color, lw=1, label=f"C = {b.flops:.2g} FLOPs")
        ax.plot([b.n_opt], [b.loss_opt], "k*", ms=7)
    if budgets:
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("loss")
    ax.set_title("Approach 2: IsoFLOP profiles (★ minima)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_optimal(result: Analysis, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    c = np.geomspace(result.runs.flops.min(), result.runs.flops.max() * 100, 50)
    if result.envelope is not None:
        law = result.envelope.n_opt
        ax.plot(c, law(c), label=f"Approach 1: a = {law.exponent:.3f}")
    if result.isoflop is not None:
        law = result.isoflop.n_opt
        ax.plot(c, law(c), label=f"Approach 2: a = {law.exponent:.3f}")
        ax.scatter([b.flops for b in result.isoflop.budgets], [b.n_opt for b in result.isoflop.budgets], s=14)
    if result.chinchilla is not None:
        n, _ = compute_optimal(result.chinchilla.vector(), c)
        p = result.chinchilla.params
        ax.plot(c, n[0], label=f"Approach 3: a = {p['beta'] / (p['alpha'] + p['beta']):.3f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training FLOPs C")
    ax.set_ylabel("compute-optimal N")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(result: Analysis, out: Path) -> list[str]:
    written = []
    if result.chinchilla is not None:
        plot_residuals(result, out / "residuals.png")
        written.append("residuals.png")
    if result.isoflop is not None:
        plot_isoflops(result, out / "isoflops.png")
        written.append("isoflops.png")
    plot_optimal(result, out / "optimal.png")
    written.append("optimal.png")
    return written
