"""One parameter count: every family's ``param_counts`` equals the parameters its model holds,
and ``num_params``, the memory planner, MFU's FLOPs and ``lmforge scaling flops`` read it."""

from __future__ import annotations

import pytest
import torch

from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.memory import plan_memory
from lmforge.distributed.mesh import Layout
from lmforge.model.families import PRESETS, build, model_config
from lmforge.model.moe import moe_layers
from lmforge.scaling.counts import count_parameters, flops_per_token
from tests.model.test_parity import BASE, VARIANTS


def built_counts(cfg) -> tuple[int, int, int]:
    """(parameters, matmul weights, norm parameters per layer summed) of the model ``cfg`` builds,
    counted from its modules (each shared tensor once)."""
    with torch.device("meta"):
        model = build(cfg)
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in unique.values())
    # the weights that take part in matmuls: every nn.Linear's (the head's even when tied)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    for moe in moe_layers(model):  # a routed FFN's router, and of its experts the k a token goes through
        experts = moe.experts
        per_expert = (experts.w1.numel() + experts.w2.numel() + experts.w3.numel()) // moe.cfg.n_experts
        matmul += moe.router.weight.numel() + moe.cfg.n_experts_per_token * per_expert
    norms = sum(p.numel() for name, p in model.layers.named_parameters() if "norm" in name)
    return total, matmul, norms


CONFIGS = {f"preset:{name}": (lambda name=name: model_config({**PRESETS[name], "preset": name})) for name in PRESETS}
CONFIGS |= {f"variant:{name}": (lambda name=name: model_config({**BASE, **VARIANTS[name]})) for name in VARIANTS}


@pytest.mark.parametrize("which", list(CONFIGS))
def test_param_counts_are_the_built_models(which):
    cfg = CONFIGS[which]()
    counts = cfg.param_counts()
    total, matmul, norms = built_counts(cfg)
    assert counts.total() == cfg.num_params() == total
    assert counts.matmul == cfg.matmul_params() == matmul
    assert sum(layer.norms for layer in counts.layers) == norms
    assert cfg.num_params(include_embedding=False) == total - counts.embedding - counts.positions


@pytest.mark.parametrize("which", list(CONFIGS))
def test_the_planner_mfu_and_scaling_read_the_one_count(which):
    cfg = CONFIGS[which]()
    total = cfg.param_counts().total()
    # the memory planner on one device, no sharding: it holds every parameter
    plan = plan_memory(cfg, ParallelConfig(), Layout(), micro_batch_size=1, seq_len=8, precision="fp32",
                       activation_checkpointing=False)
    assert plan.params_on_device == total
    assert plan.optimizer == 8 * total  # AdamW's two fp32 moments
    assert count_parameters(cfg).total == total
    seq = min(cfg.max_seq_len, 64)
    assert flops_per_token(cfg, seq).dense == 6 * cfg.param_counts().matmul
    assert cfg.flops_per_token(seq) == flops_per_token(cfg, seq).total  # what MFU divides by
