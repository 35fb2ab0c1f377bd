from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import check_grad

from lmforge.scaling.parametric import (
    CHINCHILLA,
    KAPLAN,
    chinchilla_constants,
    compute_optimal,
    constants_table,
    fit_law,
    huber_objective,
)
from lmforge.scaling.runs import read_runs
from tests.scaling.planted import TRUE, law, runs_from

REPO = Path(__file__).resolve().parents[2]
# beside the checkout (../shared), or beside the folder of worktrees it is one of
EPOCH = next((p for base in (REPO.parent, REPO.parent.parent)
              if (p := base / "shared" / "data" / "reference" / "epoch_chinchilla_svg_extracted_data.csv").is_file()),
             REPO.parent / "shared" / "data" / "reference" / "epoch_chinchilla_svg_extracted_data.csv")


def grid_runs(noise=0.0, seed=0):
    n, d = np.meshgrid(np.geomspace(1e7, 3e9, 6), np.geomspace(3e8, 3e11, 6))
    return runs_from(n.ravel(), d.ravel(), noise, seed)


@pytest.mark.parametrize("form,x", [(CHINCHILLA, [6.0, 7.0, 0.5, 0.3, 0.35]), (KAPLAN, [30.0, 30.0, 0.08, 0.1])])
def test_the_analytic_gradient_matches_finite_differences(form, x):
    runs = grid_runs(noise=0.02)
    args = (form, np.log(runs.params), np.log(runs.tokens), np.log(runs.loss), 1e-3)
    x = np.array(x)
    err = check_grad(lambda v: huber_objective(v, *args)[0], lambda v: huber_objective(v, *args)[1], x)
    assert err < 1e-5 * np.linalg.norm(huber_objective(x, *args)[1])


def test_noise_free_runs_give_back_the_planted_constants():
    fit = fit_law(CHINCHILLA, grid_runs(), bootstrap=0, grid_stride=2)
    got = {k: float(v[0]) for k, v in chinchilla_constants(fit.vector()).items()}
    for name, value in TRUE.items():
        assert got[name] == pytest.approx(value, rel=1e-3), name
    assert fit.r2 > 0.999999 and not fit.at_bound


def test_noisy_runs_give_the_constants_back_within_their_bootstrap_intervals():
    fit = fit_law(CHINCHILLA, grid_runs(noise=0.003, seed=1), bootstrap=30, grid_stride=2, seed=0)
    table = constants_table(fit, 0.99)
    for name in ("alpha", "beta"):
        assert table[name]["estimate"] == pytest.approx(TRUE[name], abs=0.03)
    assert table["E"]["estimate"] == pytest.approx(TRUE["E"], abs=0.05)
    a_true = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
    assert table["a"]["low"] - 0.01 <= a_true <= table["a"]["high"] + 0.01
    assert table["alpha"]["se"] > 0  # the bootstrap refits move


def test_kaplans_law_is_recovered_from_runs_drawn_from_it():
    n, d = np.meshgrid(np.geomspace(1e6, 1e9, 6), np.geomspace(1e8, 1e11, 6))
    n, d = n.ravel(), d.ravel()
    nc, dc, an, ad = 8.8e13, 5.4e13, 0.076, 0.095
    loss = ((nc / n) ** (an / ad) + dc / d) ** ad
    runs = runs_from(n, d)
    runs.loss = loss
    fit = fit_law(KAPLAN, runs, bootstrap=0, grid_stride=2)
    assert fit.params["alpha_N"] == pytest.approx(an, rel=1e-3)
    assert fit.params["alpha_D"] == pytest.approx(ad, rel=1e-3)
    assert np.exp(fit.params["log_Nc"]) == pytest.approx(nc, rel=2e-2)


def test_the_compute_optimal_allocation_minimises_the_law_at_fixed_flops():
    x = np.array([np.log(TRUE["A"]), np.log(TRUE["B"]), np.log(TRUE["E"]), TRUE["alpha"], TRUE["beta"]])
    c = 1e21
    n_opt, d_opt = compute_optimal(x, c)
    grid = np.geomspace(n_opt[0, 0] / 10, n_opt[0, 0] * 10, 20001)
    best = grid[np.argmin(law(grid, c / (6 * grid)))]
    assert n_opt[0, 0] == pytest.approx(best, rel=1e-3)
    assert n_opt[0, 0] * d_opt[0, 0] * 6 == pytest.approx(c)


@pytest.mark.skipif(not EPOCH.is_file(), reason=f"reference data not found at {EPOCH}")
def test_the_chinchilla_data_gives_besiroglu_et_al_s_refit():
    """Besiroglu et al. 2024 (analyzing-chinchilla, data_analysis.ipynb): E = 1.82, A = 482.0,
    B = 2085.4, α = 0.3478, β = 0.3658 (SE of log A 0.258, log B 0.421, log E 0.014, α 0.015,
    β 0.021), on the 240 points left after dropping the 5 highest losses. Their L-BFGS run from
    the grid gave A = 477.8, B = 2143.9, E = 1.817, α = 0.3473, β = 0.3672, as this fit does."""
    runs = read_runs(EPOCH)
    runs = runs.subset(runs.loss < np.sort(runs.loss)[-5])
    fit = fit_law(CHINCHILLA, runs, bootstrap=12, grid_stride=2, seed=0)
    k = {name: float(v[0]) for name, v in chinchilla_constants(fit.vector()).items()}
    assert k["E"] == pytest.approx(1.82, abs=0.01)
    assert k["alpha"] == pytest.approx(0.3478, abs=0.005)
    assert k["beta"] == pytest.approx(0.3658, abs=0.005)
    assert k["A"] == pytest.approx(482.0, rel=0.05)
    assert k["B"] == pytest.approx(2085.4, rel=0.05)
    assert fit.objective == pytest.approx(0.00101827, rel=1e-4)  # their best Huber sum
    table = constants_table(fit, 0.95)
    assert 0.005 < table["alpha"]["se"] < 0.05 and 0.1 < table["log_B"]["se"] < 1.0
