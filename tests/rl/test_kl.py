"""KL estimators against exact KLs of small categoricals (Schulman's k1/k2/k3), the KL-shaped reward
against torchtune's ``get_rewards_ppo``, and the coefficient controller's closed form (Ziegler et al.)."""

import pytest
import torch

from lmforge.rl.kl import KLController, exact_kl, kl_estimate, kl_shaped_rewards, last_token_index
from tests.rl.references import load_torchtune_rlhf

TT, _ = load_torchtune_rlhf()


def categoricals(scale: float, seed: int = 0, V: int = 7):
    g = torch.Generator().manual_seed(seed)
    logq = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)  # the policy, sampled from
    logp = torch.log_softmax(logq + scale * torch.randn(V, generator=g, dtype=torch.float64), -1)  # the reference
    return logq, logp


@pytest.mark.parametrize("scale", [0.1, 1.0])
def test_k1_and_k3_are_unbiased_and_k3_is_nonnegative(scale):
    logq, logp = categoricals(scale)
    q = logq.exp()
    exact = (q * (logq - logp)).sum()  # KL(q || p)
    for est in ("k1", "k3"):
        torch.testing.assert_close((q * kl_estimate(logq, logp, est)).sum(), exact)
    assert (kl_estimate(logq, logp, "k3") >= 0).all()
    assert (kl_estimate(logq, logp, "k1") < 0).any()  # k1 goes negative at some tokens


def test_k2_is_close_for_small_kl_and_biased_for_large():
    for scale, close in ((0.05, True), (1.5, False)):
        logq, logp = categoricals(scale, seed=1)
        q = logq.exp()
        exact = (q * (logq - logp)).sum()
        k2 = (q * kl_estimate(logq, logp, "k2")).sum()
        assert bool(abs(k2 / exact - 1) < 0.05) is close


def test_k2_gradient_is_the_kl_gradient_and_k1s_expected_gradient_is_zero():
    logits = torch.randn(6, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(torch.randn(6, dtype=torch.float64), -1)

    def expected_grad(est):
        logq = torch.log_softmax(logits, -1)
        (grad,) = torch.autograd.grad((logq.exp().detach() * kl_estimate(logq, logp, est)).sum(), logits)
        return grad
    logq = torch.log_softmax(logits, -1)
    (true_grad,) = torch.autograd.grad((logq.exp() * (logq - logp)).sum(), logits)
    torch.testing.assert_close(expected_grad("k2"), true_grad)
    torch.testing.assert_close(expected_grad("k1"), torch.zeros(6, dtype=torch.float64))


def test_an_unknown_estimator_is_an_error():
    with pytest.raises(ValueError, match="k1', 'k2' or 'k3'"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")


@pytest.mark.parametrize("kl_coef", [0.0, 0.05, 0.3])
def test_kl_shaped_rewards_equal_torchtune_get_rewards_ppo(kl_coef):
    g = torch.Generator().manual_seed(2)
    B, T = 5, 8
    lengths = torch.tensor([8, 3, 5, 1, 7])
    mask = torch.arange(T)[None] < lengths[:, None]
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    # torchtune's recipe sets padded log-probs to 1.0 in both, so its KL there is 0
    tt_logp, tt_ref = logp.masked_fill(~mask, 1.0), ref.masked_fill(~mask, 1.0)
    their_total, their_kl, _ = TT.get_rewards_ppo(scores, tt_logp, tt_ref, kl_coef, valid_score_idxs=lengths - 1)
    rewards, kl = kl_shaped_rewards(scores, logp, ref, mask, kl_coef)
    torch.testing.assert_close(rewards, their_total)
    torch.testing.assert_close(kl, their_kl)
    assert (last_token_index(mask) == lengths - 1).all()


def test_the_score_goes_to_the_last_response_token_even_with_holes():
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    z = torch.zeros(2, 6)
    rewards, _ = kl_shaped_rewards(torch.tensor([2.0, -1.0]), z, z, mask, kl_coef=0.1)
    assert rewards.tolist() == [[0, 0, 0, 2.0, 0, 0], [0, 0, 0, 0, 0, -1.0]]


def test_a_completion_without_response_tokens_is_an_error():
    with pytest.raises(ValueError, match="completion 1 has no response token"):
        last_token_index(torch.tensor([[1, 0], [0, 0]]))


def test_fixed_controller_keeps_its_coefficient():
    ctl = KLController(coef=0.1)
    assert ctl.update(kl=50.0, n_steps=64) == 0.1


@pytest.mark.parametrize("kl,error", [(12.0, 0.2), (7.5, 0.25), (6.0, 0.0), (3.0, -0.5), (0.0, -1.0)])
def test_adaptive_controller_is_ziegler_proportional_control(kl, error):
    ctl = KLController(coef=0.2, target=6.0, horizon=10000)
    e = min(max(error, -0.2), 0.2)  # KL/target − 1, clipped to ±0.2
    assert ctl.update(kl, n_steps=256) == pytest.approx(0.2 * (1 + e * 256 / 10000))


def test_adaptive_controller_moves_the_kl_to_its_target():
    ctl = KLController(coef=2.0, target=2.0, horizon=100)  # starts at KL 0.5, a quarter of the target
    kls = []
    for _ in range(300):
        kls.append(1.0 / ctl.coef)  # a policy whose KL falls as β grows
        ctl.update(kl=kls[-1], n_steps=10)
    assert kls[0] == 0.5 and kls[-1] == pytest.approx(2.0, rel=0.05)
    assert all(a <= b for a, b in zip(kls, kls[1:]))  # β only ever falls while the KL is below its target


def test_controller_state_dict_resumes_the_adapted_coefficient():
    a = KLController(coef=0.1, target=1.0, horizon=50)
    for kl in (3.0, 2.0):
        a.update(kl, 10)
    b = KLController(coef=0.1, target=1.0, horizon=50)
    b.load_state_dict(a.state_dict())
    assert b.update(0.5, 10) == a.update(0.5, 10) and a.coef != 0.1


def test_exact_kl_is_the_sum_over_the_vocabulary_and_zero_against_itself():
    g = torch.Generator().manual_seed(0)
    logits, ref = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    p, q = torch.softmax(logits, -1), torch.softmax(ref, -1)
    torch.testing.assert_close(exact_kl(logits, ref), (p * (p / q).log()).sum(-1))
    torch.testing.assert_close(exact_kl(logits, ref),
                               torch.nn.functional.kl_div(q.log(), p, reduction="none").sum(-1))
    torch.testing.assert_close(exact_kl(logits, logits), torch.zeros(2, 3))
    assert (exact_kl(logits, ref) > 0).all()
