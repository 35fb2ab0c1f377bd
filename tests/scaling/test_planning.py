from __future__ import annotations

import math

import numpy as np
import pytest

from lmforge.scaling.parametric import chinchilla_constants, compute_optimal
from lmforge.scaling.planning import (
    chinchilla_loss,
    data_constrained_loss,
    data_constrained_plan,
    deepseek_hyperparameters,
    optimal_allocation,
    overtrained_plan,
)
from tests.scaling.planted import TRUE

X = np.array([math.log(TRUE["A"]), math.log(TRUE["B"]), math.log(TRUE["E"]), TRUE["alpha"], TRUE["beta"]])
K = {k: float(v[0]) for k, v in chinchilla_constants(X).items()}


def test_muennighoff_et_al_s_worked_example_is_reproduced():
    """The datablations README: their fitted law at (N, D, U_D) = (6.34e9, 242e9, 25e9) and (8.67e9, 178e9, 25e9)."""
    x = np.array([6.255414, 7.3049974, 0.6254804, 0.3526596, 0.3526596])
    k = {name: float(v[0]) for name, v in chinchilla_constants(x).items()}
    assert float(data_constrained_loss(k, 6.34e9, 242e9, 25e9)) == pytest.approx(2.2256440889984477, rel=1e-9)
    assert float(data_constrained_loss(k, 8.67e9, 178e9, 25e9)) == pytest.approx(2.2269634075087867, rel=1e-9)


def test_with_plenty_of_unique_data_the_constrained_plan_is_the_compute_optimal_one():
    plan = data_constrained_plan(X, np.empty((0, 5)), 1e21, unique_tokens=1e15, level=0.9)
    n_opt, _ = compute_optimal(X, 1e21)
    assert plan["params"] == pytest.approx(n_opt[0, 0], rel=0.01)
    assert plan["loss"] == pytest.approx(plan["unconstrained_loss"], rel=1e-6)


def test_scarce_data_moves_the_plan_to_more_epochs_at_a_higher_loss_than_unlimited_data():
    plan = data_constrained_plan(X, np.empty((0, 5)), 1e21, unique_tokens=5e9, level=0.9)
    assert plan["loss"] > plan["unconstrained_loss"]
    assert plan["loss"] <= plan["compute_optimal_loss_with_repeats"] + 1e-12
    assert plan["epochs"] > 1


def test_the_overtrained_plan_reaches_the_same_loss_for_fewer_flops_in_all():
    c, inference = 1e21, 1e13
    plan = overtrained_plan(X, np.empty((0, 5)), c, inference, level=0.9)
    assert float(chinchilla_loss(K, plan["params"], plan["tokens"])) == pytest.approx(plan["loss"], rel=1e-9)
    assert plan["total_flops"] < plan["compute_optimal_total_flops"]
    # against a brute-force search along the iso-loss curve
    n = np.geomspace(plan["params"] / 3, plan["params"] * 3, 200001)
    left = plan["loss"] - K["E"] - K["A"] / n ** K["alpha"]
    d = np.where(left > 0, (K["B"] / np.where(left > 0, left, 1)) ** (1 / K["beta"]), np.inf)
    best = n[np.argmin(6 * n * d + 2 * n * inference)]
    assert plan["params"] == pytest.approx(best, rel=1e-3)


def test_without_inference_the_overtrained_plan_is_the_compute_optimal_one():
    plan = overtrained_plan(X, np.empty((0, 5)), 1e21, 1.0, level=0.9)
    n_opt, _ = compute_optimal(X, 1e21)
    assert plan["params"] == pytest.approx(n_opt[0, 0], rel=1e-3)


def test_bootstrap_samples_give_an_interval_around_the_allocation():
    rng = np.random.default_rng(0)
    samples = X + rng.normal(0, [0.1, 0.1, 0.01, 0.005, 0.005], (50, 5))
    alloc = optimal_allocation(X, samples, 1e21, level=0.9)
    assert alloc.params_range["low"] < alloc.params < alloc.params_range["high"]
    assert alloc.params * alloc.tokens * 6 == pytest.approx(1e21)


def test_deepseek_rules_at_a_budget():
    h = deepseek_hyperparameters(1e20)
    assert h["batch_tokens"] == pytest.approx(0.2920 * 1e20 ** 0.3271)
    assert h["lr"] == pytest.approx(0.3118 * 1e20 ** -0.125)
    assert 1e6 < h["batch_tokens"] < 3e6 and 5e-4 < h["lr"] < 2e-3
