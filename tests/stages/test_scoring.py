"""held_out_scores: greedy answers scored by exact match (as the stages' exact_match scorer), a
reward's mean and the exact KL to a reference along the answers."""

import pytest
import torch

from lmforge.data.tokenizer import Tokenizer
from lmforge.rl.kl import exact_kl
from lmforge.rl.prompts import read_prompts
from lmforge.rl.rewards import Reward, RewardComponentConfig, RewardConfig
from lmforge.rl.rollout import rollout_batch
from lmforge.stages.scoring import exact_match_accuracy, exact_match_tasks, held_out_scores
from lmforge.train.checkpoint import load_model


def text_length(response: str, prompt) -> float:
    return float(len(response))


@pytest.fixture()
def policy_and_reference(base_checkpoint):
    policy, reference = load_model(base_checkpoint)[0], load_model(base_checkpoint)[0]
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, reference


def test_held_out_scores_match_the_stage_scorer_and_the_kl_is_exact(base_checkpoint, prompts, policy_and_reference):
    tok = Tokenizer.load(base_checkpoint)
    policy, reference = policy_and_reference
    held_out = read_prompts([str(prompts)], tok)
    length = RewardConfig(components=[RewardComponentConfig(kind="callable", function="tests.stages.test_scoring:text_length")])
    scores = held_out_scores(policy, tok, held_out, 8, reward=Reward(length, tok, 8), reference=reference)

    ids, answers = exact_match_tasks(tok, [str(prompts)], 100)
    assert scores["examples"] == len(held_out) == 12
    assert scores["exact_match"] == exact_match_accuracy(policy, tok, ids, answers, 8)["exact_match"]
    assert scores["kl_per_token"] > 0 and scores["kl_per_sequence"] >= scores["kl_per_token"]

    # the KL by hand: every response token's exact KL, per response averaged, then over responses
    from lmforge.rl.rollout import RolloutConfig, RolloutState, sample_rollouts
    greedy = RolloutConfig(n=1, temperature=0.0, max_new_tokens=8, shuffle=False)
    rollouts = [g[0] for g in sample_rollouts(policy, tok, held_out, greedy, RolloutState(0, 12, shuffle=False), 12)]
    means = []
    for r in rollouts:
        batch = rollout_batch([r], tok.pad_id)
        with torch.no_grad():
            kl = exact_kl(policy(batch["input_ids"])[:, :-1], reference(batch["input_ids"])[:, :-1])[0]
        means.append(float(kl[batch["response_mask"][0, 1:]].mean()))
    assert scores["kl_per_token"] == pytest.approx(sum(means) / len(means), rel=1e-4)
    assert scores["reward_mean"] == pytest.approx(sum(len(r.text) for r in rollouts) / 12)


def test_a_model_has_no_kl_to_itself(base_checkpoint, prompts, policy_and_reference):
    tok = Tokenizer.load(base_checkpoint)
    policy, _ = policy_and_reference
    scores = held_out_scores(policy, tok, read_prompts([str(prompts)], tok), 6, reference=policy)
    assert scores["kl_per_token"] == pytest.approx(0.0, abs=1e-6)
    assert "reward_mean" not in scores
