"""`lmforge ppo` under torchrun (gloo, 2 CPU processes, FSDP2) against one process with the
same prompts and global batch: each rank samples its two of the four prompts of a step from a
plain copy of the gathered policy, the critic's values come from the sharded ActorCritic, and
the advantages are whitened over both ranks' tokens. A separate critic with full fine-tuning
(the reference: the base sharded as the policy) and 2 PPO epochs, and a shared critic with LoRA
(the reference: adapters disabled), and two minibatches per epoch. Per-step losses, gradient
norms, rewards, the PPO figures
and the final policy and critic match.

One launch of three short jobs (a tiny model, 4 steps each).
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from lmforge.core.config import load_config
from lmforge.data.sft_demo import make_examples
from lmforge.stages.ppo import PPORecipe, run_ppo
from lmforge.train.metrics import read_metrics
from tests.conftest import write_jsonl
from tests.distributed.conftest import assert_adamw_weights_match, torchrun
from tests.stages.conftest import base_checkpoint  # noqa: F401  (fixture of tests/stages)

STEPS = 4
RUNS = {"separate": ["ppo.updates_per_batch=2"],
        "shared": ["lora={r: 4, alpha: 8}", "ppo.critic.kind=shared", "train.lr=1e-2", "ppo.updates_per_batch=1"],
        "minibatches": ["ppo.updates_per_batch=1", "ppo.minibatches=2"]}  # minibatch i: the global rows i mod 2
FIGURES = ("reward_mean", "reward_std", "score_regex", "response_length_mean", "ratio_mean", "ratio_max", "clip_frac",
           "approx_kl", "entropy", "kl", "kl_coef", "value_loss", "value_clip_frac", "explained_variance")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base_checkpoint):  # noqa: F811
    root = tmp_path_factory.mktemp("ppo_parallel")
    prompts = write_jsonl(root / "prompts.jsonl", make_examples(12, seed=3))

    def make(name, mbs, *overrides):
        return load_config(PPORecipe, None, [
            f"run_dir={root / name}", f"checkpoint={base_checkpoint}", f"data.train=[{prompts}]",
            "reward.components=[{kind: regex, pattern: 'e'}]", "rollout.n=2", "rollout.max_new_tokens=6",
            "ppo.prompts_per_step=4", "ppo.kl_coef=0.05", "ppo.kl_target=0.01", "ppo.kl_horizon=10",
            f"train.micro_batch_size={mbs}", f"train.max_steps={STEPS}", "train.lr=3e-3",
            "train.warmup_steps=0", "train.schedule=constant", "train.precision=fp32", "train.device=cpu",
            "train.tensorboard=false", "train.checkpoint_every=0", "data.max_length=96", *overrides])

    jobs = []
    for name, overrides in RUNS.items():
        run_ppo(make(name, 4, *overrides))  # 8 rows: two micro-batches of 4
        jobs.append({"kind": "ppo", "recipe": make(f"{name}_fsdp", 2, *overrides)})  # 4 rows a rank: two of 2
    torchrun(2, jobs, root)
    return root


def column(run_dir, key):
    return [r[key] for r in read_metrics(run_dir) if key in r]


@pytest.mark.parametrize("name", list(RUNS))
def test_two_rank_fsdp_ppo_matches_one_process_step_by_step(runs, name):
    reference, fsdp = runs / name, runs / f"{name}_fsdp"
    assert column(fsdp, "step") == list(range(1, STEPS + 1))
    assert column(fsdp, "targets") == column(reference, "targets")
    assert column(fsdp, "loss") == pytest.approx(column(reference, "loss"), rel=1e-5, abs=1e-6)
    assert column(fsdp, "grad_norm") == pytest.approx(column(reference, "grad_norm"), rel=1e-4)
    for figure in FIGURES:
        assert column(fsdp, figure) == pytest.approx(column(reference, figure), rel=1e-4, abs=1e-6), figure
    assert len(set(column(reference, "kl_coef"))) > 1 and min(column(reference, "value_loss")) > 0  # β adapts


@pytest.mark.parametrize("name", list(RUNS))
def test_two_rank_fsdp_ppo_writes_the_final_policy_and_critic_of_one_process(runs, name):
    reference, fsdp = runs / name, runs / f"{name}_fsdp"
    for file in ("model.safetensors", "critic.safetensors"):
        assert_adamw_weights_match(load_file(str(fsdp / "final" / file)), load_file(str(reference / "final" / file)),
                                   reference)
    assert (fsdp / "adapter" / "adapter_model.safetensors").is_file() is (name == "shared")
    assert json.loads((fsdp / "summary.json").read_text())["world_size"] == 2
