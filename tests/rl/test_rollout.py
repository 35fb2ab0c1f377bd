"""Rollouts: n samples per prompt through the engine, log-probs equal to the model's one forward
on every token (stop token included), groups, finish reasons, seeded and resumable sampling, and
the trainer's padded batch."""

from __future__ import annotations

import pytest
import torch

from lmforge.core.io import InputError
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.rl.prompts import Prompt
from lmforge.rl.rollout import RolloutConfig, RolloutState, request_seed, rollout_batch, sample_rollouts, stop_ids_for

STOPS = list(range(5, 45))  # about a twelfth of the vocabulary: a random model stops within a few tokens


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                   max_seq_len=128)).eval()


@pytest.fixture()
def prompts(small_tokenizer) -> list[Prompt]:
    texts = ["To be, or not", "Once upon a time there", "ROMEO.", "The quick brown fox jumps over"]
    return [Prompt([small_tokenizer.bos_id, *small_tokenizer.encode(t)], f"p.jsonl:{i + 1}", t, {"i": i})
            for i, t in enumerate(texts)]


def sample(model, tok, prompts, cfg, k, state=None):
    state = state or RolloutState(cfg.seed, len(prompts), cfg.shuffle)
    return sample_rollouts(model, tok, prompts, cfg, state, k), state


def test_recorded_logprobs_equal_the_models_forward_on_every_token(model, small_tokenizer, prompts):
    cfg = RolloutConfig(n=3, max_new_tokens=12, stop_token_ids=STOPS, seed=1)
    groups, _ = sample(model, small_tokenizer, prompts, cfg, len(prompts))
    rollouts = [r for g in groups for r in g]
    assert {r.finish_reason for r in rollouts} == {"stop", "length"}  # both endings are checked
    batch = rollout_batch(rollouts, small_tokenizer.pad_id)
    with torch.no_grad():
        logits = model(batch["input_ids"])  # right padding: causal attention never reads the trailing pads
    recomputed = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["response_mask"][:, 1:]
    assert int(mask.sum()) == sum(len(r.response_ids) for r in rollouts)
    delta = (recomputed - batch["old_logprobs"][:, 1:]).abs()[mask]
    assert float(delta.max()) < 1e-5
    for r in rollouts:  # a stopped response ends with its stop token, whose log-prob was checked with the rest
        assert (r.response_ids[-1] in STOPS) == (r.finish_reason == "stop")
        assert len(r.logprobs) == len(r.response_ids)


def test_each_prompt_is_a_group_of_n_with_its_fields(model, small_tokenizer, prompts):
    cfg = RolloutConfig(n=4, max_new_tokens=6, stop_token_ids=STOPS, shuffle=False)
    groups, state = sample(model, small_tokenizer, prompts, cfg, 3)
    assert [[r.group for r in g] for g in groups] == [[0] * 4, [1] * 4, [2] * 4]
    assert [g[0].prompt.fields for g in groups] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert all([r.sample for r in g] == [0, 1, 2, 3] for g in groups)
    assert (state.epoch, state.cursor, state.groups) == (0, 3, 3)
    batch = rollout_batch([r for g in groups for r in g], 2, rewards=[1.0] * 12)
    assert batch["group_ids"].tolist() == [0] * 4 + [1] * 4 + [2] * 4 and batch["rewards"].shape == (12,)


def test_overlong_responses_are_marked_and_can_be_masked(model, small_tokenizer, prompts):
    cfg = RolloutConfig(n=2, max_new_tokens=5, stop_token_ids=[])
    groups, _ = sample(model, small_tokenizer, prompts, cfg, 2)
    rollouts = [r for g in groups for r in g]
    assert all(r.truncated and len(r.response_ids) == 5 for r in rollouts)
    kept = rollout_batch(rollouts, 2)
    masked = rollout_batch(rollouts, 2, mask_truncated=True)
    assert torch.equal(kept["loss_mask"], kept["response_mask"]) and not masked["loss_mask"].any()
    assert masked["truncated"].all()


def test_resuming_from_the_state_samples_what_an_uninterrupted_run_samples(model, small_tokenizer, prompts):
    cfg = RolloutConfig(n=2, max_new_tokens=8, stop_token_ids=STOPS, seed=3)
    state = RolloutState(cfg.seed, len(prompts), cfg.shuffle)
    straight = [sample_rollouts(model, small_tokenizer, prompts, cfg, state, 3) for _ in range(3)]  # 9: wraps an epoch
    first, saved = sample(model, small_tokenizer, prompts, cfg, 3)
    resumed = RolloutState(cfg.seed, len(prompts), cfg.shuffle)
    resumed.load_state_dict(saved.state_dict())
    rest = [sample_rollouts(model, small_tokenizer, prompts, cfg, resumed, 3) for _ in range(2)]

    def tokens(chunks):
        return [[(r.group, r.prompt.source, r.response_ids) for r in g] for chunk in chunks for g in chunk]

    assert tokens(straight) == tokens([first, *rest])
    assert resumed.state_dict() == state.state_dict() and state.epoch == 2
    assert len({r.prompt.source for chunk in straight[:1] for g in chunk for r in g}) == 3


def test_a_prompts_samples_do_not_depend_on_what_shares_its_batch(model, small_tokenizer, prompts):
    cfg = RolloutConfig(n=2, max_new_tokens=8, stop_token_ids=STOPS, shuffle=False)
    together, _ = sample(model, small_tokenizer, prompts, cfg, 4)
    state = RolloutState(cfg.seed, len(prompts), False)
    one_by_one = [sample_rollouts(model, small_tokenizer, prompts, cfg, state, 1)[0] for _ in range(4)]
    assert [[r.response_ids for r in g] for g in together] == [[r.response_ids for r in g] for g in one_by_one]
    assert request_seed(0, 0, 1) != request_seed(0, 0, 2) != request_seed(0, 1, 1)
    reseeded, _ = sample(model, small_tokenizer, prompts, RolloutConfig(n=2, max_new_tokens=8, stop_token_ids=STOPS,
                                                                       shuffle=False, seed=5), 4)
    assert [[r.response_ids for r in g] for g in reseeded] != [[r.response_ids for r in g] for g in together]


def test_the_state_orders_prompts_per_epoch_and_refuses_other_prompts():
    state = RolloutState(seed=0, n_prompts=5)
    first, second = [i for _, _, i in state.take(5)], [i for _, _, i in state.take(5)]
    assert sorted(first) == sorted(second) == list(range(5)) and first != second
    assert [i for _, _, i in RolloutState(0, 5, shuffle=False).take(7)] == [0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(InputError, match="for 5 prompts with seed 0.*these are 6 with seed 0"):
        RolloutState(0, 6).load_state_dict(state.state_dict())


def test_only_temperature_one_untruncated_sampling_records_its_own_distribution():
    assert RolloutConfig().exact_logprobs
    assert not RolloutConfig(temperature=0.7).exact_logprobs and not RolloutConfig(top_p=0.9).exact_logprobs


def test_stop_strings_cut_the_text_and_chat_prompts_stop_at_the_end_of_turn(model, small_tokenizer, prompts):
    cfg = RolloutConfig(n=2, max_new_tokens=10, stop_token_ids=[])
    groups, _ = sample(model, small_tokenizer, prompts, cfg, 1)
    text = groups[0][0].text
    assert len(text) > 2
    stop = text[1:3]
    cut, _ = sample(model, small_tokenizer, prompts, RolloutConfig(n=2, max_new_tokens=10, stop_token_ids=[],
                                                                  stop=[stop]), 1)
    assert stop not in cut[0][0].text and cut[0][0].finish_reason == "stop"
    chat = Prompt([small_tokenizer.bos_id, 3], "c:1", [{"role": "user", "content": "hi"}])
    assert stop_ids_for(chat, RolloutConfig(), small_tokenizer) == [small_tokenizer.token_to_id("<|im_end|>"),
                                                                   small_tokenizer.eos_id]
