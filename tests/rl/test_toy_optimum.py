"""The RL math end to end on a problem with a known optimum, in seconds.

A "policy" over a fixed context: a tiny ``nn.Linear`` from the position's one-hot to logits over
V tokens, sampling T tokens. The reward is ``−|count of token 0 − TARGET|``: its optimum (0) is
reached only by a policy that puts token 0 at exactly TARGET positions, deterministically, while
the initial policy emits it at ~T/V positions. GRPO (group advantages + ``policy_loss``) and PPO
(KL-shaped per-token rewards, GAE with a small value head, clipped policy and value losses)
must both get there.
"""

import pytest
import torch
from torch import nn

from lmforge.rl.advantages import gae, grpo_advantages, whiten
from lmforge.rl.kl import kl_shaped_rewards
from lmforge.rl.losses import PolicyLossConfig, policy_loss, value_loss

V, T, TARGET = 3, 6, 4
POSITIONS = torch.eye(T)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: more threads only spin


def reward(tokens: torch.Tensor) -> torch.Tensor:
    return -((tokens == 0).sum(-1) - TARGET).abs().float()


def sample(policy: nn.Linear, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        probs = torch.softmax(policy(POSITIONS), -1)  # T x V
        tokens = torch.multinomial(probs, n, replacement=True, generator=g).T  # n x T
    return tokens, logprobs(policy, tokens).detach()


def logprobs(policy: nn.Linear, tokens: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(policy(POSITIONS), -1)  # T x V
    return logp.expand(tokens.shape[0], T, V).gather(-1, tokens[..., None]).squeeze(-1)


def greedy_reward(policy: nn.Linear) -> float:
    return reward(policy(POSITIONS).argmax(-1)[None]).item()


def mean_sampled_reward(policy: nn.Linear, g: torch.Generator) -> float:
    return reward(sample(policy, 512, g)[0]).mean().item()


def test_grpo_reaches_the_optimum():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    policy = nn.Linear(T, V)
    opt = torch.optim.Adam(policy.parameters(), lr=0.05)
    prompts, per_prompt = 4, 8
    group_ids = torch.arange(prompts).repeat(per_prompt)  # interleaved, not contiguous
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28)
    start = mean_sampled_reward(policy, g)
    for _ in range(150):
        tokens, old = sample(policy, prompts * per_prompt, g)
        adv = grpo_advantages(reward(tokens), group_ids)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        for _ in range(2):  # two updates per batch: the second is off-policy, clipped
            loss, _ = policy_loss(logprobs(policy, tokens), old, adv, mask, cfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert start < -1.0
    assert greedy_reward(policy) == 0.0
    assert mean_sampled_reward(policy, g) > -0.1


def test_ppo_with_gae_and_a_value_head_reaches_the_optimum():
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    policy = nn.Linear(T, V)
    critic = nn.Linear(T + 1, 1)  # state: position, and the count of token 0 so far
    opt = torch.optim.Adam([*policy.parameters(), *critic.parameters()], lr=0.05)
    cfg = PolicyLossConfig(clip_low=0.2)

    def values(tokens):
        before = torch.cat([torch.zeros(tokens.shape[0], 1), (tokens == 0).float().cumsum(-1)[:, :-1]], -1)
        feats = torch.cat([POSITIONS.expand(tokens.shape[0], T, T), before[..., None] / T], -1)
        return critic(feats).squeeze(-1)

    start = mean_sampled_reward(policy, g)
    for _ in range(150):
        tokens, old = sample(policy, 32, g)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        rewards, _ = kl_shaped_rewards(reward(tokens), old, old, mask, kl_coef=0.05)  # ref = π_old: KL 0 here
        with torch.no_grad():
            old_values = values(tokens)
        adv, returns = gae(rewards, old_values, mask, gamma=1.0, lam=0.95)
        adv = whiten(adv, mask)
        for _ in range(2):
            for rows in (slice(0, 16), slice(16, 32)):  # minibatches, token-mean over the whole batch
                n = int(mask.sum())
                pol, _ = policy_loss(logprobs(policy, tokens[rows]), old[rows], adv[rows], mask[rows], cfg, n_tokens=n)
                val, _ = value_loss(values(tokens[rows]), old_values[rows], returns[rows], mask[rows], n_tokens=n)
                opt.zero_grad()
                (pol + 0.5 * val).backward()
                opt.step()
    assert start < -1.0
    assert greedy_reward(policy) == 0.0
    assert mean_sampled_reward(policy, g) > -0.1
