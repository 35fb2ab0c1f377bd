"""`lmforge ppo` end to end on a tiny model: the reward rises, the step log has the PPO figures,
`final/` (and `adapter/` with LoRA) are written, an interrupted and resumed run equals the
uninterrupted one, and bad recipes (a reward model with another tokenizer, a missing critic
checkpoint) are refused before any rollout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import lmforge.rl.trainer as trainer
from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model, read_checkpoint_weights
from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError
from lmforge.data.tokenizer import TokenizerConfig, train_tokenizer
from lmforge.model.config import ModelConfig
from lmforge.model.reward import HEAD_FILE, RewardModel
from lmforge.model.transformer import Transformer
from lmforge.stages import VERBS_BY_NAME
from lmforge.stages.ppo import PPORecipe, run_ppo
from lmforge.train.metrics import read_metrics
from lmforge.train.step_log import format_step

REWARD = ["reward.components=[{kind: regex, pattern: 'e'}]"]
FAST = ["rollout.n=2", "rollout.max_new_tokens=8", "ppo.prompts_per_step=8", "train.micro_batch_size=8",
        "train.precision=fp32", "train.device=cpu", "train.warmup_steps=0", "train.schedule=constant",
        "train.tensorboard=false", "data.max_length=96"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: more threads only spin


def recipe(tmp_path, base, prompts, *overrides, name="ppo") -> PPORecipe:
    return load_config(PPORecipe, None, [f"run_dir={tmp_path / name}", f"checkpoint={base}",
                                         f"data.train=[{prompts}]", *FAST, *REWARD, *overrides])


def test_ppo_is_a_verb():
    assert VERBS_BY_NAME["ppo"].load().RECIPE is PPORecipe


@pytest.mark.parametrize("kind", ["separate", "shared"])
def test_the_reward_rises_and_the_run_logs_the_ppo_figures(tmp_path, base_checkpoint, prompts, kind):
    summary = run_ppo(recipe(tmp_path, base_checkpoint, prompts, "train.max_steps=24", "train.lr=1e-2",
                             "rollout.max_new_tokens=4", "ppo.updates_per_batch=1", "ppo.kl_coef=0.01",
                             f"ppo.critic.kind={kind}", "ppo.critic.vf_coef=0.5"))
    run_dir = tmp_path / "ppo"
    records = [r for r in read_metrics(run_dir) if "reward_mean" in r]
    assert len(records) == 24 and summary["step"] == 24
    first = sum(r["reward_mean"] for r in records[:4]) / 4
    last = sum(r["reward_mean"] for r in records[-4:]) / 4
    assert last > first + 0.3 and last > 0.75, (first, last)
    for key in ("reward_std", "score_regex", "kl", "kl_coef", "entropy", "clip_frac", "approx_kl", "ratio_mean",
                "ratio_max", "response_length_mean", "response_length_max", "value_loss", "value_clip_frac",
                "explained_variance"):
        assert key in records[0], key
    assert "zero_variance_share" in records[0]  # rollout.n = 2
    assert records[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the policy is still the reference
    line = format_step(records[-1], 24)  # the console line: the mean reward and the KL in the reward
    assert f" reward_mean {records[-1]['reward_mean']:.3f}" in line and f" kl {records[-1]['kl']:.3f}" in line
    model, _ = load_model(run_dir / "final")
    assert model.cfg.vocab_size == 512 and (run_dir / "final" / "critic.safetensors").is_file()
    assert not (run_dir / "adapter").exists()


def test_an_interrupted_and_resumed_run_equals_the_uninterrupted_one(tmp_path, base_checkpoint, prompts):
    # 2 epochs x 2 minibatches and a stop at step 3: inside a rollout batch; an adaptive β to resume
    common = ["train.max_steps=6", "train.lr=1e-3", "ppo.updates_per_batch=2", "ppo.minibatches=2",
              "train.micro_batch_size=4", "ppo.kl_target=0.01", "ppo.kl_horizon=10", "train.checkpoint_every=0"]
    run_ppo(recipe(tmp_path, base_checkpoint, prompts, *common, name="whole"))
    run_ppo(recipe(tmp_path, base_checkpoint, prompts, *common, "train.stop_at_step=3", name="parts"))
    state = json.loads((tmp_path / "parts" / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["loader"]["buffer"] is not None and state["loader"]["estimate"]["kl"]["coef"] != 0.05
    run_ppo(recipe(tmp_path, base_checkpoint, prompts, *common, name="parts"))
    whole, parts = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "parts")
    assert [r["step"] for r in parts] == list(range(1, 7))
    for a, b in zip(whole, parts):
        assert a["loss"] == b["loss"] and a["kl_coef"] == b["kl_coef"] and a["value_loss"] == b["value_loss"]
    assert whole[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5) and whole[1]["ratio_max"] != 1.0
    assert whole[4]["kl_coef"] != whole[0]["kl_coef"]  # β adapted
    wa, wb = read_checkpoint_weights(tmp_path / "whole" / "final"), read_checkpoint_weights(tmp_path / "parts" / "final")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ca, cb = (load_file(str(tmp_path / run / "final" / "critic.safetensors")) for run in ("whole", "parts"))
    assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca)  # the critic resumed too


def test_lora_writes_an_adapter_its_reference_is_the_base_and_the_policy_is_scored(tmp_path, base_checkpoint, prompts):
    summary = run_ppo(recipe(tmp_path, base_checkpoint, prompts, "train.max_steps=2", "train.lr=1e-2",
                             "lora.r=4", "lora.alpha=8", "ppo.updates_per_batch=1", "ppo.critic.kind=shared",
                             "rollout.n=1", "score.name=exact_match", f"data.val=[{prompts}]", "score.max_examples=3"))
    run_dir = tmp_path / "ppo"
    assert summary["lora"] and (run_dir / "adapter" / "adapter_config.json").is_file()
    records = read_metrics(run_dir)
    assert "zero_variance_share" not in records[0]  # rollout.n = 1: a group of one says nothing
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6) and records[1]["kl"] != 0
    assert summary["before"]["exact_match"]["examples"] == summary["after"]["exact_match"]["examples"] == 3


def write_reward_model(path, tokenizer_dir):
    torch.manual_seed(1)
    rm = RewardModel(Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, ffn_hidden=64,
                                             max_seq_len=128)))
    path.mkdir()
    write_model_files(path, rm.backbone, tokenizer_dir)
    rm.save_head(path)
    write_checksums(path)
    return path


@pytest.fixture()
def other_tokenizer_reward(tmp_path, corpus_texts):
    other = tmp_path / "other-tokenizer"
    train_tokenizer(corpus_texts[:20], TokenizerConfig(vocab_size=300)).save(other)
    return write_reward_model(tmp_path / "rm-other", other)


def test_a_critic_from_the_reward_model_starts_from_its_weights_and_head(tmp_path, base_checkpoint, prompts,
                                                                        small_tokenizer_dir):
    rm = write_reward_model(tmp_path / "rm", small_tokenizer_dir)
    summary = run_ppo(recipe(tmp_path, base_checkpoint, prompts, "train.max_steps=1", "ppo.updates_per_batch=1",
                             f"reward.components=[{{kind: reward_model, path: '{rm}'}}, {{kind: regex, pattern: e}}]",
                             "ppo.critic.init=reward_model", "train.lr=1e-12"))
    records = read_metrics(tmp_path / "ppo")
    assert summary["step"] == 1 and "score_reward_model" in records[0] and "score_regex" in records[0]
    critic = load_file(str(tmp_path / "ppo" / "final" / "critic.safetensors"))
    head = load_file(str(rm / HEAD_FILE))
    assert torch.allclose(critic["value.weight"], head["weight"], atol=1e-6)  # the reward model's head
    assert records[0]["value_mean"] != 0.0  # a zero head would value every state at 0


@pytest.fixture()
def never_sample(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("sampled")

    monkeypatch.setattr(trainer, "sample_rollouts", never)


def test_a_reward_model_with_another_tokenizer_is_refused_before_any_rollout(tmp_path, base_checkpoint, prompts,
                                                                             never_sample, other_tokenizer_reward):
    with pytest.raises(InputError, match="another tokenizer than the policy"):
        run_ppo(recipe(tmp_path, base_checkpoint, prompts,
                       f"reward.components=[{{kind: reward_model, path: '{other_tokenizer_reward}'}}]"))


def test_a_missing_critic_checkpoint_and_bad_settings_are_refused(tmp_path, base_checkpoint, prompts, never_sample):
    with pytest.raises(ConfigError, match="critic.init .*nowhere"):
        run_ppo(recipe(tmp_path, base_checkpoint, prompts, f"ppo.critic.init={tmp_path / 'nowhere'}"))
    with pytest.raises(ConfigError, match="critic.init=reward_model needs exactly one"):
        run_ppo(recipe(tmp_path, base_checkpoint, prompts, "ppo.critic.init=reward_model"))
    with pytest.raises(ConfigError, match="PPO puts the KL in the reward"):
        run_ppo(recipe(tmp_path, base_checkpoint, prompts, "objective.kl_coef=0.1"))
    with pytest.raises(ConfigError, match="minibatches 3 must divide"):
        run_ppo(recipe(tmp_path, base_checkpoint, prompts, "ppo.minibatches=3"))


def test_the_demo_recipe_loads_and_passes_its_checks():
    r = load_config(PPORecipe, "recipes/demo/ppo.yaml", [])
    r.ppo.check(r.rollout)
    r.reward.check()
    assert r.ppo.critic.init == "reward_model" and r.reward.components[0].kind == "reward_model"
    assert r.objective.kl_coef == 0 and r.ppo.kl_target == 2.0 and r.ppo.minibatches == 2


def test_a_critic_checkpoint_with_another_tokenizer_is_refused_before_any_rollout(tmp_path, base_checkpoint, prompts,
                                                                                  never_sample, other_tokenizer_reward):
    with pytest.raises(InputError, match="ppo.critic.init: .* has another tokenizer than the policy"):
        run_ppo(recipe(tmp_path, base_checkpoint, prompts, f"ppo.critic.init={other_tokenizer_reward}"))
