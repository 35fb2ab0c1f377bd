"""Preference losses: invariants, hand re-implementations from the papers, gradients and pooling."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from lmforge.model.reward import last_token_index
from lmforge.objectives.preference import (
    bradley_terry_loss,
    cpo_loss,
    dpo_loss,
    kto_loss,
    orpo_loss,
    sequence_logprobs,
    simpo_loss,
)

B = 7  # odd on purpose
LN2 = math.log(2)


def logps(seed: int, n: int = B, scale: float = 20.0) -> torch.Tensor:
    """Random negative summed log-probs in float64."""
    g = torch.Generator().manual_seed(seed)
    return -scale * torch.rand(n, generator=g, dtype=torch.float64) - 0.01


def four(seed: int = 0) -> tuple[torch.Tensor, ...]:
    return tuple(logps(seed + i) for i in range(4))


def log_sigmoid(z: float) -> float:
    """log(1 / (1 + e^-z)), written out per element."""
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


def per_elem(fn, *tensors: torch.Tensor) -> torch.Tensor:
    return torch.tensor([fn(*vals) for vals in zip(*(t.tolist() for t in tensors), strict=True)], dtype=torch.float64)


# --- DPO family -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss_type", "eps", "expected"),
    [
        ("sigmoid", 0.0, LN2),
        ("cdpo", 0.2, LN2),  # -(1-ε)log½ - ε log½ = ln 2
        ("robust", 0.2, LN2),  # (0.8 ln2 - 0.2 ln2) / 0.6 = ln 2
        ("hinge", 0.0, 1.0),
        ("ipo", 0.0, 1 / (4 * 0.1**2)),
    ],
)
def test_dpo_loss_at_policy_equal_reference(loss_type, eps, expected):
    pc, pr = logps(0), logps(1)
    losses, rc, rr = dpo_loss(pc, pr, pc.clone(), pr.clone(), beta=0.1, loss_type=loss_type, label_smoothing=eps)
    assert_close(losses, torch.full((B,), expected, dtype=torch.float64))
    assert_close(rc, torch.zeros(B, dtype=torch.float64))
    assert_close(rr, torch.zeros(B, dtype=torch.float64))


def test_dpo_gradient_is_nonzero_when_policy_equals_reference():
    pc, pr = logps(0).requires_grad_(), logps(1).requires_grad_()
    losses, _, _ = dpo_loss(pc, pr, pc.detach(), pr.detach())
    losses.sum().backward()
    assert_close(pc.grad, torch.full((B,), -0.05, dtype=torch.float64))  # -β σ(0)
    assert_close(pr.grad, torch.full((B,), 0.05, dtype=torch.float64))


def dpo_by_hand(pc, pr, rc, rr, beta, loss_type, eps):
    """Each DPO variant written straight from its paper's per-pair equation."""

    def one(pc, pr, rc, rr):
        d = (pc - rc) - (pr - rr)
        z = beta * d
        if loss_type == "sigmoid":  # Rafailov et al. 2023, eq. 7
            return -log_sigmoid(z)
        if loss_type == "cdpo":  # Mitchell 2023: BCE against label 1-ε
            return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)
        if loss_type == "robust":  # Chowdhury et al. 2024, eq. 5
            return (-(1 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1 - 2 * eps)
        if loss_type == "hinge":  # SLiC
            return max(0.0, 1 - z)
        if loss_type == "ipo":  # Azar et al. 2023, eq. 17
            return (d - 1 / (2 * beta)) ** 2
        raise AssertionError(loss_type)

    return per_elem(one, pc, pr, rc, rr)


@pytest.mark.parametrize(
    ("loss_type", "eps"), [("sigmoid", 0.0), ("cdpo", 0.1), ("robust", 0.1), ("hinge", 0.0), ("ipo", 0.0)]
)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_matches_paper_equation(loss_type, eps, beta):
    pc, pr, rc, rr = four(3)
    losses, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, rc, rr, beta, loss_type, eps)
    assert_close(losses, dpo_by_hand(pc, pr, rc, rr, beta, loss_type, eps))
    assert_close(chosen_rewards, beta * (pc - rc))
    assert_close(rejected_rewards, beta * (pr - rr))


@pytest.mark.parametrize("loss_type", ["cdpo", "robust"])
def test_dpo_smoothed_variants_with_zero_epsilon_equal_sigmoid(loss_type):
    args = four(11)
    assert_close(dpo_loss(*args, loss_type=loss_type, label_smoothing=0.0)[0], dpo_loss(*args)[0])


def test_ipo_on_length_averaged_logprobs_normalises_by_each_completion_length():
    pc, pr, rc, rr = four(5)
    n_c, n_r = torch.tensor([3.0] * B, dtype=torch.float64), torch.tensor([11.0] * B, dtype=torch.float64)
    losses, _, _ = dpo_loss(pc / n_c, pr / n_r, rc / n_c, rr / n_r, beta=0.1, loss_type="ipo")
    assert_close(losses, ((pc - rc) / n_c - (pr - rr) / n_r - 5.0) ** 2)


@pytest.mark.parametrize("loss_type", ["sigmoid", "cdpo", "robust", "hinge"])
def test_dpo_loss_decreases_as_preference_margin_grows(loss_type):
    ref = torch.zeros(5, dtype=torch.float64)
    margins = torch.tensor([-4.0, -1.0, 0.0, 1.0, 4.0], dtype=torch.float64)
    eps = 0.1 if loss_type in ("cdpo", "robust") else 0.0
    losses, _, _ = dpo_loss(margins, ref, ref, ref, beta=0.5, loss_type=loss_type, label_smoothing=eps)
    assert (losses[1:] <= losses[:-1]).all() and losses[-1] < losses[0]


def test_dpo_rewards_are_detached():
    pc, pr, rc, rr = (t.requires_grad_() for t in four(1))
    _, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, rc, rr)
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad


def test_dpo_rejects_meaningless_label_smoothing():
    with pytest.raises(ValueError, match="cdpo"):
        dpo_loss(*four(), loss_type="sigmoid", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        dpo_loss(*four(), loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="unknown"):
        dpo_loss(*four(), loss_type="exo")


# --- reference-free: SimPO, ORPO, CPO ---------------------------------------------------------


def test_simpo_matches_paper_equation():
    c, r = logps(20, scale=3.0), logps(21, scale=3.0)  # length-averaged log-probs
    beta, gamma = 2.5, 1.375
    losses, rc, rr = simpo_loss(c, r, beta=beta, gamma=gamma)
    # Meng et al. 2024, eq. 6: -log σ(β/|y_w| logπ(y_w) - β/|y_l| logπ(y_l) - γ)
    assert_close(losses, per_elem(lambda a, b: -log_sigmoid(beta * a - beta * b - gamma), c, r))
    assert_close(rc, beta * c)
    assert_close(rr, beta * r)


def test_simpo_gamma_is_trl_absolute_margin():
    c, r = logps(22, scale=3.0), logps(23, scale=3.0)
    beta, gamma = 2.0, 0.5
    # TRL CPOTrainer: logits = (c - r) - simpo_gamma / beta; loss = -logσ(β·logits)
    trl_style = -torch.nn.functional.logsigmoid(beta * ((c - r) - gamma / beta))
    assert_close(simpo_loss(c, r, beta=beta, gamma=gamma)[0], trl_style)


def test_simpo_loss_decreases_as_margin_grows():
    r = torch.full((5,), -1.0, dtype=torch.float64)
    c = torch.tensor([-3.0, -2.0, -1.0, -0.5, -0.1], dtype=torch.float64)
    losses = simpo_loss(c, r)[0]
    assert (losses[1:] < losses[:-1]).all()


def test_orpo_matches_paper_equation():
    c, r = logps(30, scale=3.0), logps(31, scale=3.0)
    nll = torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(32))
    beta = 0.1

    def one(lc, lr, n):  # Hong et al. 2024, eq. 6-7: odds = p / (1 - p), p = exp(avg log-prob)
        pc, pr = math.exp(lc), math.exp(lr)
        log_odds_ratio = math.log((pc / (1 - pc)) / (pr / (1 - pr)))
        return n - beta * log_sigmoid(log_odds_ratio)

    losses, rc, _ = orpo_loss(c, r, nll, beta=beta)
    assert_close(losses, per_elem(one, c, r, nll))
    assert_close(rc, beta * c)


def test_orpo_is_stable_and_differentiable_near_zero_and_very_negative_logprobs():
    c = torch.tensor([-1e-9, -1e-3, -0.5, -0.7, -5.0, -60.0, -300.0], dtype=torch.float64, requires_grad=True)
    r = torch.full((7,), -1.0, dtype=torch.float64)
    losses, _, _ = orpo_loss(c, r, torch.tensor(0.0, dtype=torch.float64))
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(c.grad).all()
    # log1mexp agrees with the naive formula where the latter is accurate
    mid = slice(1, 5)
    naive = (c - r) - (torch.log(1 - torch.exp(c)) - torch.log(1 - torch.exp(r)))
    assert_close(losses[mid], -0.1 * torch.nn.functional.logsigmoid(naive[mid]).detach())


def test_cpo_matches_paper_equation():
    c, r = logps(40), logps(41)
    nll = torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(42))
    beta, alpha = 0.1, 1.0
    # Xu et al. 2024, eq. 3 + 5: -log σ(β logπ(y_w) - β logπ(y_l)) + NLL(y_w)
    losses, rc, rr = cpo_loss(c, r, nll, beta=beta, alpha=alpha)
    assert_close(losses, per_elem(lambda a, b, n: -log_sigmoid(beta * a - beta * b) + alpha * n, c, r, nll))
    assert_close(rc, beta * c)
    assert_close(rr, beta * r)


def test_cpo_gradient_reaches_nll_and_both_logprobs():
    c, r = logps(43).requires_grad_(), logps(44).requires_grad_()
    nll = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    cpo_loss(c, r, nll, alpha=0.5)[0].sum().backward()
    assert_close(nll.grad, torch.tensor(0.5 * B, dtype=torch.float64))
    assert (c.grad < 0).all() and (r.grad > 0).all()


# --- KTO --------------------------------------------------------------------------------------


def test_kto_matches_paper_equation():
    pi, ref, pkl, rkl = four(50)
    pkl = rkl + 0.3 * torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(5))  # z0 > 0
    desirable = torch.tensor([True, False, True, True, False, False, True])
    beta, ld, lu = 0.1, 1.0, 1.33
    z0 = max(0.0, float((pkl - rkl).mean()))

    def one(p, q, d):  # Ethayarajh et al. 2024, eq. 8: λ_y - v(x, y) with v = λσ(±β(r - z0))
        r = p - q
        return ld * (1 - 1 / (1 + math.exp(-beta * (r - z0)))) if d else lu * (1 - 1 / (1 + math.exp(-beta * (z0 - r))))

    losses, rewards, kl = kto_loss(pi, ref, desirable, pkl, rkl, beta=beta, lambda_d=ld, lambda_u=lu)
    assert_close(losses, per_elem(one, pi, ref, desirable))
    assert_close(rewards, beta * (pi - ref))
    assert_close(kl, torch.tensor(z0, dtype=torch.float64))


def test_kto_takes_a_baseline_averaged_elsewhere_as_z0():
    """Under data parallelism the KTO objective passes the mean log-ratio of every rank's KL rows."""
    pi, ref, pkl, rkl = four(65)
    desirable = torch.tensor([True, False, True, True, False, False, True])
    expected = kto_loss(pi, ref, desirable, pkl, rkl)
    got = kto_loss(pi, ref, desirable, None, None, z0=(pkl - rkl).mean())
    for a, b in zip(got, expected):
        assert_close(a, b)
    assert kto_loss(pi, ref, desirable, None, None, z0=torch.tensor(-1.0))[2].item() == 0.0  # clamped too
    with pytest.raises(ValueError, match="either policy_kl and ref_kl, or the mean log-ratio z0"):
        kto_loss(pi, ref, desirable, pkl, rkl, z0=torch.tensor(0.5))


def test_kto_reference_point_is_clamped_at_zero():
    pi, ref, pkl, rkl = four(60)
    _, _, z0 = kto_loss(pi, ref, torch.ones(B, dtype=torch.bool), rkl - 1.0, rkl)
    assert z0.item() == 0.0


def test_kto_gives_half_lambda_when_reward_equals_reference_point():
    ref = logps(61)
    kl = torch.full((B,), 0.4, dtype=torch.float64)
    desirable = torch.tensor([True, False] * 3 + [True])
    losses, _, _ = kto_loss(
        ref + 0.4, ref, desirable, kl, torch.zeros(B, dtype=torch.float64), lambda_d=1.0, lambda_u=2.0
    )
    assert_close(losses, torch.where(desirable, 0.5, 1.0).double())


def test_kto_gradient_flows_through_rewards_but_not_the_reference_point():
    pi, ref, pkl, rkl = (t.requires_grad_() for t in four(70))
    desirable = torch.tensor([True, False, True, True, False, False, True])
    losses, rewards, z0 = kto_loss(pi, ref, desirable, pkl, rkl)
    assert not z0.requires_grad and not rewards.requires_grad
    losses.sum().backward()
    assert pkl.grad is None and rkl.grad is None
    assert (pi.grad[desirable] < 0).all() and (pi.grad[~desirable] > 0).all()


# --- reward model -----------------------------------------------------------------------------


def test_bradley_terry_matches_equation_with_margin_and_centering():
    g = torch.Generator().manual_seed(80)
    rc, rr = torch.randn(B, dtype=torch.float64, generator=g), torch.randn(B, dtype=torch.float64, generator=g)
    margin = torch.rand(B, dtype=torch.float64, generator=g)
    losses = bradley_terry_loss(rc, rr, margin=margin, center_coef=0.01)
    expected = per_elem(lambda a, b, m: -log_sigmoid(a - b - m) + 0.01 * (a + b) ** 2, rc, rr, margin)
    assert_close(losses, expected)
    assert_close(bradley_terry_loss(rc, rr), per_elem(lambda a, b: -log_sigmoid(a - b), rc, rr))


def test_bradley_terry_is_ln2_for_equal_rewards_and_decreases_with_the_gap():
    r = torch.zeros(3, dtype=torch.float64)
    assert_close(bradley_terry_loss(r, r), torch.full((3,), LN2, dtype=torch.float64))
    losses = bradley_terry_loss(torch.tensor([-1.0, 0.0, 2.0]), torch.zeros(3))
    assert (losses[1:] < losses[:-1]).all()


PAD = EOS = 0


def test_last_token_index_with_right_and_left_padding():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 4, 4, 0]
    ids = torch.tensor([[5, 6, 7, 9, 9], [5, 6, 7, 8, 4], [9, 9, 3, 4, 5]])
    assert last_token_index(ids, pad_id=9).tolist() == [2, 4, 4]


def test_last_token_index_with_pad_equal_to_eos_needs_the_attention_mask():
    # right-padded rows whose real text ends in EOS (== pad)
    ids = torch.tensor([[5, 6, EOS, PAD, PAD], [5, 6, 7, 8, EOS], [PAD, PAD, 5, 6, EOS]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [2, 4, 4]  # the EOS itself
    assert last_token_index(ids, pad_id=PAD).tolist() == [1, 3, 3]  # token before EOS, as transformers


def test_last_token_index_rejects_empty_rows():
    with pytest.raises(ValueError, match="no real token"):
        last_token_index(torch.tensor([[1, 1], [0, 0]]))


# --- sequence log-probs -----------------------------------------------------------------------


def naive_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[list[float], list[int]]:
    sums, counts = [], []
    for b in range(logits.shape[0]):
        total, n = 0.0, 0
        for t in range(1, logits.shape[1]):
            y = int(labels[b, t])
            if y == -100:
                continue
            row = logits[b, t - 1].tolist()
            lse = math.log(sum(math.exp(v) for v in row))
            total += row[y] - lse
            n += 1
        sums.append(total)
        counts.append(n)
    return sums, counts


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    B, T, V = 5, 9, 11
    logits = torch.randn(B, T, V, dtype=torch.float64, generator=g)
    ids = torch.randint(1, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # prompt
    labels[1, 6:] = -100  # right padding
    labels[2, :] = -100  # fully masked row
    labels[3, :2] = -100
    labels[3, 8] = EOS  # trained EOS that equals the pad id
    labels[4, 4:] = -100
    return logits, labels


def test_sequence_logprobs_match_naive_loop(batch):
    logits, labels = batch
    sums, counts = naive_logprobs(logits, labels)
    logps_sum, n = sequence_logprobs(logits, labels)
    assert_close(logps_sum, torch.tensor(sums, dtype=torch.float64))
    assert n.tolist() == counts
    avg, _ = sequence_logprobs(logits, labels, average=True)
    assert_close(avg, torch.tensor([s / max(c, 1) for s, c in zip(sums, counts, strict=True)], dtype=torch.float64))
    assert avg[2].item() == 0.0  # fully masked row gives 0, not NaN


def test_sequence_logprobs_are_invariant_to_right_padding(batch):
    logits, labels = batch
    g = torch.Generator().manual_seed(1)
    extra_logits = torch.randn(labels.shape[0], 4, logits.shape[-1], dtype=torch.float64, generator=g)
    padded_logits = torch.cat([logits, extra_logits], dim=1)
    padded_labels = torch.cat([labels, torch.full((labels.shape[0], 4), -100)], dim=1)
    for average in (False, True):
        assert_close(
            sequence_logprobs(padded_logits, padded_labels, average=average)[0],
            sequence_logprobs(logits, labels, average=average)[0],
        )


def test_sequence_logprobs_scores_half_precision_in_float32(batch):
    logits, labels = batch
    out, _ = sequence_logprobs(logits.bfloat16(), labels)
    assert out.dtype == torch.float32
    assert_close(out.double(), sequence_logprobs(logits.bfloat16().double(), labels)[0], rtol=1e-5, atol=1e-5)


def test_sequence_logprobs_gradient_only_reaches_scored_positions(batch):
    logits, labels = batch
    logits = logits.clone().requires_grad_()
    sequence_logprobs(logits, labels)[0].sum().backward()
    scored = torch.zeros(labels.shape, dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != -100
    assert (logits.grad[~scored] == 0).all()
    assert (logits.grad[scored].abs().sum(-1) > 0).all()
