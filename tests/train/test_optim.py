import math

import pytest

from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.train.loop import TrainConfig
from lmforge.train.optim import build_adamw, lr_at, param_groups


def test_weight_decay_applies_to_matrices_only():
    model = Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2, ffn_hidden=32,
                                    qkv_bias=True, tie_embeddings=True, max_seq_len=16))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "layers.0.attn.wq.weight" in decayed and "layers.1.mlp.w2.weight" in decayed
    assert not any(n.endswith("bias") or "norm" in n or n == "embed.weight" for n in decayed)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_adamw_of_the_default_config_decays_exactly_the_weight_matrices_of_a_transformer(tie_embeddings):
    cfg = TrainConfig()
    model = Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2, ffn_hidden=32, norm="layernorm",
                                    qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=tie_embeddings,
                                    max_seq_len=16))
    opt = build_adamw(model, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay)
    names = {id(p): n for n, p in model.named_parameters()}
    decay_of = {names[id(p)]: group["weight_decay"] for group in opt.param_groups for p in group["params"]}
    assert sorted(decay_of) == sorted(names.values())  # every parameter once
    matrices = {n for n, p in model.named_parameters() if p.ndim == 2 and n != "embed.weight"}
    assert {n for n, wd in decay_of.items() if wd == 0.1} == matrices
    assert {n for n, wd in decay_of.items() if wd != 0.1} == set(names.values()) - matrices
    assert set(decay_of.values()) == {0.1, 0.0}
    assert {"embed.weight", "norm.weight", "norm.bias", "layers.0.attn_norm.bias", "layers.1.mlp.w2.bias"} <= (
        set(names.values()) - matrices)
    assert ("lm_head.weight" in matrices) == (not tie_embeddings)  # an untied head is a linear layer's matrix
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8


def lrs_of_a_run(**kw) -> list[float]:
    """The rate of each step a run of ``max_steps`` takes: the loop calls lr_at(0) .. lr_at(max_steps - 1)."""
    return [lr_at(step, **kw) for step in range(kw["max_steps"])]


def test_cosine_warms_up_to_peak_at_the_warmup_step_and_ends_at_ten_percent_on_the_last_step():
    lrs = lrs_of_a_run(peak=1.0, max_steps=100, warmup_steps=10, schedule="cosine")
    assert lrs[0] == pytest.approx(0.1)  # step 1 of 10 of the warm-up
    assert lrs[9] == 1.0 and lrs[10] < 1.0  # step 10 ends the warm-up at peak; decay begins on step 11
    assert lrs[54] == pytest.approx(0.55)  # step 55: halfway through the 90 decay steps
    assert lrs[-1] == 1.0 * 0.1  # step 100, the last that runs, is exactly at the minimum
    assert min(lrs[10:-1]) > 0.1
    assert all(a > b for a, b in zip(lrs[9:], lrs[10:]))


def test_wsd_decays_below_peak_on_exactly_the_last_fraction_of_the_steps():
    lrs = lrs_of_a_run(peak=1.0, max_steps=100, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0
    assert lrs[10:80] == [1.0] * 70  # steps 11..80 are stable
    assert all(lr < 1.0 for lr in lrs[80:]) and len(lrs[80:]) == 20  # steps 81..100 decay
    assert lrs[80] == pytest.approx(0.1 + 0.9 * 19 / 20) and lrs[89] == pytest.approx(0.55)
    assert lrs[-1] == 1.0 * 0.1


def test_wsd_of_ten_steps_decays_over_the_last_two_to_the_minimum():
    lrs = lrs_of_a_run(peak=3e-4, max_steps=10, warmup_steps=0, schedule="wsd", decay_fraction=0.2)
    assert lrs[:8] == [3e-4] * 8
    assert lrs[8] == pytest.approx(3e-4 * 0.55) and lrs[9] == 3e-4 * 0.1


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_the_last_step_runs_at_min_lr_ratio_times_peak(schedule):
    kw = dict(peak=2e-3, max_steps=37, warmup_steps=5, schedule=schedule, min_lr_ratio=0.05, decay_fraction=0.3)
    lrs = lrs_of_a_run(**kw)
    assert lrs[4] == 2e-3 and lrs[-1] == 2e-3 * 0.05 and min(lrs[5:-1]) > 2e-3 * 0.05


def test_wsd_decay_overlapping_the_warmup_starts_after_it():
    lrs = lrs_of_a_run(peak=1.0, max_steps=10, warmup_steps=8, schedule="wsd", decay_fraction=0.5)
    assert lrs[7] == 1.0 and lrs[8] == pytest.approx(0.55) and lrs[9] == 1.0 * 0.1


def test_constant_holds_peak_after_warmup():
    lrs = lrs_of_a_run(peak=1.0, max_steps=6, warmup_steps=2, schedule="constant")
    assert lrs == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_at(50, peak=1.0, max_steps=100, warmup_steps=0, schedule="linear")


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_rewarming_starts_at_warmup_start_and_then_follows_the_schedule_from_zero(schedule):
    # Ibrahim et al. 2024's re-warm / re-decay: s + (peak - s) n / W for n = step + 1 <= W, then the
    # decay of a run warmed from 0 (which depends on the step only, not on where the warm-up began)
    peak, start, W, T = 3e-4, 3e-5, 10, 100
    kw = {"peak": peak, "max_steps": T, "warmup_steps": W, "schedule": schedule}
    for step in (0, 1, 4, 8, 9):
        assert lr_at(step, **kw, warmup_start=start) == pytest.approx(start + (peak - start) * (step + 1) / W, rel=1e-12)
    assert lr_at(0, **kw, warmup_start=start) > lr_at(0, **kw)  # not from 0
    for step in (10, 11, 50, 98, 99):
        assert lr_at(step, **kw, warmup_start=start) == lr_at(step, **kw)
    if schedule == "cosine":  # the closed form at a few steps after the re-warm
        for step in (10, 50, 99):
            n = step + 1
            expected = 0.1 * peak + 0.5 * 0.9 * peak * (1 + math.cos(math.pi * (n - W) / (T - W)))
            assert lr_at(step, **kw, warmup_start=start) == pytest.approx(expected, rel=1e-12)


def test_rewarming_from_zero_is_todays_warmup_bit_for_bit():
    for step in range(12):
        assert lr_at(step, peak=1e-3, max_steps=40, warmup_steps=12, schedule="cosine", warmup_start=0.0) == \
            lr_at(step, peak=1e-3, max_steps=40, warmup_steps=12, schedule="cosine")


def test_each_parameter_group_rewarms_from_the_same_fraction_of_its_peak():
    import torch

    from lmforge.train.loop import scheduled_lr

    cfg = TrainConfig(lr=1e-3, warmup_start=1e-4, warmup_steps=4, max_steps=10)
    opt = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "peak_lr": 2e-2},
                           {"params": [torch.zeros(1, requires_grad=True)]}], lr=1e-3)
    assert scheduled_lr(opt, 0, cfg) == pytest.approx(1e-4 + (1e-3 - 1e-4) / 4)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 + (2e-2 - 2e-3) / 4)
