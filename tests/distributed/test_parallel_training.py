"""FSDP, HSDP, TP, PP and FSDP x TP runs of the pretrain recipe under torchrun (gloo, CPU) against
one single-process run of the same model and data: losses, gradient norms, gradients, weights,
validation loss, and sharded checkpoints that resume in other layouts and in one process.

Two launches serve every test (2 and 4 processes); each job is a few steps of a tiny model.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lmforge.checkpoints.files import read_weights
from lmforge.checkpoints.load import load_model
from lmforge.distributed.checkpoint import read_model_state
from lmforge.stages.export import ExportRecipe, run_export
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import assert_adamw_weights_match, torchrun

STEPS = 4
TWO_RANK_RUNS = {
    "fsdp": {"parallel.dp_shard": 2},
    "replicate_zero2": {"parallel.dp_replicate": 2, "parallel.reshard_after_forward": False},
    "tp_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True, "train.activation_checkpointing": True},
    "pp_1f1b": {"parallel.pp": 2, "parallel.pp_microbatches": 2},
    "pp_gpipe": {"parallel.pp": 2, "parallel.pp_schedule": "gpipe", "parallel.pp_microbatches": 4},
}
FP16_RUNS = {  # dynamic loss scaling: one overflow verdict and one scale for all ranks (DistributedGradScaler)
    "fsdp_fp16": {"parallel.dp_shard": 2, "train.precision": "fp16"},
    "pp_fp16": {"parallel.pp": 2, "parallel.pp_microbatches": 2, "train.precision": "fp16"},
}
# Muon orthogonalises each sharded matrix whole (gathered), LAMB takes each tensor's norm over its
# shards: both against their own single-process runs (Muon's iteration in fp32, so that 1e-5 is
# many of its roundings wide)
OPTIMIZER_RUNS = {
    "muon": {"train.optimizer": "muon", "train.muon.ns_dtype": "fp32"},
    "lamb": {"train.optimizer": "lamb", "train.lr": 0.3},
}
OPTIMIZER_PARALLEL_RUNS = {
    "fsdp_muon": ("muon", {"parallel.dp_shard": 2}),
    "tp_muon": ("muon", {"parallel.tp": 2}),
    "fsdp_lamb": ("lamb", {"parallel.dp_shard": 2}),
}
FOUR_RANK_RUNS = {
    "fsdp_x_tp": {"parallel.dp_shard": 2, "parallel.tp": 2},
    "hsdp": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 2},
}
GRADIENT_CHECKS = {
    2: {"grad_fsdp": {"parallel.dp_shard": 2}, "grad_tp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
        "grad_tp_qk_norm_no_loss_parallel": {"parallel.tp": 2, "parallel.loss_parallel": False, "model.qk_norm": True},
        "grad_pp": {"parallel.pp": 2, "parallel.pp_microbatches": 2},
        "grad_fsdp_bf16": {"parallel.dp_shard": 2, "train.precision": "bf16"}},
    4: {"grad_fsdp_x_tp": {"parallel.dp_shard": 2, "parallel.tp": 2},
        "grad_pp_x_fsdp": {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.pp_microbatches": 2}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, recipe_for):
    """Run directories by name: the single-process reference and every distributed job."""
    root = tmp_path_factory.mktemp("parallel")
    dirs = {"reference": root / "reference", "reference_fp16": root / "reference_fp16"}
    run_pretrain(recipe_for(dirs["reference"]))
    run_pretrain(recipe_for(dirs["reference_fp16"], **{"train.precision": "fp16"}))
    for name, overrides in OPTIMIZER_RUNS.items():
        dirs[f"reference_{name}"] = root / f"reference_{name}"
        run_pretrain(recipe_for(dirs[f"reference_{name}"], **overrides))

    def pretrain_jobs(specs: dict) -> list[dict]:
        jobs = []
        for name, overrides in specs.items():
            dirs[name] = root / name
            jobs.append({"kind": "pretrain", "recipe": recipe_for(dirs[name], **overrides)})
        return jobs

    def gradient_jobs(specs: dict) -> list[dict]:
        jobs = []
        for name, overrides in specs.items():
            dirs[name] = root / f"{name}.json"
            jobs.append({"kind": "gradients", "recipe": recipe_for(root / name, **overrides), "out": str(dirs[name])})
        return jobs

    # the FSDP run checkpoints every step, in the background; later jobs resume from its checkpoints
    first = pretrain_jobs({"fsdp": {**TWO_RANK_RUNS["fsdp"], "parallel.async_checkpoint": True,
                                    "train.checkpoint_every": 1, "train.keep_checkpoints": STEPS}})
    fsdp_ckpts = dirs["fsdp"] / "checkpoints"
    resumes = pretrain_jobs({
        "resume_as_tp": {"parallel.tp": 2, "train.resume": str(fsdp_ckpts / "step_00000001")},
        "resume_as_pp": {"parallel.pp": 2, "train.resume": str(fsdp_ckpts / "step_00000002")},
    })
    others = pretrain_jobs({**{k: v for k, v in TWO_RANK_RUNS.items() if k != "fsdp"}, **FP16_RUNS,
                            **{k: {**OPTIMIZER_RUNS[opt], **v} for k, (opt, v) in OPTIMIZER_PARALLEL_RUNS.items()}})
    dirs["scaler"] = root / "scaler.json"
    scaler_job = {"kind": "scaler", "out": str(dirs["scaler"])}
    torchrun(2, first + resumes + others + gradient_jobs(GRADIENT_CHECKS[2]) + [scaler_job], root)
    torchrun(4, pretrain_jobs(FOUR_RANK_RUNS) + gradient_jobs(GRADIENT_CHECKS[4]), root)

    dirs["resume_in_one_process"] = root / "resume_in_one_process"
    run_pretrain(recipe_for(dirs["resume_in_one_process"], **{"train.resume": str(fsdp_ckpts / "step_00000002")}))
    return dirs


def losses(run_dir, key="loss"):
    return [r[key] for r in read_metrics(run_dir) if key in r]


@pytest.mark.parametrize("name", [*TWO_RANK_RUNS, *FOUR_RANK_RUNS])
def test_losses_and_gradient_norms_match_a_single_process_run(runs, name):
    reference = losses(runs["reference"])
    assert len(reference) == STEPS and reference[-1] < reference[0]
    assert losses(runs[name]) == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert losses(runs[name], "grad_norm") == pytest.approx(losses(runs["reference"], "grad_norm"), rel=1e-4)
    assert losses(runs[name], "val_loss") == pytest.approx(losses(runs["reference"], "val_loss"), rel=1e-5)


@pytest.mark.parametrize("name", list(FP16_RUNS))
def test_fp16_loss_scaling_matches_a_single_process_run(runs, name):
    """Before DistributedGradScaler an early pipeline stage had no loss scale (unscale_ failed) and
    the last stage's loss was never scaled. (These few steps do not overflow; the test below does.)"""
    reference = losses(runs["reference_fp16"])
    assert len(reference) == STEPS and reference[-1] < reference[0]
    assert losses(runs[name]) == pytest.approx(reference, rel=2e-3)
    assert losses(runs[name], "grad_norm") == pytest.approx(losses(runs["reference_fp16"], "grad_norm"), rel=2e-2)


@pytest.mark.parametrize("name", list(OPTIMIZER_PARALLEL_RUNS))
def test_muon_and_lamb_under_fsdp_and_tp_match_a_single_process_run(runs, name):
    reference = runs[f"reference_{OPTIMIZER_PARALLEL_RUNS[name][0]}"]
    assert len(losses(reference)) == STEPS and losses(reference)[-1] < losses(reference)[0]
    assert losses(runs[name]) == pytest.approx(losses(reference), rel=1e-5, abs=1e-6)
    assert losses(runs[name], "grad_norm") == pytest.approx(losses(reference, "grad_norm"), rel=1e-4)
    final = f"checkpoints/step_{STEPS:08d}"
    weights = load_file(str(runs[name] / final / "model.safetensors"))
    expected = load_file(str(reference / final / "model.safetensors"))
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-5, msg=key)


def test_an_overflow_on_one_rank_skips_the_step_and_halves_the_scale_on_every_rank(runs):
    """With torch.amp.GradScaler the rank without the overflow stepped and kept its scale."""
    initial = torch.amp.GradScaler("cpu").get_scale()
    for rank in json.loads(runs["scaler"].read_text()):
        skipped, taken = rank
        assert skipped == {"param": [1.0, 1.0, 1.0], "scale": initial / 2}
        assert taken["param"] == pytest.approx([0.5, 0.5, 0.5], abs=1e-6) and taken["scale"] == initial / 2


@pytest.mark.parametrize("name", [*TWO_RANK_RUNS, *FOUR_RANK_RUNS])
def test_final_weights_match_a_single_process_run(runs, name):
    final = f"checkpoints/step_{STEPS:08d}"
    reference = load_file(str(runs["reference"] / final / "model.safetensors"))
    weights = load_file(str(runs[name] / final / "model.safetensors"))  # gathered from the shards by rank 0
    assert_adamw_weights_match(weights, reference, runs["reference"])


FP32_GRADIENT_CHECKS = [k for k in [*GRADIENT_CHECKS[2], *GRADIENT_CHECKS[4]] if not k.endswith("bf16")]


@pytest.mark.parametrize("name", FP32_GRADIENT_CHECKS)
def test_gradients_match_the_unsharded_model(runs, name):
    result = json.loads(runs[name].read_text())
    assert len(result["grad_diff"]) == result["n_params"]  # every parameter was compared, on some rank
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-6)
    worst = max(result["grad_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-5, worst  # relative to the tensor's largest gradient
    assert result["compute_dtypes"] == ["torch.float32"]


def test_fsdp_mixed_precision_computes_in_bf16_and_keeps_fp32_gradients(runs):
    result = json.loads(runs["grad_fsdp_bf16"].read_text())
    assert result["compute_dtypes"] == ["torch.bfloat16"]  # the weights FSDP gathers for the blocks
    assert result["grad_dtypes"] == ["torch.float32"]  # reduced in fp32 into the fp32 shards
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-2)
    worst = max(result["grad_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 0.1, worst  # bf16 rounding, against the fp32 reference


def test_data_parallel_ranks_read_disjoint_rows_and_count_all_tokens(runs):
    # the 2-rank FSDP run saw the same 8 windows per step as the single process (losses match above),
    # and logs tokens of the global batch
    records = read_metrics(runs["fsdp"])
    assert [r["tokens"] for r in records] == [256 * (i + 1) for i in range(STEPS)]
    summary = json.loads((runs["fsdp"] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens_per_step"] == 256


def test_a_two_rank_checkpoint_resumes_in_one_process_and_in_other_two_rank_layouts(runs):
    reference = losses(runs["reference"])
    assert losses(runs["resume_in_one_process"]) == pytest.approx(reference[2:], rel=1e-5)
    assert losses(runs["resume_as_pp"]) == pytest.approx(reference[2:], rel=1e-5)
    # step 1 was saved in the background while step 2 trained: it resumes exactly too
    assert losses(runs["resume_as_tp"]) == pytest.approx(reference[1:], rel=1e-5)


def test_sharded_checkpoints_hold_shards_per_rank_and_export_to_safetensors(runs, tmp_path):
    ckpts = runs["fsdp"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{i:08d}" for i in range(1, STEPS + 1)]
    early = ckpts / "step_00000001"
    files = {p.name for p in early.iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state.json", "rng.pt", "model.json",
            "checksums.json"} <= files
    assert "model.safetensors" not in files  # only the last checkpoint gathers the weights
    plain = tmp_path / "plain"
    plain.mkdir()  # a checkpoint gets the permissions of any new directory, not mkdtemp's 0700
    assert early.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    # any checkpoint loads as a model in one process, from its shards
    model, _ = load_model(early)
    sharded = read_model_state(early)
    for name, value in model.state_dict().items():
        if name in sharded:
            assert torch.equal(value, sharded[name])
    # the last one's gathered file equals its shards, and `lmforge export` reads it
    final = ckpts / f"step_{STEPS:08d}"
    gathered, from_shards = read_weights(final), read_model_state(final)
    assert all(torch.equal(gathered[k], from_shards[k]) for k in gathered)
    run_export(ExportRecipe(checkpoint=str(runs["fsdp"]), run_dir=str(tmp_path / "hf")))
    assert (tmp_path / "hf" / "model.safetensors").is_file()
