"""Rewards: answer checks, verifiers, a trained reward model (same layout as its training rows,
same tokenizer as the policy), recipe callables checked on load and at each call, the weighted
sum with each term kept, the length penalty and DAPO's soft overlong punishment."""

from __future__ import annotations

import random

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError
from lmforge.data.chat import chat_prompt_ids
from lmforge.data.preference import tokenize_completion
from lmforge.data.tokenizer import TokenizerConfig, train_tokenizer
from lmforge.eval.answers import edit_similarity, exact_match, final_answer, levenshtein, numeric_match
from lmforge.model.config import ModelConfig
from lmforge.model.reward import RewardModel
from lmforge.model.transformer import Transformer
from lmforge.rl.prompts import Prompt
from lmforge.rl.rewards import (
    Reward,
    RewardConfig,
    overlong_punishment,
    reward_model_ids,
)
from lmforge.rl.rollout import Rollout

CHAT = [{"role": "system", "content": "Answer with the result only."}, {"role": "user", "content": "What is 2 + 3?"}]


def rollout(text: str, fields: dict | None = None, *, tokens: int = 3, finish: str = "stop", prompt=None,
            ids=None, source: str = "p.jsonl:1") -> Rollout:
    p = Prompt(ids or [0, 5], source, prompt if prompt is not None else "q", fields or {})
    return Rollout(p, 0, 0, list(range(10, 10 + tokens)), [-1.0] * tokens, finish, text)


def reward(tok, *overrides: str, max_new_tokens: int = 10) -> Reward:
    return Reward(load_config(RewardConfig, None, list(overrides)), tok, max_new_tokens)


@pytest.mark.parametrize("text, answer", [("The answer is 42.", "42"), ("#### 7", "7"), ("so \\boxed{x+1}", "x+1"),
                                          ("  hello  world<|im_end|>", "hello world"), ("Answer: Paris", "Paris")])
def test_the_final_answer_is_extracted_and_matched(text, answer):
    assert exact_match(final_answer(text), answer, strip_answer=True)


def test_numeric_match_reads_the_last_number_with_commas_and_tolerance():
    assert numeric_match("it costs $1,234.50", "1234.5") and numeric_match("3 then 4", 4)
    assert numeric_match("1e3", "1000") and not numeric_match("4.01", "4") and not numeric_match("none", "4")
    assert numeric_match("4.0000001", "4", rel_tol=1e-6) and not exact_match("4.0", "4")


def test_each_verifier_scores_and_the_weighted_sum_keeps_every_term(small_tokenizer):
    r = reward(small_tokenizer, "components=[{kind: exact_match, weight: 2}, {kind: numeric_match}, "
               "{kind: regex, pattern: '^\\d+$', weight: 0.5}, {kind: demo_exact_match, name: demo}]")
    scores = r([rollout("5", {"answer": "5"}), rollout("5.0", {"answer": "5"}), rollout("five", {"answer": "5"})])
    assert scores.terms == {"exact_match": [1.0, 0.0, 0.0], "numeric_match": [1.0, 1.0, 0.0],
                            "regex": [1.0, 0.0, 0.0], "demo": [1.0, 0.0, 0.0]}
    assert scores.total == [4.5, 1.0, 0.0]
    assert r.cfg.required_fields() == ["answer"]


def test_similarity_is_one_minus_nltks_edit_distance_over_the_longer_length(small_tokenizer):
    edit_distance = pytest.importorskip("nltk.metrics.distance").edit_distance  # an independent Levenshtein
    rng = random.Random(0)
    for _ in range(200):
        a, b = ("".join(rng.choices("abc1 ", k=rng.randint(0, 9))) for _ in range(2))
        assert levenshtein(a, b) == edit_distance(a, b), (a, b)
    assert edit_similarity("duolcelpam", "duolcelpam.") == 1.0 and edit_similarity("", "") == 1.0
    assert edit_similarity("1445", "1455") == 0.75 and edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    r = reward(small_tokenizer, "components=[{kind: similarity}, {kind: demo_exact_match, name: exact}]")
    scores = r([rollout("12, 17", {"answer": "12, 17"}), rollout("12, 71", {"answer": "12, 17"}), rollout("x", {"answer": "12"})])
    assert scores.terms["similarity"] == pytest.approx([1.0, 1 - 2 / 6, 0.0]) and scores.terms["exact"] == [1.0, 0.0, 0.0]


def test_length_penalty_and_dapos_soft_overlong_punishment(small_tokenizer):
    # L_max = 10, L_cache = 4: no punishment up to 6 tokens, then (6 - L) / 4, and -1 once cut at 10
    assert [overlong_punishment(n, False, 10, 4) for n in (3, 6, 7, 8, 10)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_punishment(10, True, 10, 4) == -1.0 and overlong_punishment(9, False, 10, 0) == 0.0
    r = reward(small_tokenizer, "components=[{kind: regex, pattern: a}]", "length_penalty=0.5", "overlong_buffer=4",
               "overlong_penalty=2")
    scores = r([rollout("a", tokens=8), rollout("a", tokens=10, finish="length"), rollout("b", tokens=2)])
    assert scores.terms["length_penalty"] == [-0.4, -0.5, -0.1] and scores.terms["overlong"] == [-1.0, -2.0, 0.0]
    assert scores.total == pytest.approx([1 - 0.4 - 1.0, 1 - 0.5 - 2.0, -0.1])
    with pytest.raises(ConfigError, match="overlong_buffer 20 exceeds max_new_tokens 10"):
        reward(small_tokenizer, "overlong_buffer=20")


@pytest.fixture()
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(text, prompt):\n    return -len(text) + prompt.fields.get('bonus', 0)\n"
        "def boom(text, prompt):\n    raise RuntimeError('no verdict')\n"
        "def words(text, prompt):\n    return 'good'\n"
        "def one_argument(text):\n    return 1.0\n"
        "NOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_recipe_callable_is_called_with_the_text_and_the_prompt(small_tokenizer, rewards_module):
    r = reward(small_tokenizer, "components=[{kind: callable, function: 'my_rewards:brevity'}]")
    assert r([rollout("abc", {"bonus": 10}), rollout("a")]).total == [7.0, -1.0]


@pytest.mark.parametrize("function, message", [
    ("my_rewards.brevity", "write it as module:function"),
    ("no_such_module:f", "cannot import 'no_such_module'"),
    ("my_rewards:missing", "has no callable 'missing'"),
    ("my_rewards:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
    ("my_rewards:one_argument", "must take two arguments"),
])
def test_a_bad_callable_is_refused_when_the_recipe_is_loaded(small_tokenizer, rewards_module, function, message):
    with pytest.raises(ConfigError, match=rf"reward.components\[0\] \(callable\).*{message}"):
        load_config(RewardConfig, None, [f"components=[{{kind: callable, function: '{function}'}}]"]).check()


@pytest.mark.parametrize("function, message", [("boom", r"raised RuntimeError\('no verdict'\)"),
                                               ("words", "returned 'good', not a finite number")])
def test_a_callable_that_raises_or_returns_no_number_names_itself_and_the_prompt(small_tokenizer, rewards_module,
                                                                                function, message):
    r = reward(small_tokenizer, f"components=[{{kind: callable, function: 'my_rewards:{function}'}}]")
    with pytest.raises(InputError, match=rf"^data.jsonl:4: the reward function my_rewards:{function} {message}"):
        r([rollout("x", source="data.jsonl:4")])


@pytest.mark.parametrize("overrides, message", [
    (["components=[]"], "reward.components is empty"),
    (["components=[{kind: regex}]"], r"\(regex\) needs `pattern`"),
    (["components=[{kind: regex, pattern: '(('}]"], "is not a regular expression"),
    (["components=[{kind: reward_model}]"], "needs `path`"),
    (["components=[{kind: exact_match}, {kind: exact_match}]"], "give each a distinct `name`"),
])
def test_incomplete_components_are_refused_before_any_model_loads(small_tokenizer, overrides, message):
    with pytest.raises(ConfigError, match=message):
        reward(small_tokenizer, *overrides)


@pytest.fixture()
def reward_checkpoint(tmp_path, small_tokenizer_dir):
    torch.manual_seed(0)
    rm = RewardModel(Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, ffn_hidden=64,
                                             max_seq_len=64)))
    path = tmp_path / "rm"
    path.mkdir()
    write_model_files(path, rm.backbone, small_tokenizer_dir)
    rm.save_head(path)
    write_checksums(path)
    return path, rm.eval()


def test_the_reward_model_scores_prompt_and_response_as_its_training_rows_were_laid_out(small_tokenizer,
                                                                                       reward_checkpoint):
    path, rm = reward_checkpoint
    chat = rollout("5", prompt=CHAT, ids=chat_prompt_ids(small_tokenizer, CHAT))
    plain = rollout(" upon a time", prompt="Once", ids=[small_tokenizer.bos_id, *small_tokenizer.encode("Once")])
    for r, completion in ((chat, [{"role": "assistant", "content": "5"}]), (plain, " upon a time")):
        trained, _ = tokenize_completion(small_tokenizer, r.prompt.prompt, completion, 64, "chosen", "error")
        assert reward_model_ids(small_tokenizer, r) == trained.input_ids
    scores = reward(small_tokenizer, f"components=[{{kind: reward_model, path: '{path}', weight: 3}}]")([chat, plain])
    with torch.no_grad():
        expected = [float(rm(torch.tensor([reward_model_ids(small_tokenizer, r)]))) for r in (chat, plain)]
    assert scores.terms["reward_model"] == pytest.approx(expected, abs=1e-5)
    assert scores.total == pytest.approx([3 * e for e in expected], abs=1e-5)
    long = rollout("word " * 80, prompt="Once", ids=[small_tokenizer.bos_id])
    with pytest.raises(InputError, match="p.jsonl:1: prompt \\+ response take \\d+ tokens, more than the reward model"):
        reward(small_tokenizer, f"components=[{{kind: reward_model, path: '{path}'}}]")([long])


def test_a_reward_model_with_another_tokenizer_is_refused(reward_checkpoint, corpus_texts):
    path, _ = reward_checkpoint
    other = train_tokenizer(corpus_texts[:20], TokenizerConfig(vocab_size=300))
    with pytest.raises(InputError, match="reward.components\\[0\\]: the reward model .* has another tokenizer"):
        reward(other, f"components=[{{kind: reward_model, path: '{path}'}}]")
