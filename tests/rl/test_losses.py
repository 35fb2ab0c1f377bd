"""Policy and value losses against torchtune's PPOLoss and TRL's GRPOTrainer loss (its own
``_compute_loss``, run on a stub: ``tests/rl/references.py``), plus closed forms where no
reference exists: the loss at θ = θ_old, its gradient (the policy gradient), GSPO's averaged
log-ratio, the dual clip, and exactness under micro-batching."""

import pytest
import torch

from lmforge.rl.losses import (
    PolicyLossConfig,
    aggregate,
    entropy_from_logits,
    importance_log_ratio,
    policy_loss,
    value_loss,
)
from tests.rl.references import load_torchtune_rlhf, trl_grpo_loss

_, TorchtunePPOLoss = load_torchtune_rlhf()


def rollout(seed: int, B: int = 6, T: int = 10, spread: float = 0.3, per_token_adv: bool = True):
    """Log-probs with ratios spread across the clip range, right-padded masks of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return logp, old, adv, mask, ref


def grad(loss, x):
    (g,) = torch.autograd.grad(loss, x, retain_graph=True)
    return g


# ----------------------------------------------------------------------------- torchtune PPOLoss

@pytest.mark.parametrize("epsilon,value_clip", [(0.1, 0.2), (0.2, 0.5)])
def test_ppo_clipped_and_value_clipped_losses_equal_torchtune_ppoloss(epsilon, value_clip):
    logp, old, adv, mask, _ = rollout(0)
    g = torch.Generator().manual_seed(1)
    old_values = torch.randn(logp.shape, generator=g, dtype=torch.float64)
    values = (old_values + 0.4 * torch.randn(logp.shape, generator=g, dtype=torch.float64)).requires_grad_()
    returns = torch.randn(logp.shape, generator=g, dtype=torch.float64)
    tt = TorchtunePPOLoss(epsilon=epsilon, value_clip_range=value_clip, value_coeff=0.1)
    their_loss, their_pol, their_val, _, their_clipfrac = tt(old, logp, adv, old_values, values, returns,
                                                            padding_masks=mask, value_padding_masks=mask)
    pol, metrics = policy_loss(logp, old, adv, mask, PolicyLossConfig(clip_low=epsilon))
    val, _ = value_loss(values, old_values, returns, mask, clip=value_clip)
    ours = pol + 0.1 * val
    torch.testing.assert_close(pol, their_pol)
    torch.testing.assert_close(val, their_val)
    torch.testing.assert_close(metrics["clip_frac"], their_clipfrac)
    assert 0 < metrics["clip_frac"] < 1
    for x in (logp, values):
        torch.testing.assert_close(grad(ours, x), grad(their_loss, x))


def test_value_loss_closed_forms():
    values = torch.tensor([[1.0, 2.0, 0.0]])
    old = torch.tensor([[0.0, 2.5, 0.0]])
    returns = torch.tensor([[3.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    plain, _ = value_loss(values, old, returns, mask, clip=None)
    assert plain.item() == pytest.approx(0.5 * (4 + 4) / 2)
    clipped, m = value_loss(values, old, returns, mask, clip=0.2)
    # token 0: clip(1, -0.2, 0.2) = 0.2 -> (0.2-3)^2 = 7.84 > 4; token 1: clip(2, 2.3, 2.7) = 2.3 -> 5.29 > 4
    assert clipped.item() == pytest.approx(0.5 * (7.84 + 5.29) / 2)
    assert m["value_clip_frac"].item() == 1.0


# ----------------------------------------------------------------------------- TRL GRPOTrainer

TRL_AGGREGATION = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
                   "dapo": "token-mean"}


@pytest.mark.parametrize("loss_type", list(TRL_AGGREGATION))
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_grpo_family_losses_equal_trl_grpotrainer(loss_type, beta, epsilon_high):
    logp, old, adv, mask, ref = rollout(2, per_token_adv=False)
    T = logp.shape[1]
    global_tokens = int(mask.sum()) * 3 if loss_type == "dapo" else None  # DAPO: the whole step's tokens
    theirs, their_metrics = trl_grpo_loss(logp, old, adv, mask, loss_type=loss_type, beta=beta, ref_logp=ref,
                                          epsilon_high=epsilon_high, max_completion_length=T + 2,
                                          num_items_in_batch=global_tokens)
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=epsilon_high, aggregation=TRL_AGGREGATION[loss_type],
                           max_length=T + 2, kl_coef=beta)
    ours, metrics = policy_loss(logp, old, adv, mask, cfg, ref_logp=ref, n_tokens=global_tokens)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad(ours, logp), grad(theirs, logp))
    assert metrics["clip_frac_low"].item() == pytest.approx(their_metrics["clip_ratio/low_mean"])
    assert metrics["clip_frac_high"].item() == pytest.approx(their_metrics["clip_ratio/high_mean"])
    if beta:
        assert metrics["kl_ref"].item() == pytest.approx(their_metrics["kl"])


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_sequence_ratio_equals_trl_importance_sampling_level_sequence(beta):
    logp, old, adv, mask, ref = rollout(3, spread=0.4, per_token_adv=False)
    theirs, their_metrics = trl_grpo_loss(logp, old, adv, mask, loss_type="grpo", beta=beta, ref_logp=ref,
                                          epsilon=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence")
    cfg = PolicyLossConfig(clip_low=3e-4, clip_high=4e-4, ratio_level="sequence", aggregation="seq-mean-token-mean",
                           kl_coef=beta)
    ours, metrics = policy_loss(logp, old, adv, mask, cfg, ref_logp=ref)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad(ours, logp), grad(theirs, logp))
    assert 0 < their_metrics["clip_ratio/region_mean"] < 1  # GSPO's tiny ε (paper: 3e-4/4e-4) clips some sequences


def test_dual_clip_equals_trl_delta():
    logp, old, adv, mask, _ = rollout(4, spread=1.5)  # ratios well above 3 at some tokens
    adv = adv.mean(-1)
    theirs, _ = trl_grpo_loss(logp, old, adv, mask, loss_type="bnpo", delta=3.0)
    ours, metrics = policy_loss(logp, old, adv, mask, PolicyLossConfig(dual_clip=3.0))
    assert metrics["dual_clip_frac"] > 0
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad(ours, logp), grad(theirs, logp))


def test_entropy_from_logits_equals_trl():
    from trl.trainer.utils import entropy_from_logits as trl_entropy
    logits = torch.randn(3, 5, 11) * 3
    torch.testing.assert_close(entropy_from_logits(logits), trl_entropy(logits))
    assert entropy_from_logits(torch.zeros(2, 8)).allclose(torch.log(torch.tensor(8.0)))


# ----------------------------------------------------------------------------- closed forms

def test_on_policy_the_ratio_is_one_and_the_loss_is_minus_the_mean_advantage():
    _, old, adv, mask, _ = rollout(5)
    logp = old.clone().requires_grad_()
    loss, metrics = policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / mask.sum().item())
    assert metrics["ratio_mean"] == 1 and metrics["ratio_max"] == 1 and metrics["clip_frac"] == 0
    assert metrics["approx_kl"] == 0


def test_on_policy_gradient_is_the_policy_gradient():
    g = torch.Generator().manual_seed(6)
    B, T, V = 4, 5, 7
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask)
    (ours,) = torch.autograd.grad(loss, logits)
    # -(1/N) Σ_t A_t ∇ log π(y_t), with ∇_z log softmax(z)_y = onehot(y) − softmax(z)
    score = torch.nn.functional.one_hot(tokens, V) - torch.softmax(logits.detach(), -1)
    expected = -(adv * mask)[..., None] * score / mask.sum()
    torch.testing.assert_close(ours, expected)


def test_gspo_averages_the_log_ratios_over_tokens_instead_of_summing_them():
    old = torch.zeros(2, 8, dtype=torch.float64)
    logp = old + 0.1  # every token's ratio is e^0.1
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :2] = mask[1, :] = True  # lengths 2 and 8
    log_s = importance_log_ratio(logp, old, mask, "sequence")
    torch.testing.assert_close(log_s[mask], torch.full((10,), 0.1, dtype=torch.float64))  # not 0.2 and 0.8
    _, metrics = policy_loss(logp, old, torch.ones(2, dtype=torch.float64), mask, PolicyLossConfig(ratio_level="sequence"))
    assert metrics["clip_frac"] == 0  # e^0.1 < 1.2; a summed log-ratio (e^0.8) would be clipped


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_token_score():
    logp, old, adv, mask, _ = rollout(7, spread=0.05, per_token_adv=False)
    cfg = PolicyLossConfig(clip_low=0.5, ratio_level="sequence", aggregation="seq-mean-token-mean")
    loss, _ = policy_loss(logp, old, adv, mask, cfg)
    n = mask.sum(-1, keepdim=True)
    s = torch.exp(((logp.detach() - old) * mask).sum(-1, keepdim=True) / n)
    expected = -adv[:, None] * s / n * mask / mask.shape[0]
    torch.testing.assert_close(grad(loss, logp), expected)


def test_dual_clip_bounds_the_loss_of_negative_advantages_with_large_ratios():
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(dual_clip=3.0))
    # token 0: min(max(5, 0.8·... ) -> 5, 3) = 3 (no gradient); token 1: 2 (unclipped); token 2: −clip(5) = −1.2
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    torch.testing.assert_close(grad(loss, logp), torch.tensor([[0.0, 2.0 / 3, 0.0]], dtype=torch.float64))


def test_clip_higher_lets_positive_advantages_raise_a_ratio_further():
    old = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.25]], dtype=torch.float64)).requires_grad_()
    adv, mask = torch.ones(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool)
    symmetric, m_sym = policy_loss(logp, old, adv, mask, PolicyLossConfig(clip_low=0.2))
    higher, m_high = policy_loss(logp, old, adv, mask, PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    assert grad(symmetric, logp).item() == 0 and m_sym["clip_frac_high"] == 1
    assert grad(higher, logp).item() == pytest.approx(-1.25) and m_high["clip_frac_high"] == 0


def test_kl_in_the_loss_adds_beta_k3_per_token():
    logp, old, adv, mask, ref = rollout(8)
    base, _ = policy_loss(logp, old, adv, mask)
    with_kl, m = policy_loss(logp, old, adv, mask, PolicyLossConfig(kl_coef=0.1), ref_logp=ref)
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    torch.testing.assert_close(with_kl - base, 0.1 * (k3 * mask).sum() / mask.sum())
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss(logp, old, adv, mask, PolicyLossConfig(kl_coef=0.1))


def test_entropy_bonus_subtracts_the_masked_mean_entropy():
    logp, old, adv, mask, _ = rollout(9)
    logits = torch.randn(*logp.shape, 5, dtype=torch.float64)
    entropy = entropy_from_logits(logits)
    base, _ = policy_loss(logp, old, adv, mask, entropy=entropy)
    bonus, m = policy_loss(logp, old, adv, mask, PolicyLossConfig(entropy_coef=0.01), entropy=entropy)
    mean_h = (entropy * mask).sum() / mask.sum()
    torch.testing.assert_close(base - bonus, 0.01 * mean_h.double())  # entropy is float32
    torch.testing.assert_close(m["entropy"], mean_h)


def test_metrics_approx_kl_and_ratio_statistics():
    logp, old, adv, mask, _ = rollout(10)
    _, m = policy_loss(logp, old, adv, mask)
    lr = (logp - old).detach()
    r = lr.exp()
    torch.testing.assert_close(m["approx_kl"], ((r - 1 - lr) * mask).sum() / mask.sum())
    torch.testing.assert_close(m["ratio_mean"], (r * mask).sum() / mask.sum())
    torch.testing.assert_close(m["ratio_max"], r[mask].max())
    assert m["clip_frac"] == pytest.approx((m["clip_frac_low"] + m["clip_frac_high"]).item())


def test_aggregation_modes_closed_forms():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(x, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(x, mask, "seq-mean-token-sum-norm", max_length=5).item() == pytest.approx(10 / (2 * 5))
    assert aggregate(x, mask, "token-mean", n_tokens=20).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="needs max_length"):
        aggregate(x, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate(x, mask, "sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batched_losses_with_global_counts_have_the_full_batch_gradient(mode):
    logp, old, adv, mask, ref = rollout(11, B=8)
    cfg = PolicyLossConfig(aggregation=mode, max_length=logp.shape[1], kl_coef=0.05, dual_clip=3.0)
    full, _ = policy_loss(logp, old, adv, mask, cfg, ref_logp=ref)
    n_tokens, n_seq = int(mask.sum()), mask.shape[0]
    micro = [slice(0, 3), slice(3, 5), slice(5, 8)]  # uneven sizes and token counts
    summed = sum(policy_loss(logp[s], old[s], adv[s], mask[s], cfg, ref_logp=ref[s], n_tokens=n_tokens,
                             n_sequences=n_seq)[0] for s in micro)
    torch.testing.assert_close(summed, full)
    torch.testing.assert_close(grad(summed, logp), grad(full, logp))
    # the per-micro-batch mean (each call normalising by its own count) is not the full batch's loss
    local = sum(policy_loss(logp[s], old[s], adv[s], mask[s], cfg, ref_logp=ref[s])[0] for s in micro) / len(micro)
    if mode != "seq-mean-token-sum-norm":
        assert not torch.allclose(local, full)


def test_value_loss_is_exact_under_micro_batching_too():
    _, _, _, mask, _ = rollout(12, B=8)
    g = torch.Generator().manual_seed(12)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64, requires_grad=True)
    old, returns = torch.randn(mask.shape, generator=g, dtype=torch.float64), torch.randn(mask.shape, generator=g)
    full, _ = value_loss(values, old, returns, mask)
    n = int(mask.sum())
    summed = sum(value_loss(values[s], old[s], returns[s], mask[s], n_tokens=n)[0] for s in (slice(0, 5), slice(5, 8)))
    torch.testing.assert_close(grad(summed, values), grad(full, values))


def test_config_errors_name_the_missing_or_bad_setting():
    with pytest.raises(ValueError, match="needs max_length"):
        PolicyLossConfig(aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="ratio level"):
        importance_log_ratio(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "tokens")
