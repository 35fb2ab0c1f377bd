"""`lmforge sft` under torchrun (gloo, 2 CPU processes, FSDP2) against one process on the same data
and global batch: full fine-tuning, and LoRA stopped and resumed in the same layout. Per-step
losses, gradient norms and validation loss match; the final model is one plain checkpoint that
loads in one process and equals the single-process one.

One launch of three short jobs (a tiny model, 4 steps each).
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from lmforge.checkpoints.load import load_model
from lmforge.core.config import load_config
from lmforge.data.sft_demo import write_demo
from lmforge.stages.sft import SFTRecipe, run_sft
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import assert_adamw_weights_match, torchrun
from tests.stages.conftest import base_checkpoint  # noqa: F401  (fixture of tests/stages)

STEPS = 4
LORA = "lora={r: 4, alpha: 8}"


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, base_checkpoint):  # noqa: F811
    """Run directories by name: single-process references and the 2-rank FSDP runs."""
    root = tmp_path_factory.mktemp("sft_parallel")
    data = root / "data"
    data.mkdir()
    write_demo(data, 200, seed=0, val_fraction=0.2)

    def make(name: str, *overrides: str) -> SFTRecipe:
        # 8 rows of 128 tokens per step: one process 2 x 4 rows; two ranks 1 x 4 rows each, or 2 x 2 each
        return load_config(SFTRecipe, None, [
            f"run_dir={root / name}", f"checkpoint={base_checkpoint}",
            f"data.train=[{data / 'train.jsonl'}]", f"data.val=[{data / 'val.jsonl'}]", "data.max_length=128",
            f"train.max_steps={STEPS}", "train.warmup_steps=1", "train.lr=3e-3", "train.micro_batch_size=4",
            "train.batch_tokens=1024", "train.precision=fp32", "train.eval_every=2", "train.eval_batches=2",
            "train.checkpoint_every=2", "train.keep_checkpoints=4", "train.tensorboard=false", "train.device=cpu",
            "score.name=exact_match", "score.max_examples=4", "score.max_new_tokens=4", *overrides])

    dirs = {name: root / name for name in ("full", "lora", "full_fsdp", "lora_fsdp", "val3", "val3_fsdp")}
    # 3 validation rows: no whole global batch of 2 ranks x 4 rows; padded with target-free rows under torchrun
    (data / "val3.jsonl").write_text("".join((data / "val.jsonl").read_text().splitlines(keepends=True)[:3]))
    val3 = (f"data.val=[{data / 'val3.jsonl'}]", "data.packing=false", "train.max_steps=2", "score.name=none")
    run_sft(make("val3", *val3))
    run_sft(make("full"))
    run_sft(make("lora", LORA))
    lora_fsdp = (LORA, "train.micro_batch_size=2", "train.eval_batches=4")  # 2 micro-batches of 2 rows per rank
    torchrun(2, [
        {"kind": "sft", "recipe": make("full_fsdp")},
        {"kind": "sft", "recipe": make("val3_fsdp", *val3)},
        {"kind": "sft", "recipe": make("lora_fsdp", *lora_fsdp, "train.stop_at_step=2")},
        {"kind": "sft", "recipe": make("lora_fsdp", *lora_fsdp)},  # resumes from step 2's sharded checkpoint
    ], root)
    # one process resumes the 2-rank LoRA run's sharded step-2 checkpoint (DCP loads into any layout)
    dirs["lora_resumed_in_one_process"] = root / "lora_1p"
    run_sft(make("lora_1p", LORA, f"train.resume={root / 'lora_fsdp' / 'checkpoints' / 'step_00000002'}"))
    return dirs


def column(run_dir, key):
    return [r[key] for r in read_metrics(run_dir) if key in r]


@pytest.mark.parametrize("name", ["full", "lora"])
def test_two_rank_fsdp_sft_matches_one_process_step_by_step(sft_runs, name):
    reference, fsdp = sft_runs[name], sft_runs[f"{name}_fsdp"]
    assert column(fsdp, "step") == list(range(1, STEPS + 1))  # the LoRA run: 2 steps, stopped, 2 resumed
    assert column(reference, "loss")[-1] < column(reference, "loss")[0]
    if name == "full":
        assert max(column(reference, "grad_norm")) > 1.0  # train.grad_clip=1 acts: the sharded gradients are clipped too
    assert column(fsdp, "loss") == pytest.approx(column(reference, "loss"), rel=1e-5, abs=1e-6)
    assert column(fsdp, "grad_norm") == pytest.approx(column(reference, "grad_norm"), rel=1e-4)
    assert column(fsdp, "targets") == column(reference, "targets")  # every rank's rows counted once
    assert column(fsdp, "tokens") == column(reference, "tokens")
    assert len(column(reference, "val_loss")) == 2
    assert column(fsdp, "val_loss") == pytest.approx(column(reference, "val_loss"), rel=1e-5)


@pytest.mark.parametrize("name", ["full", "lora"])
def test_two_rank_fsdp_sft_writes_one_plain_final_model_equal_to_one_process(sft_runs, name):
    reference, fsdp = sft_runs[name], sft_runs[f"{name}_fsdp"]
    model, where = load_model(fsdp)  # resolves to final/, as generate and export do
    assert where == fsdp / "final" and (where / "model.safetensors").is_file()
    assert not (where / ".metadata").exists()
    expected, got = load_file(str(reference / "final" / "model.safetensors")), load_file(str(where / "model.safetensors"))
    assert_adamw_weights_match(got, expected, reference)  # LoRA merged: the base's names only
    summary = json.loads((fsdp / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["lora"] is (name == "lora")
    if name == "lora":  # the second launch went on from the first one's step-2 checkpoint
        assert summary["start_step"] == 2 and not list(fsdp.glob("checkpoints.superseded-*"))
    assert summary["after"]["exact_match"]["examples"] == 4
    assert summary["tokens_per_step"] == 1024
    # the training checkpoints are DCP shards of every rank, as pre-training's
    last = fsdp / "checkpoints" / f"step_{STEPS:08d}"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in last.iterdir()}


def test_two_rank_lora_sft_saves_the_peft_adapter_once(sft_runs):
    adapter = sft_runs["lora_fsdp"] / "adapter"
    expected = load_file(str(sft_runs["lora"] / "adapter" / "adapter_model.safetensors"))
    got = load_file(str(adapter / "adapter_model.safetensors"))
    assert_adamw_weights_match(got, expected, sft_runs["lora"])
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4


def test_one_process_resumes_a_two_rank_lora_checkpoint(sft_runs):
    resumed, reference = sft_runs["lora_resumed_in_one_process"], sft_runs["lora"]
    assert column(resumed, "step") == [3, 4]
    assert column(resumed, "loss") == pytest.approx(column(reference, "loss")[2:], rel=1e-5, abs=1e-6)


def test_a_validation_set_smaller_than_a_global_batch_is_evaluated_whole_under_torchrun(sft_runs):
    reference, fsdp = column(sft_runs["val3"], "val_loss"), column(sft_runs["val3_fsdp"], "val_loss")
    assert len(reference) == 1
    assert fsdp == pytest.approx(reference, rel=1e-5)
