from __future__ import annotations

import pytest

from lmforge.model.config import ModelConfig
from lmforge.scaling.counts import budget_flops, count_parameters, flops_per_token, shape_for_params, training_seconds


def test_parameter_kinds_add_up_to_the_models_count():
    for cfg in (ModelConfig.from_preset("tiny"), ModelConfig.from_preset("gpt2-124m")):
        p = count_parameters(cfg)
        assert p.total == cfg.num_params() == p.embedding + p.head + p.non_embedding
        assert p.head == (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
        assert p.active == p.total


def test_gpt2_small_has_its_known_non_embedding_count():
    # 12 layers x 12·768² (+ biases and norms) = 85M: Kaplan et al.'s N for GPT-2 small
    p = count_parameters(ModelConfig.from_preset("gpt2-124m"))
    assert p.non_embedding == pytest.approx(85.0e6, rel=0.01)


def test_flops_per_token_is_the_models_own_count_split_in_two():
    cfg = ModelConfig.from_preset("tiny")
    f = flops_per_token(cfg, 512)
    assert f.total == cfg.flops_per_token(512) == f.dense + f.attention
    assert f.attention == 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 512


def test_a_budget_is_peak_times_devices_times_time_times_mfu():
    c = budget_flops(989e12, 8, 24, 0.4)
    assert c == pytest.approx(989e12 * 8 * 86400 * 0.4)
    assert training_seconds(c, 989e12, 8, 0.4) == pytest.approx(86400)


@pytest.mark.parametrize("target", [2e7, 3e8, 7e9])
def test_the_shape_for_a_count_has_about_that_many_parameters(target):
    cfg = shape_for_params(target, ModelConfig.from_preset("tiny"))
    assert count_parameters(cfg).non_embedding == pytest.approx(target, rel=0.1)
    assert cfg.d_model % 64 == 0 and cfg.head_dim == 64


def test_shape_for_params_keeps_the_family_and_repeats_the_layer_pattern():
    template = ModelConfig.from_preset("tiny", sliding_window=64, n_layers=2,
                                       layer_types=["sliding_attention", "full_attention"])
    cfg = shape_for_params(5e7, template)
    assert type(cfg) is type(template) and cfg.family == template.family
    assert cfg.n_layers > 2 and cfg.layer_types == [("sliding_attention", "full_attention")[i % 2] for i in range(cfg.n_layers)]
