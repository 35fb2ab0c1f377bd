"""EWC under torchrun (gloo, 2 CPU processes, FSDP2) against one process: full fine-tuning and LoRA.

The penalty of a sharded parameter is each rank's sum over its shard, all-reduced; its gradient is each
rank's own, weighted by the micro-batch's target count over both ranks, so per-step losses, penalties,
gradient norms and the final weights match the one-process run. SFT's packed rows carry different
numbers of assistant tokens on the two ranks, so a weight by a rank's own targets would not match.
One launch of two short jobs (a tiny model, 4 steps each), λ large enough that the penalty moves the run.
"""

from __future__ import annotations

import pytest

from lmforge.checkpoints.load import load_model
from lmforge.core.config import load_config
from lmforge.data.sft_demo import write_demo
from lmforge.stages.fisher import FisherRecipe, run_fisher
from lmforge.stages.sft import SFTRecipe, run_sft
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import assert_adamw_weights_match, torchrun
from tests.stages.conftest import base_checkpoint  # noqa: F401  (fixture of tests/stages)

STEPS = 4
LORA = "lora={r: 4, alpha: 8}"


@pytest.fixture(scope="module")
def ewc_runs(tmp_path_factory, base_checkpoint):  # noqa: F811
    root = tmp_path_factory.mktemp("ewc_parallel")
    data = root / "data"
    data.mkdir()
    write_demo(data, 200, seed=0, val_fraction=0.2)
    fisher = run_fisher(load_config(FisherRecipe, None, [
        f"checkpoint={base_checkpoint}", f"data.chat=[{data / 'val.jsonl'}]", "data.max_length=128", "max_tokens=400",
        f"out={root / 'fisher.safetensors'}"]))["out"]

    def make(name: str, *overrides: str) -> SFTRecipe:
        # 8 rows of 128 tokens per step: one process 2 x 4 rows; two ranks 1 x 4 rows each
        return load_config(SFTRecipe, None, [
            f"run_dir={root / name}", f"checkpoint={base_checkpoint}", f"data.train=[{data / 'train.jsonl'}]",
            "data.max_length=128", f"train.max_steps={STEPS}", "train.warmup_steps=1", "train.lr=3e-3",
            "train.micro_batch_size=4", "train.batch_tokens=1024", "train.precision=fp32", "train.eval_every=0",
            "train.checkpoint_every=4", "train.tensorboard=false", "train.device=cpu",
            f"ewc={{fisher: {fisher}, lambda_: 100000}}", *overrides])

    run_sft(make("full"))
    run_sft(make("lora", LORA))
    torchrun(2, [{"kind": "sft", "recipe": make("full_fsdp")},
                 {"kind": "sft", "recipe": make("lora_fsdp", LORA)}], root)
    return root


def column(run_dir, key):
    return [r[key] for r in read_metrics(run_dir) if key in r]


@pytest.mark.parametrize("name", ["full", "lora"])
def test_two_rank_fsdp_with_ewc_matches_one_process(ewc_runs, name):
    reference, fsdp = ewc_runs / name, ewc_runs / f"{name}_fsdp"
    penalty = column(reference, "ewc/penalty")
    assert len(penalty) == STEPS and penalty[0] == 0.0 and penalty[-1] > 2e-3 * column(reference, "loss")[-1]
    assert column(fsdp, "ewc/penalty") == pytest.approx(penalty, rel=1e-4, abs=1e-9)
    assert column(fsdp, "loss") == pytest.approx(column(reference, "loss"), rel=1e-5, abs=1e-6)
    assert column(fsdp, "grad_norm") == pytest.approx(column(reference, "grad_norm"), rel=1e-4)
    assert column(fsdp, "targets") == column(reference, "targets")
    one, _ = load_model(reference)
    two, _ = load_model(fsdp)
    assert_adamw_weights_match(two.state_dict(), one.state_dict(), reference)
