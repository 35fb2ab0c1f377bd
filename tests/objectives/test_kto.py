"""KTO's weight-balance check against TRL's KTOTrainer recommendation (KTO paper, Eq. 8)."""

from __future__ import annotations

import re

import pytest

from lmforge.objectives.kto import weight_balance_warning


def trl_in_range(n_d: int, n_u: int, w_d: float, w_u: float) -> bool:
    """TRL's test (kto_trainer.py): either weight in its recommended range. TRL rounds the bounds and skips
    the test when n_d == n_u; we warn on balanced data too when the weights alone break the range."""
    des = n_u * w_u / n_d <= w_d <= n_u * w_u / n_d * 1.33
    und = n_d * w_d / n_u / 1.33 <= w_u <= n_d * w_d / n_u
    return des or und


@pytest.mark.parametrize(("n_d", "n_u", "w_d", "w_u"), [
    (100, 100, 1.0, 1.0), (100, 100, 1.2, 1.0), (100, 100, 2.0, 1.0), (100, 100, 1.0, 1.2),
    (10, 100, 1.0, 1.0), (10, 100, 11.0, 1.0), (100, 10, 1.0, 1.0), (100, 10, 1.0, 9.0), (30, 40, 1.5, 1.0),
])
def test_weight_balance_warns_outside_trls_recommended_range(n_d, n_u, w_d, w_u):
    warning = weight_balance_warning(n_d, n_u, w_d, w_u)
    assert (warning is None) == trl_in_range(n_d, n_u, w_d, w_u)
    if warning:
        assert f"{w_d * n_d / (w_u * n_u):.2f}" in warning and "desirable_weight in [" in warning
        lo, hi = map(float, re.search(r"desirable_weight in \[([\d.]+), ([\d.]+)\]", warning).groups())
        assert weight_balance_warning(n_d, n_u, (lo + hi) / 2, w_u) is None  # following the advice fixes it


@pytest.mark.parametrize(("n_d", "n_u", "kind"), [(12, 0, "desirable"), (0, 5, "undesirable")])
def test_data_of_one_kind_only_is_a_loud_warning(n_d, n_u, kind):
    warning = weight_balance_warning(n_d, n_u, 1.0, 1.0)
    assert warning and f"all {n_d + n_u} KTO training examples are {kind}" in warning
