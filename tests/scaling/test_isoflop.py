from __future__ import annotations

import numpy as np
import pytest

from lmforge.core.io import InputError
from lmforge.scaling.isoflop import fit_envelope, fit_isoflop, fit_power_law, frontier, group_budgets
from lmforge.scaling.runs import Runs
from tests.scaling.planted import TRUE, isoflop_runs, law

A_TRUE = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])


def test_a_power_law_through_exact_points_has_its_exponent_and_no_error():
    c = np.geomspace(1e18, 1e22, 5)
    law_ = fit_power_law(c, 3.0 * c ** 0.5)
    assert law_.exponent == pytest.approx(0.5) and law_.coefficient == pytest.approx(3.0) and law_.se < 1e-9


def test_runs_within_the_tolerance_form_one_budget():
    groups = group_budgets(np.array([1e19, 1.05e19, 0.98e19, 1e20, 1.1e20]), tolerance=0.05)
    assert sorted(len(g) for g in groups) == [2, 3]


def test_isoflop_profiles_recover_the_planted_exponents():
    fit = fit_isoflop(isoflop_runs(sizes=9))
    assert len(fit.budgets) == 4 and all(b.inside for b in fit.budgets)
    # the parabola in log N is an approximation of the profile: its vertex is near, not at, the optimum
    assert fit.n_opt.exponent == pytest.approx(A_TRUE, abs=0.01)
    assert fit.d_opt.exponent == pytest.approx(1 - A_TRUE, abs=0.01)


def test_a_single_flop_budget_is_an_error_that_says_what_approach_2_needs():
    with pytest.raises(InputError, match="Approach 2.*at least 2 FLOP budgets.*found 1"):
        fit_isoflop(isoflop_runs(budgets=(1e19,)))


def test_too_few_runs_per_budget_earns_a_warning():
    fit = fit_isoflop(isoflop_runs(sizes=4))
    assert any("only 4 runs" in w for w in fit.warnings)


def test_the_frontier_keeps_each_new_lowest_loss():
    flops = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    loss = np.array([5.0, 4.0, 4.5, 3.0, 3.5])
    assert frontier(flops, loss).tolist() == [0, 1, 3]


def test_the_envelope_of_planted_training_curves_gives_the_planted_exponent():
    names, n, d = [], [], []
    for size in np.geomspace(1e7, 1e10, 16):
        tokens = np.geomspace(1e8, 1e12, 200)
        n += [size] * len(tokens)
        d += list(tokens)
        names += [f"{size:.3g}"] * len(tokens)
    n, d = np.array(n), np.array(d)
    curves = Runs(names, n, d, 6 * n * d, law(n, d), list(range(len(n))), "planted")
    fit = fit_envelope(curves)
    # the envelope hops between the 16 sizes, so its slope is that of a staircase around the law
    assert fit.n_opt.exponent == pytest.approx(A_TRUE, abs=0.03)
    assert fit.d_opt.exponent == pytest.approx(1 - A_TRUE, abs=0.03)


def test_an_envelope_of_one_size_is_an_error():
    n = np.full(5, 1e8)
    d = np.geomspace(1e9, 1e11, 5)
    with pytest.raises(InputError, match="Approach 1.*single model size"):
        fit_envelope(Runs(["a"] * 5, n, d, 6 * n * d, law(n, d), list(range(5)), "one.csv"))


def test_a_nearly_flat_profile_is_skipped_with_a_warning_not_extrapolated_to_overflow():
    good = isoflop_runs(budgets=(1e18, 1e19), sizes=5)
    n = np.geomspace(1e8, 1e9, 5)
    log_n = np.log(n)
    flat = 3.0 - 0.01 * log_n + 1e-9 * log_n ** 2  # its minimum at log N = 5e6
    runs = Runs(good.names + [f"f{i}" for i in range(5)], np.concatenate([good.params, n]),
                np.concatenate([good.tokens, 1e21 / (6 * n)]), np.concatenate([good.flops, np.full(5, 1e21)]),
                np.concatenate([good.loss, flat]), list(range(2, 17)), "planted")
    fit = fit_isoflop(runs)
    assert [round(np.log10(b.flops)) for b in fit.budgets] == [18, 19]
    assert any("C = 1e+21 has its minimum at log N = 5e+06, over 3 decades outside" in w for w in fit.warnings)


def test_too_few_usable_budgets_is_one_line_saying_why_each_was_skipped():
    n = np.array([1e8, 3e8, 1e9] * 2 + [1e8, 1e9])
    c = np.array([1e18] * 3 + [1e19] * 3 + [1e20] * 2)
    down = 3.0 - 0.1 * (np.log(n[:3]) - np.log(3e8)) ** 2  # a hump: the parabola opens downward
    loss = np.concatenate([down, down - 0.5, [2.0, 1.9]])
    runs = Runs([f"r{i}" for i in range(8)], n, c / (6 * n), c, loss, list(range(2, 10)), "runs.csv")
    with pytest.raises(InputError) as info:
        fit_isoflop(runs)
    message = str(info.value)
    assert "\n" not in message and message.startswith("runs.csv: Approach 2")
    assert "found 0 usable of 3: C = 1e+18, 1e+19: opens downward; C = 1e+20: only 2 model sizes. " in message
