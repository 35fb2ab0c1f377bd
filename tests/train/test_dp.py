"""DP-SGD's parts (lmforge.train.dp): per-example gradients against each example alone, the step
against the plain step, the accountant's ε against Opacus's RDP functions and a closed form, and
Poisson sampling."""

import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from lmforge.core.config import ConfigError
from lmforge.core.io import InputError
from lmforge.data.packing import IGNORE_INDEX
from lmforge.data.poisson import PoissonRowLoader
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.sft import SFTObjective
from lmforge.peft.lora import LoraConfig, apply_lora
from lmforge.train.dp import (
    DPConfig,
    DPStepRunner,
    PrivacyPlan,
    budget_steps,
    clip_factors,
    epsilon_spent,
    per_example_gradients,
)
from lmforge.train.step import StepRunner


def tiny_model(lora: bool) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                    max_seq_len=32)).double()
    if lora:
        apply_lora(model, LoraConfig(r=4, alpha=8))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: give A's gradient something to flow through
                torch.nn.init.normal_(p, std=0.1)
    return model


def rows(n: int, width: int = 12, prompt: list[int] | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """SFT rows: labels after each row's prompt (of ``prompt[i]`` tokens, else 3), right padding after 10."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, width), generator=g)
    labels = ids.clone()
    for i in range(n):
        labels[i, : (prompt[i] if prompt else 3)] = IGNORE_INDEX
        labels[i, 10:] = IGNORE_INDEX
        ids[i, 10:] = 0
    return {"input_ids": ids, "labels": labels}


def trained(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_per_example_gradients_equal_each_example_alone_in_fp64(lora):
    model, objective = tiny_model(lora), SFTObjective()
    batch = rows(4, prompt=[2, 3, 5, 7])  # unequal target counts: each example's mean over its own
    counts = torch.tensor([objective.num_targets({k: v[i:i + 1] for k, v in batch.items()}) for i in range(4)])
    grads, losses = per_example_gradients(model, objective, batch, trained(model), counts)
    for i in range(4):
        model.zero_grad()
        one = {k: v[i:i + 1] for k, v in batch.items()}
        out = objective(model, one)
        (out.loss_sum / out.n_targets).backward()
        # causal_lm_loss takes the log-softmax in float32 (as in training), so the losses agree to its rounding
        assert math.isclose(float(losses[i]), float(out.loss_sum.detach() / out.n_targets), rel_tol=1e-6)
        for name, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(grads[name][i], p.grad, rtol=0, atol=1e-8)


def test_clip_factors_bring_each_norm_to_at_most_c():
    grads = {"a": torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float64), "b": torch.zeros(2, 1, dtype=torch.float64)}
    factors, norms = clip_factors(grads, 1.0)
    torch.testing.assert_close(norms, torch.tensor([5.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(factors, torch.tensor([1 / (5 + 1e-6), 1.0], dtype=torch.float64))


def plan(noise: float, max_grad_norm: float, batch: int, n: int = 100, **dp) -> PrivacyPlan:
    return PrivacyPlan(DPConfig(noise_multiplier=noise, max_grad_norm=max_grad_norm, **dp), n, batch, max_steps=10)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_without_noise_or_clipping_the_dp_step_equals_the_plain_step(lora):
    """Every row has 7 targets, so the plain step's mean per target is the mean of the rows' means,
    which DP-SGD divides by the expected batch: here the batch drawn (fixed, 8 rows)."""
    batch, objective = rows(8), SFTObjective()
    updated = []
    for dp in (False, True):
        model = tiny_model(lora)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=0.5)
        runner = (DPStepRunner(model, objective, optimizer, "fp32", plan(0.0, 1e6, 8), chunk=3) if dp
                  else StepRunner(model, objective, optimizer, "fp32", grad_clip=0.0))
        result = runner.run_step([{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}])
        updated.append(([p.detach().clone() for p in params], float(result.loss), result.n_targets))
    (plain, plain_loss, plain_targets), (private, dp_loss, dp_targets) = updated
    assert plain_targets == dp_targets == 8 * 7 and math.isclose(plain_loss, dp_loss, rel_tol=1e-12)
    for a, b in zip(plain, private, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_dp_step_clips_each_example_and_adds_noise_of_std_sigma_c_over_the_batch():
    """With C tiny every example's clipped gradient has norm C, so their sum's norm is at most 8 C;
    the noise of σ C per coordinate over the expected batch B dominates: its norm² ≈ d σ² C² / B²."""
    batch, objective = rows(8), SFTObjective()
    model = tiny_model(False)
    d = sum(p.numel() for p in model.parameters())
    runner = DPStepRunner(model, objective, torch.optim.SGD(model.parameters(), lr=0.0), "fp32",
                          plan(2.0, 1e-3, 8), chunk=8)
    result = runner.run_step([batch])
    expected = math.sqrt(d) * 2.0 * 1e-3 / 8
    assert abs(float(result.grad_norm) - expected) < 8 * 1e-3 / 8 + 5 * 2.0 * 1e-3 / 8  # clipped sum + a few σ of the norm
    assert float(result.metrics["dp/clipped_fraction"]) == 1.0 and float(result.metrics["dp/batch_rows"]) == 8
    again = DPStepRunner(tiny_model(False), objective, torch.optim.SGD(model.parameters(), lr=0.0), "fp32",
                         plan(2.0, 1e-3, 8), chunk=3)
    assert math.isclose(float(again.run_step([batch]).grad_norm), float(result.grad_norm), rel_tol=1e-9)  # step 0's noise


def test_epsilon_equals_opacus_rdp_functions_called_directly():
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
    from opacus.accountants.rdp import RDPAccountant

    q, sigma, steps, delta = 0.01, 1.1, 1000, 1e-5
    orders = RDPAccountant.DEFAULT_ALPHAS
    reference, _ = get_privacy_spent(orders=orders, rdp=compute_rdp(q=q, noise_multiplier=sigma, steps=steps,
                                                                     orders=orders), delta=delta)
    assert abs(epsilon_spent("rdp", sigma, q, steps, delta) - reference) < 1e-6


def test_epsilon_of_the_full_batch_gaussian_mechanism_equals_its_closed_forms():
    """q = 1: T steps of the Gaussian mechanism are one of sensitivity √T. Its Rényi DP is
    α T / (2σ²) exactly (Mironov 2017, Prop. 7), converted to (ε, δ) as Opacus does (Balle et al.
    2020, Thm. 21): min over α of rdp − (log δ + log α)/(α − 1) + log((α − 1)/α). The exact ε of
    the Gaussian mechanism (Balle & Wang 2018, Thm. 8, μ = √T/σ: δ = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2))
    lies below both accountants': RDP's by its conversion's slack, PRV's within its ε error (0.01)."""
    from opacus.accountants.rdp import RDPAccountant

    sigma, steps, delta = 2.0, 16, 1e-5
    orders = np.array(RDPAccountant.DEFAULT_ALPHAS)
    rdp = orders * steps / (2 * sigma**2)
    by_hand = float(np.min(rdp - (np.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders)))
    assert abs(epsilon_spent("rdp", sigma, 1.0, steps, delta) - by_hand) < 1e-6
    mu = math.sqrt(steps) / sigma
    exact = brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0, 100)
    prv = epsilon_spent("prv", sigma, 1.0, steps, delta)
    assert exact <= prv <= exact + 0.02 and prv < by_hand


def test_the_noise_for_a_budget_spends_at_most_it_over_the_planned_steps():
    p = PrivacyPlan(DPConfig(epsilon=3.0, delta=1e-5), 10_000, 100, max_steps=500)
    spent = p.epsilon_after(500)
    assert 3.0 - 0.01 <= spent <= 3.0 and p.allowed_steps == 500
    assert epsilon_spent("rdp", p.noise_multiplier * 0.99, 0.01, 500, 1e-5) > 3.0 - 0.01  # σ is about the smallest
    steps = budget_steps("rdp", 0.8, 0.01, 1e-5, 3.0, 10_000)  # a given σ: the last step within the budget
    assert epsilon_spent("rdp", 0.8, 0.01, steps, 1e-5) <= 3.0 < epsilon_spent("rdp", 0.8, 0.01, steps + 1, 1e-5)


def test_the_plan_refuses_a_delta_of_one_over_n_or_more_and_an_empty_budget():
    with pytest.raises(InputError, match=r"dp.delta = 0.01 is not below 1/N = 0.01 for the N = 100 training examples"):
        PrivacyPlan(DPConfig(epsilon=1.0, delta=0.01), 100, 10, max_steps=10)
    with pytest.raises(ConfigError, match=r"dp: set dp.epsilon"):
        DPConfig(epsilon=None, noise_multiplier=None)


def test_poisson_sampling_takes_each_row_with_probability_q_and_ranks_split_the_one_batch():
    data = {"x": torch.arange(1000)}
    loader = PoissonRowLoader(data, 0.05, seed=3)
    sizes = [len(next(loader)["x"]) for _ in range(200)]
    assert abs(np.mean(sizes) - 50) < 4 * math.sqrt(1000 * 0.05 * 0.95 / 200) and np.std(sizes) > 3  # variable
    single = [next(PoissonRowLoader(data, 0.05, seed=3))["x"]]
    ranks = [next(PoissonRowLoader(data, 0.05, seed=3, rank=r, world_size=2))["x"] for r in range(2)]
    assert sorted(torch.cat(ranks).tolist()) == single[0].tolist()
    resumed = PoissonRowLoader(data, 0.05, seed=3)
    resumed.load_state_dict(loader.state_dict())
    assert torch.equal(next(resumed)["x"], next(loader)["x"])
