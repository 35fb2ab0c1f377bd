"""`lmforge grpo` end to end on a tiny model: the reward rises, the step log has the RL figures,
samples are dumped, `final/` (and `adapter/` with LoRA) are written, an interrupted and resumed
run equals the uninterrupted one, and bad recipes are refused before any rollout."""

from __future__ import annotations

import json

import pytest
import torch

import lmforge.rl.trainer as trainer
from lmforge.checkpoints.files import load_weights
from lmforge.checkpoints.load import load_model, read_checkpoint_weights
from lmforge.core.config import ConfigError, load_config
from lmforge.stages import VERBS_BY_NAME
from lmforge.stages.grpo import GRPORecipe, run_grpo
from lmforge.stages.grpo import report as grpo_report
from lmforge.train.metrics import read_metrics
from lmforge.train.step_log import format_step
from tests.conftest import write_jsonl

# a response of the random model that holds an "e" scores 1: about a third of its 4-token responses at first
REWARD = ["reward.components=[{kind: regex, pattern: 'e'}]"]
FAST = ["rollout.n=4", "rollout.max_new_tokens=8", "grpo.prompts_per_step=4", "train.micro_batch_size=8",
        "train.precision=fp32", "train.device=cpu", "train.warmup_steps=0", "train.schedule=constant", "train.tensorboard=false", "data.max_length=96"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: more threads only spin


def recipe(tmp_path, base, prompts, *overrides, name="grpo") -> GRPORecipe:
    return load_config(GRPORecipe, None, [f"run_dir={tmp_path / name}", f"checkpoint={base}",
                                          f"data.train=[{prompts}]", *FAST, *REWARD, *overrides])


def test_grpo_is_a_verb():
    assert VERBS_BY_NAME["grpo"].load().RECIPE is GRPORecipe


def test_the_reward_rises_and_the_run_writes_final_samples_and_rl_figures(tmp_path, base_checkpoint, prompts):
    summary = run_grpo(recipe(tmp_path, base_checkpoint, prompts, "train.max_steps=24", "train.lr=1e-2",
                              "rollout.max_new_tokens=4", "grpo.samples_every=8", "objective.kl_coef=0.01"))
    run_dir = tmp_path / "grpo"
    records = [r for r in read_metrics(run_dir) if "reward_mean" in r]
    assert len(records) == 24 and summary["step"] == 24
    first = sum(r["reward_mean"] for r in records[:4]) / 4
    last = sum(r["reward_mean"] for r in records[-4:]) / 4
    assert last > first + 0.3 and last > 0.75, (first, last)  # from about 1/3 to about 9/10
    for key in ("reward_std", "score_regex", "kl_ref", "entropy", "clip_frac", "approx_kl", "ratio_mean",
                "ratio_max", "response_length_mean", "response_length_max", "zero_variance_share"):
        assert key in records[0], key
    assert records[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # μ = 1: every step on-policy
    line = format_step(records[-1], 24)  # the console line: the mean reward and the KL to the reference, as DPO's margin
    assert f" reward_mean {records[-1]['reward_mean']:.3f}" in line and f" kl_ref {records[-1]['kl_ref']:.3f}" in line
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == ["step-000001.jsonl", "step-000009.jsonl",
                                                                       "step-000017.jsonl"]
    sample = json.loads((run_dir / "samples" / "step-000009.jsonl").read_text().splitlines()[0])
    assert {"prompt", "response", "reward", "terms", "group"} <= set(sample) and sample["step"] == 9
    model, _ = load_model(run_dir / "final")
    assert model.cfg.vocab_size == 512 and not (run_dir / "adapter").exists()
    lines = "\n".join(grpo_report(summary, run_dir, tmp_path / "grpo-loss.png"))  # the lifecycle report's lines
    assert f"reward mean {records[0]['reward_mean']:.3f} → {records[-1]['reward_mean']:.3f}" in lines
    assert "![reward, KL and response length](grpo-rl.png)" in lines and (tmp_path / "grpo-rl.png").stat().st_size
    assert "a step's time" in lines and "rollout" in lines and "forward backward" in lines


def test_an_interrupted_and_resumed_run_equals_the_uninterrupted_one(tmp_path, base_checkpoint, prompts):
    # μ = 2 and a stop at step 3: the checkpoint falls inside a rollout batch's two steps
    common = ["train.max_steps=6", "train.lr=1e-3", "grpo.updates_per_batch=2", "objective.kl_coef=0.05",
              "train.checkpoint_every=0", "grpo.advantage=rloo"]
    run_grpo(recipe(tmp_path, base_checkpoint, prompts, *common, name="whole"))
    run_grpo(recipe(tmp_path, base_checkpoint, prompts, *common, "train.stop_at_step=3", name="parts"))
    state = json.loads((tmp_path / "parts" / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["loader"]["buffer"] is not None and state["loader"]["uses_left"] == 1
    run_grpo(recipe(tmp_path, base_checkpoint, prompts, *common, name="parts"))
    whole, parts = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "parts")
    assert [r["step"] for r in parts] == list(range(1, 7))
    for a, b in zip(whole, parts):
        assert a["loss"] == b["loss"] and a["reward_mean"] == b["reward_mean"] and a["ratio_max"] == b["ratio_max"]
    assert whole[1]["ratio_max"] != 1.0  # the second step of a batch is off-policy
    for record in whole:  # the step's time split: the phases of drawing a rollout batch, on the steps that draw one
        sampled = record["step"] % 2 == 1
        assert ("time/rollout_s" in record) == ("time/reward_s" in record) == ("time/reference_s" in record) == sampled
        inside = sum(record.get(f"time/{p}_s", 0.0) for p in ("rollout", "reward", "reference"))
        assert (0 < inside <= record["time/batches_s"]) if sampled else inside == 0
        assert record["time/forward_backward_s"] > 0 and record["time/optimizer_s"] >= 0
        assert record["time/batches_s"] + record["time/forward_backward_s"] <= record["step_s"]
    wa, wb = read_checkpoint_weights(tmp_path / "whole" / "final"), read_checkpoint_weights(tmp_path / "parts" / "final")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_lora_writes_an_adapter_and_its_reference_is_the_base(tmp_path, base_checkpoint, prompts):
    summary = run_grpo(recipe(tmp_path, base_checkpoint, prompts, "train.max_steps=2", "train.lr=1e-2",
                              "lora.r=4", "lora.alpha=8", "objective.kl_coef=0.1"))
    run_dir = tmp_path / "grpo"
    assert summary["lora"] and (run_dir / "adapter" / "adapter_config.json").is_file()
    records = read_metrics(run_dir)
    assert records[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # LoRA's B starts at 0: the policy is the base
    assert records[1]["kl_ref"] > 0
    merged = read_checkpoint_weights(run_dir / "final")
    base, _ = load_model(base_checkpoint)
    load_weights(base, merged, where="final")  # the merged model has the base's layout


def test_a_group_size_of_one_is_an_error_before_any_rollout(tmp_path, base_checkpoint, prompts, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("sampled")

    monkeypatch.setattr(trainer, "sample_rollouts", never)
    with pytest.raises(ConfigError, match="rollout.n \\(the group size G\\) is 1"):
        run_grpo(recipe(tmp_path, base_checkpoint, prompts, "rollout.n=1"))
    with pytest.raises(ConfigError, match="max_new_tokens 96 leaves no room"):
        run_grpo(recipe(tmp_path, base_checkpoint, prompts, "rollout.max_new_tokens=96"))
    with pytest.raises(ConfigError, match="rollback"):
        run_grpo(recipe(tmp_path, base_checkpoint, prompts, "train.spikes.policy=rollback"))


def test_a_prompt_without_the_field_the_reward_reads_names_its_line(tmp_path, base_checkpoint):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "2 + 2 =", "answer": "4"}, {"prompt": "3 + 3 ="}])
    from lmforge.core.io import InputError
    with pytest.raises(InputError, match="bad.jsonl:2.*answer"):
        run_grpo(recipe(tmp_path, base_checkpoint, bad, "reward.components=[{kind: exact_match}]"))
