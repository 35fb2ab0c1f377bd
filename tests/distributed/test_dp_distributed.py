"""DP-SGD under torchrun (gloo, 2 CPU ranks) against one process with the same seeds: the ranks
split each step's Poisson sample, only rank 0 adds the noise, and the clipped sums are all-reduced,
so the two take the same steps (full fine-tuning: every weight's noise). With noise added per rank the 2-rank run would carry √2 σ C of
noise; here its losses, noised gradient norms, ε and final weights are the one process's."""

from __future__ import annotations

import pytest
import torch

from lmforge.checkpoints.load import load_model
from lmforge.core.config import load_config
from lmforge.data.sft_demo import write_demo
from lmforge.stages.sft import SFTRecipe, run_sft
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import torchrun
from tests.stages.conftest import base_checkpoint  # noqa: F401  (fixture of tests/stages)


def test_two_ranks_take_the_one_process_dp_steps_with_the_noise_added_once(tmp_path, base_checkpoint):  # noqa: F811
    write_demo(tmp_path / "data", 120, seed=0, val_fraction=0.1)

    def make(name: str) -> SFTRecipe:
        return load_config(SFTRecipe, None, [
            f"run_dir={tmp_path / name}", f"checkpoint={base_checkpoint}", f"data.train=[{tmp_path / 'data' / 'train.jsonl'}]",
            f"data.val=[{tmp_path / 'data' / 'val.jsonl'}]", "data.max_length=128", "data.packing=false",
            "train.max_steps=3", "train.warmup_steps=1", "train.lr=3e-3", "train.micro_batch_size=4",
            "train.batch_tokens=1024", "train.precision=fp32", "train.eval_every=3", "train.eval_batches=2",
            "train.checkpoint_every=3", "train.tensorboard=false", "train.device=cpu", "score.name=none",
            "dp={epsilon: 4, delta: 1e-3, max_grad_norm: 0.5}"])

    one = run_sft(make("one"))
    torchrun(2, [{"kind": "sft", "recipe": make("two")}], tmp_path)
    # expected batch: 2 micro-batches of 4 rows per step in one process, 1 of 4 on each of 2 ranks
    assert one["dp"]["expected_batch"] == 8
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for key in ("loss", "grad_norm", "dp/epsilon", "dp/batch_rows", "targets"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-5), key
    assert a[-1]["val_loss"] == pytest.approx(b[-1]["val_loss"], rel=1e-5)
    # the noise (σ C / B per coordinate) dwarfs the clipped signal: counted twice, the norm would be √2 times
    single, double = load_model(tmp_path / "one")[0].state_dict(), load_model(tmp_path / "two")[0].state_dict()
    for name, value in single.items():
        torch.testing.assert_close(double[name], value, rtol=0, atol=1e-5, msg=name)
