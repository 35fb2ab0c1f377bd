"""The gradient noise scale under torchrun (gloo, 2 ranks, FSDP2) against one process: the small
batch is the first micro-batch of every rank (a global batch of rows), whose gradient FSDP has
already reduced, the big batch the whole step; both match one process whose micro-batches hold
the same rows."""

from __future__ import annotations

import pytest

from lmforge.stages.pretrain import run_pretrain
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import torchrun

NOISE = ("noise_grad_sq", "noise_trace", "noise_scale")


def test_two_ranks_measure_the_noise_scale_of_one_process(tmp_path, recipe_for):
    settings = {"train.max_steps": 4, "train.eval_every": 0, "train.batch_tokens": 512, "train.noise_scale_every": 1}
    # one process: micro-batches of 8 rows; two ranks: 4 rows each, the same 8 rows a round
    run_pretrain(recipe_for(tmp_path / "one", **settings, **{"train.micro_batch_size": 8}))
    torchrun(2, [{"kind": "pretrain", "recipe": recipe_for(tmp_path / "fsdp", **settings,
                                                          **{"parallel.dp_shard": 2})}], tmp_path)
    one, fsdp = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "fsdp")
    assert [r["targets"] for r in fsdp] == [r["targets"] for r in one]
    for key in NOISE:
        assert [r.get(key) for r in fsdp] == pytest.approx([r.get(key) for r in one], rel=1e-4), key
    assert all("noise_trace" in r for r in fsdp)
