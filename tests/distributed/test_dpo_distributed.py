"""`lmforge dpo` under torchrun (gloo, 2 CPU processes, FSDP2) against one process on the same data
and global batch: full fine-tuning with precomputed reference log-probs (each rank scores its
share) and with a live frozen reference (sharded as the policy), LoRA with the adapters-disabled
reference, and a validation set that is no whole global batch. Per-step losses, gradient norms,
validation figures and the final model match.

One launch of four short jobs (a tiny model, 4 steps each).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from lmforge.core.config import load_config
from lmforge.data.preference_demo import make_pairs, write_jsonl
from lmforge.data.sft_demo import make_examples
from lmforge.stages.dpo import DPORecipe, run_dpo
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import torchrun
from tests.stages.conftest import base_checkpoint  # noqa: F401  (fixture of tests/stages)

STEPS = 4
RUNS = {
    "precomputed": [],
    "live": ["precompute_reference=false"],  # a frozen copy of the policy: sharded under torchrun
    "lora": ["lora={r: 4, alpha: 8}", "precompute_reference=false"],  # the policy with adapters disabled
    "val3": ["train.max_steps=2", "eval.exact_match=false"],  # 3 validation pairs: padded with target-free pairs
}


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory, base_checkpoint):  # noqa: F811
    """Run directories by name: single-process references and the 2-rank FSDP runs (``<name>_fsdp``)."""
    root = tmp_path_factory.mktemp("dpo_parallel")
    pairs = make_pairs(make_examples(36, seed=3))
    write_jsonl(root / "train.jsonl", pairs[:24])
    write_jsonl(root / "val.jsonl", pairs[24:32])  # 8 pairs: one global batch of 2 ranks x 4
    write_jsonl(root / "val3.jsonl", pairs[32:35])

    def make(name: str, *overrides: str) -> DPORecipe:
        # 8 pairs of 2 x 96 tokens per step: one process 2 x 4 pairs; two ranks 1 x 4 pairs each
        return load_config(DPORecipe, None, [
            f"run_dir={root / name}", f"checkpoint={base_checkpoint}", "beta=0.5",
            f"data.train=[{root / 'train.jsonl'}]", f"data.val=[{root / ('val3' if 'val3' in name else 'val')}.jsonl]",
            "data.max_length=96", f"train.max_steps={STEPS}", "train.warmup_steps=1", "train.lr=3e-3",
            "train.micro_batch_size=4", "train.batch_tokens=1536", "train.precision=fp32", "train.eval_every=2",
            "train.eval_batches=null", "train.checkpoint_every=2", "train.tensorboard=false", "train.device=cpu",
            "eval.max_examples=4", "eval.max_new_tokens=4", *overrides])

    for name, overrides in RUNS.items():
        run_dpo(make(name, *overrides))
    torchrun(2, [{"kind": "dpo", "recipe": make(f"{name}_fsdp", *overrides)} for name, overrides in RUNS.items()], root)
    return {name: root / name for name in [*RUNS, *(f"{n}_fsdp" for n in RUNS)]}


def column(run_dir, key):
    return [r[key] for r in read_metrics(run_dir) if key in r]


@pytest.mark.parametrize("name", ["precomputed", "live", "lora"])
def test_two_rank_fsdp_dpo_matches_one_process_step_by_step(dpo_runs, name):
    reference, fsdp = dpo_runs[name], dpo_runs[f"{name}_fsdp"]
    assert column(fsdp, "step") == list(range(1, STEPS + 1))
    assert column(reference, "loss")[0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    assert column(reference, "loss")[-1] < column(reference, "loss")[0]
    assert column(fsdp, "loss") == pytest.approx(column(reference, "loss"), rel=1e-5, abs=1e-6)
    assert column(fsdp, "grad_norm") == pytest.approx(column(reference, "grad_norm"), rel=1e-4)
    assert column(fsdp, "targets") == column(reference, "targets") == [8] * STEPS  # pairs of the global batch
    for metric in ("margin", "accuracy", "kl"):
        assert column(fsdp, metric) == pytest.approx(column(reference, metric), rel=1e-4, abs=1e-5), metric
    assert len(column(reference, "val_loss")) == 2
    for metric in ("val_loss", "val_margin", "val_accuracy"):
        assert column(fsdp, metric) == pytest.approx(column(reference, metric), rel=1e-5, abs=1e-5), metric


@pytest.mark.parametrize("name", ["precomputed", "live", "lora"])
def test_two_rank_fsdp_dpo_writes_one_final_model_and_summary_equal_to_one_process(dpo_runs, name):
    reference, fsdp = dpo_runs[name], dpo_runs[f"{name}_fsdp"]
    expected = load_file(str(reference / "final" / "model.safetensors"))
    got = load_file(str(fsdp / "final" / "model.safetensors"))
    assert got.keys() == expected.keys()  # LoRA merged: the base's names only
    for key, value in expected.items():
        assert torch.allclose(got[key], value, rtol=0, atol=2e-5), key
    ours, theirs = json.loads((fsdp / "summary.json").read_text()), json.loads((reference / "summary.json").read_text())
    assert ours["world_size"] == 2 and ours["lora"] is (name == "lora")
    for when in ("before", "after"):  # rank 0 scores the whole model: before training, and gathered after
        assert ours[when]["exact_match"] == theirs[when]["exact_match"]
        assert ours[when]["logp_accuracy"] == theirs[when]["logp_accuracy"]
        assert ours[when]["logp_margin"] == pytest.approx(theirs[when]["logp_margin"], rel=1e-4, abs=1e-4)
        assert ours[when]["val_margin"] == pytest.approx(theirs[when]["val_margin"], rel=1e-5, abs=1e-5)
    assert ours["before"]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert (fsdp / "adapter" / "adapter_model.safetensors").is_file() is (name == "lora")


def test_a_validation_set_smaller_than_a_global_batch_is_evaluated_whole_under_torchrun(dpo_runs):
    reference, fsdp = dpo_runs["val3"], dpo_runs["val3_fsdp"]
    assert len(column(reference, "val_loss")) == 1
    # the filler pair weighs nothing; the rewards' float32 rounding differs with each rank's padding by ~1e-6
    for metric in ("val_loss", "val_margin", "val_accuracy", "val_kl"):
        assert column(fsdp, metric) == pytest.approx(column(reference, metric), rel=1e-5, abs=1e-5), metric
    summary = json.loads((fsdp / "summary.json").read_text())
    assert summary["before"]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
