"""`lmforge dpo`, `kto` and `reward` under torchrun (gloo, 2 CPU processes, FSDP2) against one
process on the same data and global batch.

DPO: full fine-tuning with precomputed reference log-probs (each rank scores its share) and
with a live frozen reference (sharded as the policy), LoRA with the adapters-disabled
reference (live and precomputed), and a validation set that is no whole global batch. KTO:
the KL baseline z0 over both ranks' rows, precomputed and live (LoRA). Reward: the backbone
and its head sharded together. Per-step losses, gradient norms, metrics, validation figures
and the final model match.

The KTO run evaluates a set larger than ``train.eval_batches`` covers (before training too),
under ZeRO-2-like resharding; the live-reference DPO run and the KTO run stop half-way and
resume from their sharded checkpoints; a bf16 DPO run starts at ln 2.

One launch of twelve short jobs (a tiny model, 4 steps each).
"""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from lmforge.checkpoints.load import load_reward_model
from lmforge.core.config import load_config
from lmforge.data.preference_demo import make_pairs, unpair, write_jsonl
from lmforge.data.sft_demo import make_examples
from lmforge.stages.dpo import DPORecipe, run_dpo
from lmforge.stages.kto import KTORecipe, run_kto
from lmforge.stages.reward import RewardRecipe, run_reward
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import assert_adamw_weights_match, torchrun
from tests.stages.conftest import base_checkpoint  # noqa: F401  (fixture of tests/stages)

STEPS = 4
LORA = "lora={r: 4, alpha: 8}"
STAGES = {"dpo": (DPORecipe, run_dpo), "kto": (KTORecipe, run_kto), "reward": (RewardRecipe, run_reward)}
RUNS = {  # name: (stage, overrides)
    "precomputed": ("dpo", []),
    "live": ("dpo", ["precompute_reference=false"]),  # a frozen copy of the policy: sharded under torchrun
    "lora": ("dpo", [LORA, "precompute_reference=false"]),  # the policy with adapters disabled
    "lora_precomputed": ("dpo", [LORA, "score.name=none"]),  # the sharded policy, adapters disabled
    "val3": ("dpo", ["train.max_steps=2", "score.name=none"]),  # 3 validation pairs: padded with filler
    "kto": ("kto", []),
    "kto_lora_live": ("kto", [LORA, "precompute_reference=false", "score.name=none"]),
    "reward": ("reward", []),
    "reward_lora": ("reward", [LORA]),
    "bf16": ("dpo", ["train.precision=bf16", "train.max_steps=1", "score.name=none", "data.val=[]"]),
}
RESUMED = ("live", "kto")  # the 2-rank run stops after step 2 and a second launch resumes it
# what the single process has no use for: ZeRO-2-like resharding, after an evaluation (kto) and
# after the reference's precomputation with no evaluation next (bf16, no validation set)
FSDP_ONLY = {"kto": ["parallel.reshard_after_forward=false"], "bf16": ["parallel.reshard_after_forward=false"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base_checkpoint):  # noqa: F811
    """Run directories by name: single-process references and the 2-rank FSDP runs (``<name>_fsdp``)."""
    root = tmp_path_factory.mktemp("preference_parallel")
    pairs = make_pairs(make_examples(36, seed=3))
    write_jsonl(root / "train.jsonl", pairs[:24])
    write_jsonl(root / "val.jsonl", pairs[24:32])  # 8 pairs: one global batch of 2 ranks x 4
    write_jsonl(root / "val3.jsonl", pairs[32:35])
    write_jsonl(root / "kto_train.jsonl", unpair(pairs[:24]))
    write_jsonl(root / "kto_val.jsonl", unpair(pairs[24:36]))  # 24 examples, of which eval_batches covers 16

    def make(name: str, stage: str, *overrides: str):
        if stage == "kto":  # 8 examples a step: one process 1 x 8; two ranks 1 x 4 each (z0 over the 8)
            data = ["data.train=[{}]".format(root / "kto_train.jsonl"), "data.val=[{}]".format(root / "kto_val.jsonl"),
                    f"pairs=[{root / 'val.jsonl'}]", "train.micro_batch_size=8", "train.batch_tokens=null",
                    "train.eval_batches=2"]  # 16 of the 24 validation examples: 2 micro-batches of 8 (of 4 on 2 ranks)
        else:  # 8 pairs of 2 x 96 tokens a step: one process 2 x 4 pairs; two ranks 1 x 4 pairs each
            val = root / ("val3.jsonl" if name.startswith("val3") else "val.jsonl")
            data = [f"data.train=[{root / 'train.jsonl'}]", f"data.val=[{val}]", "train.micro_batch_size=4",
                    "train.batch_tokens=1536"]
        evaluation = ["score.name=exact_match", "score.max_examples=4", "score.max_new_tokens=4"] if stage != "reward" else []
        beta = ["objective.beta=0.5"] if stage != "reward" else []
        recipe_type = STAGES[stage][0]
        return load_config(recipe_type, None, [
            f"run_dir={root / name}", f"checkpoint={base_checkpoint}", *beta, *evaluation,
            "data.max_length=96", f"train.max_steps={STEPS}", "train.warmup_steps=1", "train.lr=3e-3",
            "train.precision=fp32", "train.eval_every=2", "train.eval_batches=null", "train.checkpoint_every=2",
            "train.tensorboard=false", "train.device=cpu", *data, *overrides])

    jobs = []
    for name, (stage, overrides) in RUNS.items():
        STAGES[stage][1](make(name, stage, *overrides))
        fsdp = [*overrides, *FSDP_ONLY.get(name, [])]
        if stage == "kto":  # the same 8 examples a step and 16 evaluated: 4 a rank, eval_batches over both ranks
            fsdp += ["train.micro_batch_size=4", "train.eval_batches=4"]
        if name in RESUMED:
            jobs.append({"kind": stage, "recipe": make(f"{name}_fsdp", stage, *fsdp, "train.stop_at_step=2")})
        jobs.append({"kind": stage, "recipe": make(f"{name}_fsdp", stage, *fsdp)})
    torchrun(2, jobs, root)
    return {name: root / name for name in [*RUNS, *(f"{n}_fsdp" for n in RUNS)]}


def column(run_dir, key):
    return [r[key] for r in read_metrics(run_dir) if key in r]


METRICS = {"dpo": ("margin", "accuracy", "kl_k1"), "kto": ("kl", "accuracy", "signed_reward"),
           "reward": ("margin", "accuracy", "reward_chosen")}


FULL = [n for n in RUNS if n not in ("val3", "bf16")]


@pytest.mark.parametrize("name", FULL)
def test_two_rank_fsdp_run_matches_one_process_step_by_step(runs, name):
    stage = RUNS[name][0]
    reference, fsdp = runs[name], runs[f"{name}_fsdp"]
    assert column(fsdp, "step") == list(range(1, STEPS + 1))
    if stage == "dpo":  # (that each stage learns is tested in one process, tests/stages/test_alignment.py)
        assert column(reference, "loss")[0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
        assert column(reference, "loss")[-1] < column(reference, "loss")[0]
    assert column(fsdp, "loss") == pytest.approx(column(reference, "loss"), rel=1e-5, abs=1e-6)
    assert column(fsdp, "grad_norm") == pytest.approx(column(reference, "grad_norm"), rel=1e-4)
    assert column(fsdp, "targets") == column(reference, "targets") == [8] * STEPS  # pairs or examples of the step
    if stage == "kto":
        assert max(column(reference, "kl")) > 0  # the baseline acts: z0 over both ranks' KL rows, not each rank's
    for metric in METRICS[stage]:
        # KTO's step-1 accuracy counts rewards r - z0 > 0 that are 0 up to the float32 rounding of
        # the reference's log-probs, which differs with each rank's batch padding: from step 2 on
        steps = slice(1 if (stage, metric) == ("kto", "accuracy") else 0, None)
        assert column(fsdp, metric)[steps] == pytest.approx(column(reference, metric)[steps], rel=1e-4, abs=1e-5), metric
    assert len(column(reference, "val_loss")) == 2
    for metric in ("val_loss", "val_accuracy", *(("val_margin",) if stage != "kto" else ("val_kl",))):
        assert column(fsdp, metric) == pytest.approx(column(reference, metric), rel=1e-5, abs=1e-5), metric


@pytest.mark.parametrize("name", FULL)
def test_two_rank_fsdp_run_writes_one_final_model_and_summary_equal_to_one_process(runs, name):
    stage = RUNS[name][0]
    reference, fsdp = runs[name], runs[f"{name}_fsdp"]
    for weights in ("model.safetensors", *(("reward_head.safetensors",) if stage == "reward" else ())):
        expected = load_file(str(reference / "final" / weights))
        got = load_file(str(fsdp / "final" / weights))
        assert_adamw_weights_match(got, expected, reference)  # LoRA merged: the base's names only
    ours, theirs = json.loads((fsdp / "summary.json").read_text()), json.loads((reference / "summary.json").read_text())
    assert ours["world_size"] == 2 and ours["lora"] is ("lora" in name)
    if name in RESUMED:  # the second launch went on from the first one's step-2 checkpoint
        assert ours["start_step"] == 2 and not list(fsdp.glob("checkpoints.superseded-*"))
    assert (fsdp / "adapter" / "adapter_model.safetensors").is_file() is ("lora" in name)
    # reward: held-out pairs; dpo/kto: rank 0 scores the whole model (gathered after), and the validation figures
    exact = {"dpo": ("exact_match", "logp_accuracy", "val_accuracy"), "kto": ("exact_match", "logp_accuracy", "val_accuracy"),
             "reward": ("val_accuracy",)}[stage]
    close = {"dpo": ("logp_margin", "val_margin", "val_loss"), "kto": ("logp_margin", "val_loss", "val_kl"),
             "reward": ("val_margin", "val_loss")}[stage]
    for when in ("before", "after"):
        for key in exact:
            assert ours[when].get(key) == theirs[when].get(key), (when, key)  # exact_match: absent with score.name=none
        for key in close:
            assert ours[when][key] == pytest.approx(theirs[when][key], rel=1e-4, abs=1e-5), (when, key)
    if stage == "dpo":
        assert ours["before"]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    if stage == "reward":
        load_reward_model(fsdp)  # the gathered backbone and head reload as a reward model


def test_a_validation_set_smaller_than_a_global_batch_is_evaluated_whole_under_torchrun(runs):
    reference, fsdp = runs["val3"], runs["val3_fsdp"]
    assert len(column(reference, "val_loss")) == 1
    # the filler pair weighs nothing; the rewards' float32 rounding differs with each rank's padding by ~1e-6
    for metric in ("val_loss", "val_margin", "val_accuracy", "val_kl"):
        assert column(fsdp, metric) == pytest.approx(column(reference, metric), rel=1e-5, abs=1e-5), metric
    summary = json.loads((fsdp / "summary.json").read_text())
    assert summary["before"]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_a_bf16_run_under_fsdp_starts_at_ln2(runs):
    """The reference log-probs are precomputed by the sharded policy itself, so in FSDP's bf16
    parameters too the policy and its reference agree at the first step."""
    for name in ("bf16", "bf16_fsdp"):
        first = read_metrics(runs[name])[0]
        assert first["loss"] == pytest.approx(math.log(2), abs=1e-6), name
        assert first["margin"] == pytest.approx(0.0, abs=1e-6), name
