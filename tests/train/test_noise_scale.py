"""The gradient noise scale: the estimators on problems whose tr(Σ) and |G|² are known in closed
form, the step runner's small- and big-batch gradients, and the loop's wiring."""

import json

import pytest
import torch
from torch import nn

from lmforge.core.io import InputError
from lmforge.objectives.base import LossOutput, Objective
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.metrics import read_metrics
from lmforge.train.noise_scale import (
    NoiseSample,
    NoiseScale,
    gradient_sq_estimate,
    simple_noise_scale,
    trace_estimate,
)
from lmforge.train.step import StepRunner


def gaussian_sample(generator, mean, std, b_small, b_big) -> NoiseSample:
    """Per-example gradients g_i ~ N(mean, diag(std²)): the small batch is the first b_small of the big one."""
    g = mean + std * torch.randn(b_big, mean.numel(), generator=generator, dtype=torch.float64)
    small, big = g[:b_small].mean(0), g.mean(0)
    return NoiseSample(b_small, b_big, float(small @ small), float(big @ big))


def test_the_estimators_are_unbiased_for_gaussian_gradients():
    gen = torch.Generator().manual_seed(0)
    mean = torch.linspace(-1, 1, 16, dtype=torch.float64)
    std = torch.linspace(0.5, 3.0, 16, dtype=torch.float64)
    samples = [gaussian_sample(gen, mean, std, 8, 32) for _ in range(4000)]
    grad_sq = sum(gradient_sq_estimate(s) for s in samples) / len(samples)
    trace = sum(trace_estimate(s) for s in samples) / len(samples)
    assert grad_sq == pytest.approx(float(mean @ mean), rel=0.05)
    assert trace == pytest.approx(float(std @ std), rel=0.03)


def test_the_moving_averages_give_the_known_noise_scale():
    gen = torch.Generator().manual_seed(1)
    mean = torch.full((10,), 0.5, dtype=torch.float64)  # |G|² = 2.5
    std = torch.full((10,), 2.0, dtype=torch.float64)  # tr(Σ) = 40: B_simple = 16
    tracker = NoiseScale(decay=0.998)  # about 500 samples averaged
    for _ in range(3000):
        fields = tracker.observe(gaussian_sample(gen, mean, std, 8, 64))
    assert fields["noise_scale"] == pytest.approx(16.0, rel=0.1)
    assert fields["noise_grad_sq"] == pytest.approx(2.5, rel=0.1)
    assert fields["noise_trace"] == pytest.approx(40.0, rel=0.05)


def test_one_exact_sample_recovers_both_parts():
    # E|G_B|² = |G|² + tr(Σ)/B holding exactly at two batch sizes gives back |G|² and tr(Σ)
    g_sq, trace = 3.0, 120.0
    s = NoiseSample(10, 40, g_sq + trace / 10, g_sq + trace / 40)
    assert gradient_sq_estimate(s) == pytest.approx(g_sq)
    assert trace_estimate(s) == pytest.approx(trace)
    assert simple_noise_scale(trace, g_sq) == pytest.approx(40.0)
    assert simple_noise_scale(trace, -1.0) is None


def test_bias_correction_makes_the_first_average_the_first_estimate_and_non_finite_samples_are_left_out():
    tracker = NoiseScale(decay=0.9)
    s = NoiseSample(10, 40, 3.0 + 12.0, 3.0 + 3.0)
    assert tracker.observe(s) == pytest.approx({"noise_grad_sq": 3.0, "noise_trace": 120.0, "noise_scale": 40.0})
    assert tracker.observe(NoiseSample(10, 40, float("inf"), 1.0)) == {}
    assert tracker.count == 1
    restored = NoiseScale(decay=0.9)
    restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    assert restored.fields() == tracker.fields()


class LinearRegression(Objective):
    """Squared error ½(w·x − y)² summed over a batch's rows: each row is one target."""

    def num_targets(self, batch) -> int:
        return batch[0].shape[0]

    def __call__(self, model, batch) -> LossOutput:
        x, y = batch
        residual = model(x).squeeze(-1) - y
        return LossOutput(0.5 * (residual ** 2).sum(), x.shape[0])


def regression_runner(w: torch.Tensor, lr: float = 0.0) -> tuple[nn.Module, StepRunner]:
    model = nn.Linear(w.numel(), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return model, StepRunner(model, LinearRegression(), optimizer, "fp32", grad_clip=0.0)


def test_the_runner_measures_the_first_micro_batch_and_the_whole_step():
    torch.manual_seed(0)
    w = torch.randn(1, 6)
    model, runner = regression_runner(w)
    batches = [(torch.randn(5, 6), torch.randn(5)), (torch.randn(11, 6), torch.randn(11))]

    def mean_grad(rows):
        x, y = rows
        return ((x @ w.T).squeeze(-1) - y) @ x / x.shape[0]  # the mean gradient per row of ½(w·x − y)²

    result = runner.run_step(batches, measure_noise=True)
    everything = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    assert result.noise.b_small == 5 and result.noise.b_big == 16
    assert result.noise.grad_sq_small == pytest.approx(float(mean_grad(batches[0]).square().sum()), rel=1e-5)
    assert result.noise.grad_sq_big == pytest.approx(float(mean_grad(everything).square().sum()), rel=1e-5)
    assert runner.run_step(batches).noise is None


def test_the_runner_finds_the_closed_form_noise_scale_of_linear_regression():
    # x ~ N(0, I_d), y = w*·x + ε, ε ~ N(0, σ²); at w with δ = w − w*, the per-row gradient
    # g = (δ·x − ε) x has mean δ and tr(Σ) = (d + 1)|δ|² + dσ² (Gaussian fourth moments)
    d, sigma = 8, 1.5
    gen = torch.Generator().manual_seed(2)
    w_star = torch.randn(1, d, generator=gen)
    delta = torch.full((1, d), 0.25)
    _, runner = regression_runner(w_star + delta)  # lr 0: every step measures at the same w
    tracker = NoiseScale(decay=0.999)
    for _ in range(3000):
        x = torch.randn(64, d, generator=gen)
        y = (x @ w_star.T).squeeze(-1) + sigma * torch.randn(64, generator=gen)
        tracker.observe(runner.run_step([(x[:16], y[:16]), (x[16:], y[16:])], measure_noise=True).noise)
    g_sq = float(delta.square().sum())
    expected = ((d + 1) * g_sq + d * sigma ** 2) / g_sq  # 45
    assert tracker.fields()["noise_scale"] == pytest.approx(expected, rel=0.1)


def test_the_loop_logs_the_noise_scale_and_reports_it_in_the_summary(make_recipe, tmp_path):
    summary = run_pretrain(make_recipe(**{"train.noise_scale_every": 2, "train.max_steps": 6}))
    records = read_metrics(tmp_path / "run")
    measured = [r["step"] for r in records if "noise_trace" in r]
    assert measured == [2, 4, 6]
    assert all(r["noise_trace"] > 0 for r in records if "noise_trace" in r)  # tokens disagree: a positive trace
    last = records[-1]
    assert summary["noise_scale_measurements"] == 3 and summary["noise_scale_unit"] == "tokens"
    assert summary["noise_trace"] == last["noise_trace"] and summary.get("noise_scale") == last.get("noise_scale")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["noise_trace"] == last["noise_trace"]


def test_measuring_the_noise_scale_leaves_training_bit_identical(make_recipe, tmp_path):
    run_pretrain(make_recipe(tmp_path / "off"))
    run_pretrain(make_recipe(tmp_path / "on", **{"train.noise_scale_every": 1}))
    off, on = read_metrics(tmp_path / "off"), read_metrics(tmp_path / "on")
    for a, b in zip(off, on, strict=True):
        assert (a["loss"], a["grad_norm"], a.get("val_loss")) == (b["loss"], b["grad_norm"], b.get("val_loss"))
    assert not any(k.startswith("noise") for r in off for k in r)
    state = json.loads((tmp_path / "off" / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    assert "noise_scale" not in state  # off, the checkpoint holds what it held before


def test_a_resumed_run_reports_the_noise_scale_of_an_uninterrupted_one(make_recipe, tmp_path):
    on = {"train.noise_scale_every": 1}
    run_pretrain(make_recipe(tmp_path / "full", **on))
    run_pretrain(make_recipe(tmp_path / "half", **on, **{"train.stop_at_step": 4}))
    run_pretrain(make_recipe(tmp_path / "half", **on))
    full, half = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "half")
    assert [r["noise_trace"] for r in half] == [r["noise_trace"] for r in full]


def test_the_noise_scale_needs_two_micro_batches_per_step(make_recipe):
    with pytest.raises(InputError, match="noise_scale_every.*at least 2 micro-batches"):
        run_pretrain(make_recipe(**{"train.noise_scale_every": 1, "train.batch_tokens": 128}))


def test_the_console_line_shows_the_noise_scale():
    from lmforge.train.step_log import format_step

    line = format_step({"step": 3, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0,
                        "noise_scale": 1234.5}, 10)
    assert "noise scale 1.23e+03 tok" in line
