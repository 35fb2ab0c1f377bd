"""DoReMi's weight update and weights file (lmforge.data.doremi)."""

import json
import math

import pytest
import torch

from lmforge.core.io import InputError
from lmforge.data.doremi import (
    apply_domain_weights,
    domain_excess_losses,
    exponentiated_gradient_step,
    read_domain_weights,
)
from lmforge.data.loader import DatasetSource, LoaderConfig


def test_exponentiated_gradient_step_matches_a_hand_computed_case():
    # α = (0.5, 0.3, 0.2), λ = (0.2, 0, 1), η = 1, c = 0.1:
    # α·e^λ = (0.5·e^0.2, 0.3, 0.2·e) = (0.610701, 0.3, 0.543656), sum 1.454358
    # softmax = (0.419911, 0.206277, 0.373812); 0.9·softmax + 0.1/3 = (0.411254, 0.218982, 0.369764)
    weights = exponentiated_gradient_step(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64),
                                          torch.tensor([0.2, 0.0, 1.0], dtype=torch.float64), 1.0, 0.1)
    assert weights.tolist() == pytest.approx([0.411254, 0.218982, 0.369764], abs=1e-6)
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-15)


def test_step_size_scales_the_excess_and_smoothing_one_gives_uniform():
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)
    halved = exponentiated_gradient_step(w, torch.tensor([2.0, 0.0], dtype=torch.float64), 0.5, 0.0)
    # e^{0.5·2} = e: (0.25e, 0.75) / (0.25e + 0.75)
    assert float(halved[0]) == pytest.approx(0.25 * math.e / (0.25 * math.e + 0.75), abs=1e-15)
    uniform = exponentiated_gradient_step(w, torch.tensor([5.0, 0.0], dtype=torch.float64), 1.0, 1.0)
    assert uniform.tolist() == [0.5, 0.5]


def test_excess_loss_is_clipped_per_token_averaged_per_domain_and_kept_for_an_absent_domain():
    excess = torch.tensor([[0.5, -1.0], [2.0, 1.0], [-0.5, -0.5]])
    domains = torch.tensor([0, 1, 0])
    previous = torch.tensor([9.0, 9.0, 9.0], dtype=torch.float64)
    # domain 0: rows 0 and 2, clipped tokens 0.5, 0, 0, 0 over 4 tokens; domain 1: (2 + 1) / 2; domain 2: absent
    assert domain_excess_losses(excess, domains, 3, previous).tolist() == [0.125, 1.5, 9.0]


def _mixture(tmp_path, weights: dict | None = None, names=("prose", "code")) -> LoaderConfig:
    path = tmp_path / "domain_weights.json"
    if weights is not None:
        path.write_text(json.dumps({"weights": weights}))
    return LoaderConfig(datasets=[DatasetSource(path=str(tmp_path / n)) for n in names], weights_from=str(path))


def test_a_weights_file_sets_each_dataset_weight_by_name_normalised(tmp_path):
    data = apply_domain_weights(_mixture(tmp_path, {"code": 3.0, "prose": 1.0}))
    assert [(d.label, d.weight) for d in data.datasets] == [("prose", 0.25), ("code", 0.75)]
    assert read_domain_weights(data.weights_from) == {"code": 0.75, "prose": 0.25}


@pytest.mark.parametrize("weights, message", [
    ({"prose": 0.0, "code": 0.0}, "sum to 0.0, not a positive number"),
    ({"prose": -1.0, "code": 2.0}, "the weight of 'prose' is -1.0"),
    ({"prose": float("nan"), "code": 1.0}, "the weight of 'prose' is nan"),
    ({"prose": 1.0}, "['code'] missing"),
    ({"prose": 1.0, "code": 1.0, "web": 1.0}, "['web'] unknown"),
    ({"prose": 1.0, "code": 0.0}, "gives ['code'] weight 0"),
])
def test_bad_weights_files_are_refused_naming_the_file(tmp_path, weights, message):
    with pytest.raises(InputError, match="data.weights_from: .*domain_weights.json") as err:
        apply_domain_weights(_mixture(tmp_path, weights))
    assert message in str(err.value)


def test_a_missing_or_malformed_weights_file_is_refused(tmp_path):
    with pytest.raises(InputError, match="not found"):
        apply_domain_weights(_mixture(tmp_path))
    (tmp_path / "domain_weights.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="no 'weights' mapping"):
        apply_domain_weights(_mixture(tmp_path))
