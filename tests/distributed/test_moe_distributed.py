"""A mixture-of-experts model trains under torchrun (FSDP2, 2 gloo ranks) as in one process: the auxiliary
losses weighted by each micro-batch's targets, the expert loads summed over the ranks before the
aux-loss-free bias moves, so losses, gradient norms, expert loads and the final weights and biases agree; with a
multi-token prediction module (model.mtp, its block routed too), whose loss agrees as well.

The tiny recipe's step is 8 windows: one process takes them as two micro-batches of 4, each rank of two as
one micro-batch of 4 (the same rows, ``data.loader``), so every auxiliary loss is computed over the same
tokens. The runs differ in the order of sums (gloo's all-reduce): rel 1e-5 on the curves (test_families_distributed's
bound), and the loads, whole numbers, equal."""

from __future__ import annotations

import pytest
import torch

from lmforge.checkpoints.load import load_model
from lmforge.core.config import load_config
from lmforge.model.moe import moe_layers
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import torchrun
from tests.train.conftest import shards_dir, tiny_pretrain_overrides  # noqa: F401  (shards_dir: a fixture)

MOE = {"model.family": "mixtral", "model.moe.n_experts": 4, "model.moe.n_experts_per_token": 2,
       "model.moe.aux_loss_coef": 0.1, "model.moe.seq_aux_loss_coef": 0.05, "model.moe.z_loss_coef": 0.01,
       "model.moe.bias_update_rate": 0.01, "model.mtp.depth": 1, "train.lr": 1e-2}


def test_fsdp_of_an_moe_model_trains_as_one_process(tmp_path, shards_dir, small_tokenizer_dir):  # noqa: F811
    def recipe(name: str, **overrides) -> PretrainRecipe:
        keys = {**MOE, "train.max_steps": 3, "train.eval_every": 0, "train.checkpoint_every": 3, **overrides}
        return load_config(PretrainRecipe, None, tiny_pretrain_overrides(tmp_path / name, shards_dir,
                                                                         small_tokenizer_dir, **keys))

    def curve(name: str) -> list[float]:
        return [r[k] for r in read_metrics(tmp_path / name) if "loss" in r
                for k in ("loss", "grad_norm", "moe/load_balance", "moe/seq_balance", "moe/z_loss", "mtp/depth1")]

    def loads(name: str) -> list[float]:
        return [r[k] for r in read_metrics(tmp_path / name) if "loss" in r for k in sorted(r)
                if k.startswith("moe/layer")]

    run_pretrain(recipe("reference"))
    torchrun(2, [{"kind": "pretrain", "recipe": recipe("fsdp", **{"parallel.dp_shard": 2})}], tmp_path)
    assert len(curve("reference")) == 18
    assert curve("fsdp") == pytest.approx(curve("reference"), rel=1e-5)
    assert loads("fsdp") == pytest.approx(loads("reference"), abs=1e-6)
    one, _ = load_model(tmp_path / "reference")
    two, _ = load_model(tmp_path / "fsdp")
    biases = [(a.router.expert_bias, b.router.expert_bias) for a, b in zip(moe_layers(one), moe_layers(two))]
    assert biases and all(torch.equal(a, b) for a, b in biases) and any(a.abs().sum() > 0 for a, _ in biases)
    for name, value in one.state_dict().items():
        torch.testing.assert_close(two.state_dict()[name], value, rtol=1e-4, atol=1e-5)
