"""held_out_scores: greedy answers scored by exact match (as the stages' exact_match scorer), a
reward's mean and the exact KL to a reference along the answers."""

import pytest
import torch

from lmforge.checkpoints.load import load_model
from lmforge.data.tokenizer import Tokenizer
from lmforge.rl.kl import exact_kl
from lmforge.rl.prompts import read_prompts
from lmforge.rl.rewards import Reward, RewardComponentConfig, RewardConfig
from lmforge.rl.rollout import rollout_batch
from lmforge.stages.scoring import exact_match_accuracy, exact_match_tasks, held_out_scores


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

    ids, answers, _ = exact_match_tasks(tok, [str(prompts)], 100)
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


def test_exact_match_counts_each_tasks_right_answers(monkeypatch, base_checkpoint, tmp_path):
    import json
    from types import SimpleNamespace

    from lmforge.data.sft_demo import make_examples
    from lmforge.stages import scoring

    tok = Tokenizer.load(base_checkpoint)
    path = tmp_path / "tasks.jsonl"
    rows = make_examples(6, seed=0, tasks=["counting", "sorting", "counting"])
    rows[-1] = {"messages": rows[-1]["messages"]}  # no task field: counted in the total only
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, answers, tasks = exact_match_tasks(tok, [str(path)], 100)
    assert tasks == ["counting", "sorting", "counting", "counting", "sorting", None]
    said = [answers[0], "no", "no", answers[3], answers[4], answers[5]]  # what the model "answers"
    monkeypatch.setattr(scoring, "generate", lambda model, batch, gen, tok: [SimpleNamespace(text=t) for t in said[: len(batch)]])
    model = load_model(base_checkpoint)[0]
    scores = exact_match_accuracy(model, tok, prompts, answers, 8, tasks)
    assert scores == {"exact_match": 4 / 6, "examples": 6, "correct/counting": 2, "count/counting": 3,
                      "correct/sorting": 1, "count/sorting": 2}
    assert exact_match_accuracy(model, tok, prompts, answers, 8) == {"exact_match": 4 / 6, "examples": 6}


def test_task_changes_reads_the_counts_of_both_scores():
    from lmforge.stages.grpo import exact_match_lines
    from lmforge.stages.scoring import task_changes

    before = {"exact_match": 0.1, "examples": 30, "correct/sorting": 0, "count/sorting": 11, "correct/counting": 3, "count/counting": 19}
    after = {**before, "exact_match": 0.2, "correct/counting": 5}
    assert task_changes(before, after) == "counting 3 → 5 of 19, sorting 0 → 0 of 11"
    assert task_changes({"exact_match": 0.1}, {"exact_match": 0.2}) == ""
    line, = exact_match_lines({"before": {"exact_match": before}, "after": {"exact_match": after}})
    assert line == ("- exact match on 30 held-out tasks: **10.0% before, 20.0% after** "
                    "(right answers by task: counting 3 → 5 of 19, sorting 0 → 0 of 11)")
