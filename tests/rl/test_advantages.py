"""Advantage estimators against torchtune.rlhf (GAE, returns, whitening) and against closed forms
written independently here (group-relative estimators: no installed reference exposes them as a
function; TRL computes GRPO's inside ``_generate_and_score_completions``)."""

import pytest
import torch

from lmforge.rl.advantages import (
    discounted_returns,
    gae,
    grpo_advantages,
    masked_mean,
    masked_var,
    per_token,
    reinforce_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
    zero_variance_groups,
    zero_variance_mask,
)
from lmforge.rl.kl import kl_shaped_rewards
from tests.rl.references import load_torchtune_rlhf

TT, _ = load_torchtune_rlhf()


def padded_batch(seed: int, B: int = 6, T: int = 9):
    """Right-padded rewards/values with torchtune's convention: 0 at padded positions."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    values = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.9, 1.0), (1.0, 0.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_and_returns_equal_torchtune_estimate_advantages(gamma, lam, seed):
    rewards, values, mask = padded_batch(seed)
    their_adv, their_ret = TT.estimate_advantages(values, rewards, gamma, lam, masks=mask)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(ret[mask], their_ret[mask])
    # torchtune whitens inside, with its shift_mean=True: the mean is added back (keep_mean=True here)
    torch.testing.assert_close(whiten(adv, mask, keep_mean=True), their_adv)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


@pytest.mark.parametrize("keep_mean", [True, False])
def test_whiten_equals_torchtune_whiten_with_its_inverted_shift_mean(keep_mean):
    x, _, mask = padded_batch(3)
    x = x * 3 + 2 * mask
    theirs = TT.whiten(x, mask=mask, shift_mean=keep_mean)
    torch.testing.assert_close(whiten(x, mask, keep_mean=keep_mean)[mask], theirs[mask])
    torch.testing.assert_close(masked_mean(x, mask), TT.masked_mean(x, mask))
    torch.testing.assert_close(masked_var(x, mask), TT.masked_var(x - TT.masked_mean(x, mask), mask))


def test_whitened_advantages_have_zero_mean_and_unit_variance_over_the_mask():
    x, _, mask = padded_batch(4)
    w = whiten(x * 5 - 1, mask)
    assert abs(masked_mean(w, mask).item()) < 1e-9
    assert abs(masked_var(w, mask).item() - 1) < 1e-6
    assert (w[~mask] == 0).all()


def test_gae_closed_forms_monte_carlo_and_td():
    rewards, values, mask = padded_batch(5)
    mc, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    tail_sums = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(mc, (tail_sums - values) * mask)
    td, _ = gae(rewards, values, mask, gamma=0.9, lam=0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    torch.testing.assert_close(td, (rewards + 0.9 * next_values - values) * mask)


def test_gae_skips_masked_positions_inside_a_response_as_if_absent():
    g = torch.Generator().manual_seed(6)
    r, v = torch.randn(1, 7, generator=g, dtype=torch.float64), torch.randn(1, 7, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1]], dtype=torch.bool)  # positions 2-3: a tool's output
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    compact_adv, compact_ret = gae(r[mask][None], v[mask][None], torch.ones(1, 5, dtype=torch.bool), 0.9, 0.8)
    torch.testing.assert_close(adv[mask], compact_adv[0])
    torch.testing.assert_close(ret[mask], compact_ret[0])


def test_discounted_returns_closed_form():
    rewards, _, mask = padded_batch(7)
    gamma = 0.8
    T = rewards.shape[1]
    expected = torch.stack([sum(gamma ** (s - t) * rewards[:, s] for s in range(t, T)) for t in range(T)], 1)
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma), expected * mask)


def test_reinforce_pp_is_globally_normalised_discounted_return_with_kl_in_the_reward():
    g = torch.Generator().manual_seed(8)
    _, _, mask = padded_batch(8)
    logp = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    ref = logp + 0.1 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    scores = torch.randn(mask.shape[0], generator=g, dtype=torch.float64)
    rewards, kl = kl_shaped_rewards(scores, logp, ref, mask, kl_coef=0.1)
    adv, returns = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    # γ = 1: every token's return is the completion's score minus β·(KL still to come)
    kl_to_come = kl.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(returns, (scores[:, None] - 0.1 * kl_to_come) * mask)
    assert abs(masked_mean(adv, mask).item()) < 1e-9 and abs(masked_var(adv, mask).item() - 1) < 1e-6


def group_loop(scores, ids, fn):
    """The reference: each group's scores handled by ``fn`` on its own, samples in any order."""
    out = torch.empty_like(scores)
    for gid in ids.unique():
        sel = (ids == gid).nonzero().flatten()
        out[sel] = fn(scores[sel])
    return out


SCORES = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.2, 0.9, 0.9, 0.3], dtype=torch.float64)
IDS = torch.tensor([3, 7, 3, 7, 3, 11, 7, 11, 11])  # three prompts, interleaved


def test_grpo_advantages_group_std_equal_the_per_group_formula():
    expected = group_loop(SCORES, IDS, lambda r: (r - r.mean()) / (r.std() + 1e-4))
    torch.testing.assert_close(grpo_advantages(SCORES, IDS), expected)


def test_dr_grpo_advantages_are_mean_centred_without_std():
    torch.testing.assert_close(grpo_advantages(SCORES, IDS, scale="none"), group_loop(SCORES, IDS, lambda r: r - r.mean()))


def test_batch_scaled_advantages_centre_per_group_and_divide_by_the_batch_std():
    expected = group_loop(SCORES, IDS, lambda r: r - r.mean()) / (SCORES.std() + 1e-4)
    torch.testing.assert_close(grpo_advantages(SCORES, IDS, scale="batch"), expected)


def test_group_advantages_follow_their_samples_when_the_batch_is_shuffled():
    perm = torch.randperm(len(SCORES), generator=torch.Generator().manual_seed(0))
    for fn in (grpo_advantages, rloo_advantages):
        torch.testing.assert_close(fn(SCORES[perm], IDS[perm]), fn(SCORES, IDS)[perm])


def test_rloo_baseline_is_the_mean_of_the_other_completions():
    def loo(r):
        return torch.stack([r[i] - torch.cat([r[:i], r[i + 1:]]).mean() for i in range(len(r))])
    ours = rloo_advantages(SCORES, IDS)
    torch.testing.assert_close(ours, group_loop(SCORES, IDS, loo))
    torch.testing.assert_close(ours, group_loop(SCORES, IDS, lambda r: len(r) / (len(r) - 1) * (r - r.mean())))


def test_reinforce_with_a_baseline():
    torch.testing.assert_close(reinforce_advantages(SCORES), SCORES - SCORES.mean())
    torch.testing.assert_close(reinforce_advantages(SCORES, 0.5), SCORES - 0.5)
    torch.testing.assert_close(reinforce_advantages(SCORES, SCORES.flip(0)), SCORES - SCORES.flip(0))


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages])
def test_a_group_of_one_is_an_error_naming_the_group(fn):
    with pytest.raises(ValueError, match="group id 9 has 1"):
        fn(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([4, 4, 9]))


def test_group_ids_must_be_integers_one_per_score():
    with pytest.raises(ValueError, match="integer"):
        grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="one id per score"):
        grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 0]))


def test_zero_variance_groups_are_reported_and_have_zero_advantage():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 0])  # group 0: all right, 2: all wrong, 3: one sample
    flat = zero_variance_groups(scores, ids)
    assert flat.tolist() == [True, True, False, False, True, True, True, True]
    adv = grpo_advantages(scores[ids != 3], ids[ids != 3])
    assert (adv[flat[ids != 3]] == 0).all() and (adv[~flat[ids != 3]] != 0).all()


def test_zero_variance_recipe_keep_or_drop_as_a_mask_with_a_count():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    ids = torch.tensor([5, 5, 6, 6, 8, 8])
    keep, dropped = zero_variance_mask(scores, ids, "keep")
    assert keep.all() and dropped == 0
    keep, dropped = zero_variance_mask(scores, ids, "drop")
    assert keep.tolist() == [False, False, True, True, False, False] and dropped == 2
    token_mask = torch.ones(6, 4, dtype=torch.bool) & keep[:, None]
    assert int(token_mask.sum()) == 8  # the loss's token count leaves the dropped groups out


def test_per_token_spreads_one_advantage_over_the_response():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert per_token(torch.tensor([2.0, -1.0]), mask).tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]
