"""`lmforge grpo` under torchrun (gloo, 2 CPU processes, FSDP2) against one process with the
same prompts and global batch: each rank samples its two of the four prompts of a step (whole
groups) from a plain copy of the gathered policy, and the loss is the token mean over both
ranks' tokens. Full fine-tuning with a sharded frozen reference (KL term) and μ = 2 (the second
step of each rollout batch off-policy), LoRA (the reference: adapters disabled), and REINFORCE++
(whitened over both ranks' tokens) with two minibatches per pass (minibatch i: the global rows
i mod 2 on both layouts). Per-step
losses, gradient norms, rewards, RL figures and the final model match; a run stopped inside a
rollout batch resumes on each rank's share of it.

One launch of five short jobs (a tiny model, 4 steps each).
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from lmforge.core.config import load_config
from lmforge.data.sft_demo import make_examples
from lmforge.stages.grpo import GRPORecipe, run_grpo
from lmforge.train.metrics import read_metrics
from tests.conftest import write_jsonl
from tests.distributed.conftest import assert_adamw_weights_match, torchrun
from tests.stages.conftest import base_checkpoint  # noqa: F401  (fixture of tests/stages)

STEPS = 4
RUNS = {"full": ["objective.kl_coef=0.05", "grpo.updates_per_batch=2"],
        "lora": ["lora={r: 4, alpha: 8}", "objective.kl_coef=0.05", "train.lr=1e-2"],
        # REINFORCE++ whitens over both ranks' tokens (all_reduce); two optimizer steps per pass
        "reinforce_pp": ["grpo.advantage=reinforce_pp", "grpo.minibatches=2"]}
FIGURES = ("reward_mean", "reward_std", "score_regex", "response_length_mean", "response_length_max",
           "zero_variance_share", "ratio_mean", "ratio_max", "clip_frac", "approx_kl", "kl_ref", "entropy")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base_checkpoint):  # noqa: F811
    root = tmp_path_factory.mktemp("grpo_parallel")
    prompts = write_jsonl(root / "prompts.jsonl", make_examples(12, seed=3))

    def make(name, mbs, *overrides):
        return load_config(GRPORecipe, None, [
            f"run_dir={root / name}", f"checkpoint={base_checkpoint}", f"data.train=[{prompts}]",
            "reward.components=[{kind: regex, pattern: 'e'}]", "rollout.n=4", "rollout.max_new_tokens=6",
            "grpo.prompts_per_step=4", f"train.micro_batch_size={mbs}", f"train.max_steps={STEPS}", "train.lr=3e-3",
            "train.warmup_steps=0", "train.schedule=constant", "train.precision=fp32", "train.device=cpu",
            "train.tensorboard=false", "train.checkpoint_every=0", "data.max_length=96", "grpo.samples_every=2",
            *overrides])

    jobs = []
    for name, overrides in RUNS.items():
        run_grpo(make(name, 8, *overrides))  # 16 rows: two micro-batches of 8
        jobs.append({"kind": "grpo", "recipe": make(f"{name}_fsdp", 4, *overrides)})  # 8 rows a rank: two of 4
    # stopped at step 3, inside the second rollout batch's two steps, and resumed by a second launch
    jobs.append({"kind": "grpo", "recipe": make("resumed_fsdp", 4, *RUNS["full"], "train.stop_at_step=3")})
    jobs.append({"kind": "grpo", "recipe": make("resumed_fsdp", 4, *RUNS["full"])})
    torchrun(2, jobs, root)
    return root


def column(run_dir, key):
    return [r[key] for r in read_metrics(run_dir) if key in r]


@pytest.mark.parametrize("name", list(RUNS))
def test_two_rank_fsdp_grpo_matches_one_process_step_by_step(runs, name):
    reference, fsdp = runs / name, runs / f"{name}_fsdp"
    assert column(fsdp, "step") == list(range(1, STEPS + 1))
    assert column(fsdp, "targets") == column(reference, "targets")  # the global batch's response tokens
    assert column(fsdp, "loss") == pytest.approx(column(reference, "loss"), rel=1e-5, abs=1e-6)
    assert column(fsdp, "grad_norm") == pytest.approx(column(reference, "grad_norm"), rel=1e-4)
    for figure in FIGURES:
        assert column(fsdp, figure) == pytest.approx(column(reference, figure), rel=1e-4, abs=1e-6), figure
    if name == "full":
        assert column(reference, "ratio_max")[1] > 1  # the second step on a batch is off-policy
    samples = [json.loads(line) for line in (fsdp / "samples" / "step-000003.jsonl").read_text().splitlines()]
    ours = [json.loads(line) for line in (reference / "samples" / "step-000003.jsonl").read_text().splitlines()]
    assert [(s["group"], s["response"]) for s in samples] == [(s["group"], s["response"]) for s in ours]


def test_a_two_rank_run_stopped_inside_a_rollout_batch_resumes_with_each_ranks_share(runs):
    reference, resumed = runs / "full", runs / "resumed_fsdp"
    state = json.loads((resumed / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert len(state["loader"]["buffer"]) == 2 and state["loader"]["uses_left"] == 1  # one share per rank
    assert json.loads((resumed / "summary.json").read_text())["start_step"] == 3
    assert column(resumed, "step") == list(range(1, STEPS + 1))
    assert column(resumed, "loss") == pytest.approx(column(reference, "loss"), rel=1e-5, abs=1e-6)
    assert column(resumed, "reward_mean") == pytest.approx(column(reference, "reward_mean"), rel=1e-6)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_rank_fsdp_grpo_writes_the_final_model_of_one_process(runs, name):
    reference, fsdp = runs / name, runs / f"{name}_fsdp"
    assert_adamw_weights_match(load_file(str(fsdp / "final" / "model.safetensors")),
                               load_file(str(reference / "final" / "model.safetensors")), reference)
    assert (fsdp / "adapter" / "adapter_model.safetensors").is_file() is (name == "lora")
    assert json.loads((fsdp / "summary.json").read_text())["world_size"] == 2
