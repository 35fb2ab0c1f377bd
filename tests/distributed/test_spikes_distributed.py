"""Loss-spike rollback under torchrun (gloo, 2 ranks, FSDP2) against one process: a batch corrupted
at step 14 spikes on every rank alike (the loss is all-reduced), rank 0 picks the checkpoint
before it, every rank restores its shards and skips the same global samples, and the run ends
as the single-process rollback does."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from lmforge.data.loader import TokenLoader
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import assert_adamw_weights_match, torchrun
from tests.train.test_spikes import SPIKES, poisoned_next

STEPS, SPIKE_STEP, SAMPLES_PER_STEP = 20, 14, 8
POISON = [((SPIKE_STEP - 1) * SAMPLES_PER_STEP, SPIKE_STEP * SAMPLES_PER_STEP)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, recipe_for):
    root = tmp_path_factory.mktemp("spikes")
    settings = {"train.max_steps": STEPS, "train.warmup_steps": 2, "train.checkpoint_every": 4, "train.eval_every": 0,
                "train.spikes.policy": "rollback", **SPIKES}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TokenLoader, "__next__", poisoned_next(POISON))
        run_pretrain(recipe_for(root / "one", **settings))
    torchrun(2, [{"kind": "pretrain", "recipe": recipe_for(root / "fsdp", **settings, **{"parallel.dp_shard": 2}),
                  "poison": POISON}], root)
    return root / "one", root / "fsdp"


def test_a_two_rank_rollback_skips_the_same_samples_and_ends_as_one_process(runs):
    one, fsdp = runs
    [expected], [got] = read_metrics(one, events=True), read_metrics(fsdp, events=True)
    assert (got["step"], got["action"], got["rollback_to"]) == (SPIKE_STEP, "rolled_back", 12)
    assert got["skipped_samples"] == expected["skipped_samples"] == [96, 112]
    steps = [r["step"] for r in read_metrics(fsdp)]
    assert steps == list(range(1, STEPS + 1))  # the rolled-back steps are logged once, after the rollback
    losses = [r["loss"] for r in read_metrics(fsdp)]
    assert losses == pytest.approx([r["loss"] for r in read_metrics(one)], rel=1e-5, abs=1e-6)
    final = f"checkpoints/step_{STEPS:08d}/model.safetensors"
    assert_adamw_weights_match(load_file(str(fsdp / final)), load_file(str(one / final)), one)
