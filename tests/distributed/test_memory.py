"""The memory planner against measured peaks of small models on CPU and against the published
arithmetic for Llama 3 405B on 16,384 GPUs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lmforge.cli.main import main
from lmforge.core.config import load_config
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.memory import plan_memory
from lmforge.distributed.mesh import Layout
from lmforge.distributed.parallelize import apply_activation_checkpointing
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.clm import CausalLMObjective
from lmforge.stages.plan import PlanRecipe, memory_plans
from lmforge.train.optim import build_adamw
from lmforge.train.step import StepRunner

LLAMA3_405B = "recipes/distributed/llama3_405b.yaml"


def measured_peak(cfg: ModelConfig, batch: int, seq: int, precision: str, checkpointing: bool) -> dict[str, int]:
    """Peak bytes by kind (PARAM, GRAD, OPT, ACT, TEMP, Total) over one training step, after a warm-up step."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    if checkpointing:
        apply_activation_checkpointing(model)
    optimizer = build_adamw(model, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    runner = StepRunner(model, CausalLMObjective(), optimizer, precision, 1.0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    runner.run_step([tokens])  # creates AdamW's state
    tracker = MemTracker()
    tracker.track_external(model, optimizer, tokens)
    with tracker:
        runner.run_step([tokens])
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(kind).split(".")[-1]: value for kind, value in peak.items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_matches_measured_peak_memory_of_a_small_model(precision, checkpointing):
    cfg = ModelConfig(vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384, max_seq_len=128)
    measured = measured_peak(cfg, 4, 128, precision, checkpointing)
    plan = plan_memory(cfg, ParallelConfig(), Layout(), micro_batch_size=4, seq_len=128, precision=precision,
                       activation_checkpointing=checkpointing)
    assert plan.detail["master_weights"] == measured["PARAM"] == 4 * cfg.num_params()
    assert plan.optimizer == pytest.approx(measured["OPT"], rel=1e-3)  # plus AdamW's step counters
    assert plan.gradients == 4 * cfg.num_params()
    # the tracker counts autocast's weight casts as activations; the plan counts them with the parameters
    planned = plan.activations + plan.detail["compute_copies"]
    assert planned == pytest.approx(measured["ACT"] + measured["TEMP"], rel=0.2)
    # gradients counted beside activations: an upper bound, but not a loose one
    assert measured["Total"] <= plan.total <= 1.3 * measured["Total"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "lamb"])
def test_planned_optimizer_state_is_what_each_optimizer_allocates(optimizer):
    from lmforge.train.loop import TrainConfig
    from lmforge.train.optim import build_optimizer

    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, ffn_hidden=192, max_seq_len=64)
    model = Transformer(cfg)
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the state
    allocated = sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor) and t.numel() > 1)  # moments and momenta, not step counters
    plan = plan_memory(cfg, ParallelConfig(), Layout(), micro_batch_size=1, seq_len=64, precision="fp32",
                       activation_checkpointing=False, optimizer=optimizer)
    assert plan.optimizer == allocated
    if optimizer == "muon":  # one buffer, not two, for each weight of the blocks' matrices
        assert allocated == 8 * cfg.num_params() - 4 * sum(layer.matmul for layer in cfg.param_counts().layers)


def test_activation_checkpointing_plan_is_much_smaller_and_so_is_the_measurement():
    cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=6, n_heads=4, ffn_hidden=384, max_seq_len=256)
    plans = [plan_memory(cfg, ParallelConfig(), Layout(), micro_batch_size=4, seq_len=256, precision="fp32",
                         activation_checkpointing=ac) for ac in (False, True)]
    peaks = [measured_peak(cfg, 4, 256, "fp32", ac) for ac in (False, True)]
    planned_ratio = plans[1].activations / plans[0].activations
    measured_ratio = (peaks[1]["ACT"] + peaks[1]["TEMP"]) / (peaks[0]["ACT"] + peaks[0]["TEMP"])
    assert planned_ratio < 0.5 and planned_ratio == pytest.approx(measured_ratio, rel=0.2)


def test_llama3_405b_with_tp8_pp16_dp128_needs_about_6_2_gb_of_bf16_weights_per_device():
    recipe = load_config(PlanRecipe, LLAMA3_405B)
    layout, plans = memory_plans(recipe)
    assert "16384 devices" in layout
    plan = plans[False]
    assert plan.weights_compute / 1e9 == pytest.approx(6.2, rel=0.05)
    # the arithmetic: a middle stage's 8 layers, split 8 ways by tensor parallelism, 2 bytes each
    per_layer = 2 * 16384 * 128 * 128 + 2 * 16384 * 8 * 128 + 3 * 16384 * 53248
    assert plan.weights_compute == 2 * (8 * per_layer // 8 + 8 * 2 * 16384)
    # averaged over all devices: the whole model in bf16 over tp x pp
    assert recipe.model.num_params() * 2 / 128 / 1e9 == pytest.approx(6.34, abs=0.01)
    # ZeRO-3 (the default) would gather only two blocks at a time
    zero3 = dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, reshard_after_forward=True))
    assert memory_plans(zero3)[1][False].weights_compute < plan.weights_compute / 3


def test_sharding_divides_what_it_shards():
    cfg = ModelConfig.from_preset("llama3-1b", tie_embeddings=False)
    base = dict(micro_batch_size=4, seq_len=2048, precision="bf16", activation_checkpointing=False)
    single = plan_memory(cfg, ParallelConfig(), Layout(), **base)
    fsdp = plan_memory(cfg, ParallelConfig(dp_shard=8), Layout(dp_shard=8), **base)
    assert fsdp.optimizer == single.optimizer // 8 and fsdp.detail["master_weights"] == single.detail["master_weights"] // 8
    assert fsdp.activations < single.activations  # bf16 residual stream under FSDP's bf16 weights
    tp = plan_memory(cfg, ParallelConfig(tp=4), Layout(tp=4), **base)
    sp = plan_memory(cfg, ParallelConfig(tp=4, sequence_parallel=True), Layout(tp=4), **base)
    assert tp.params_on_device < single.params_on_device / 3.5
    assert sp.activations < tp.activations < single.activations


def test_plan_memory_cli_prints_every_kind_with_and_without_checkpointing(capsys):
    assert main(["plan", "memory", LLAMA3_405B]) == 0
    out = capsys.readouterr().out
    for row in ("parameters", "gradients", "optimizer state", "activations", "total"):
        assert row in out
    assert "no checkpointing" in out and "activation ckpt" in out and "6.38 GB" in out
    assert out.startswith("memory per device: 406B parameters,")
    assert main(["plan", "memory", "recipes/demo/pretrain.yaml"]) == 0
    assert capsys.readouterr().out.startswith("memory per device: 9.31M parameters,")  # not 0.00931B


def test_a_step_larger_than_the_device_is_refused_naming_the_batch_and_the_estimate(monkeypatch):
    import lmforge.distributed.memory as memory
    from lmforge.core.config import ConfigError

    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=128)
    args = dict(micro_batch_size=8, seq_len=128, precision="fp32", activation_checkpointing=False)
    plan = plan_memory(cfg, ParallelConfig(), Layout(), **args)
    need = plan.parameters + plan.optimizer + max(plan.gradients, plan.activations)
    monkeypatch.setattr(memory, "available_bytes", lambda device: (need, "of RAM"))
    assert memory.check_memory_fits(cfg, ParallelConfig(), Layout(), torch.device("cpu"), **args) == need
    monkeypatch.setattr(memory, "available_bytes", lambda device: (need - 1, "of RAM"))
    with pytest.raises(ConfigError, match=r"^train\.micro_batch_size = 8 x data\.seq_len = 128 needs at least "
                                          r"[\d.]+ [KMG]?B per device \(weights \+ optimizer .*, activations .*\), "
                                          r"more than the [\d.]+ [KMG]?B of RAM: lower train\.micro_batch_size"):
        memory.check_memory_fits(cfg, ParallelConfig(), Layout(), torch.device("cpu"), **args)


def test_adapter_training_is_refused_only_for_its_activations(monkeypatch):
    import lmforge.distributed.memory as memory

    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=128)
    args = dict(micro_batch_size=8, seq_len=128, precision="fp32", activation_checkpointing=False)
    plan = plan_memory(cfg, ParallelConfig(), Layout(), **args)
    monkeypatch.setattr(memory, "available_bytes", lambda device: (plan.activations, "of RAM"))
    assert memory.check_memory_fits(cfg, ParallelConfig(), Layout(), torch.device("cpu"), adapters_only=True,
                                    **args) == plan.activations


def test_this_machines_memory_is_known_and_a_demo_step_fits_in_it():
    from lmforge.distributed.memory import available_bytes, check_memory_fits

    available, what = available_bytes(torch.device("cpu"))
    assert available > 2**28 and what == "of RAM"
    cfg = ModelConfig.from_preset("tiny")
    assert check_memory_fits(cfg, ParallelConfig(), Layout(), torch.device("cpu"), micro_batch_size=8, seq_len=256,
                             precision="auto", activation_checkpointing=False) < available
