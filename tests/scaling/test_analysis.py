from __future__ import annotations

import numpy as np
import pytest

import lmforge.scaling.analysis as analysis
from lmforge.core.config import ConfigError
from lmforge.core.io import InputError
from lmforge.scaling.analysis import Analysis, FitSettings, agreement_warnings, analyse, markdown, summary
from lmforge.scaling.isoflop import EnvelopeFit, IsoFlopFit, PowerLaw
from tests.scaling.planted import isoflop_runs, runs_from

FAST = FitSettings(bootstrap=10, grid_stride=2)


def test_runs_that_hardly_vary_d_earn_a_poorly_constrained_warning():
    n = np.geomspace(1e7, 1e10, 12)
    d = np.full(12, 1e10) * np.linspace(1, 1.02, 12)
    result = analyse(runs_from(n, d, noise=0.01, seed=3), None, FitSettings(approaches=[3], bootstrap=10,
                                                                           grid_stride=2))
    chinchilla = [w for w in result.warnings if w.startswith("chinchilla")]
    assert any("bound" in w or "poorly constrained" in w or "known only within" in w for w in chinchilla), chinchilla


def test_approaches_that_disagree_are_named():
    law = PowerLaw(0.5, 0.01, 1.0, 5)
    result = Analysis(runs_from([1e8, 1e9], [1e9, 1e10]), FitSettings(agreement=0.05),
                      isoflop=IsoFlopFit([], law, law), envelope=EnvelopeFit([], PowerLaw(0.6, 0.01, 1.0, 5), law))
    warnings = agreement_warnings(result)
    assert len(warnings) == 1 and "0.600 (approach_1) vs 0.500 (approach_2)" in warnings[0]


def test_planted_isoflop_runs_agree_and_the_summary_has_every_part():
    result = analyse(isoflop_runs(sizes=7, noise=0.002), None, FAST)
    s = summary(result)
    assert s["agree"] and set(s["exponents"]) == {"approach_1", "approach_2", "approach_3"}
    assert len(s["chinchilla"]["bootstrap"]) == 10 and "kaplan" in s
    text = markdown(result, s)
    assert "| beta |" in text and "Agreement (all a within 0.05): yes" in text


@pytest.mark.parametrize(("k", "message"), [(20, "leaves out all 20 runs of planted; set it below 20"),
                                            (100, "leaves out all 20 runs")])
def test_excluding_every_run_is_a_config_error_naming_the_key(k, message):
    with pytest.raises(ConfigError, match=rf"^fit.exclude_highest = {k} {message}"):
        analyse(isoflop_runs(sizes=5), None, FitSettings(approaches=[2], exclude_highest=k))


def test_excluding_the_highest_losses_keeps_the_others():
    runs = isoflop_runs(sizes=5)
    result = analyse(runs, None, FitSettings(approaches=[2], exclude_highest=3))
    assert sorted(result.runs.loss) == sorted(runs.loss)[:-3]


def test_approach_2_s_check_fails_before_any_approach_3_fit(monkeypatch):
    def no_fit(*args, **kwargs):
        raise AssertionError("Approach 3 fitted before Approach 2's check")

    monkeypatch.setattr(analysis, "fit_law", no_fit)
    runs = isoflop_runs(budgets=(1e19,), sizes=6)  # one budget: Approach 2 cannot fit
    with pytest.raises(InputError, match="Approach 2.*found 1 usable of 1"):
        analyse(runs, None, FitSettings(bootstrap=50))
