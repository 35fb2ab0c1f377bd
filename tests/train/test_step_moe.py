"""A mixture-of-experts model on the one loop (``train.step``): its auxiliary losses reach the gradient weighted by
each micro-batch's share of the step's targets, the aux-loss-free bias moves once per optimizer step from the
step's summed loads (not in evaluation, not on a skipped step), a compiled step computes the same, and the
expert loads and losses reach metrics.jsonl and TensorBoard; the bias resumes with the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.model.families import build, model_config
from lmforge.model.moe import aux_losses, moe_layers
from lmforge.objectives.clm import CausalLMObjective
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.metrics import read_metrics
from lmforge.train.step import StepRunner

BALANCED = {"n_experts": 4, "n_experts_per_token": 2, "aux_loss_coef": 0.1, "seq_aux_loss_coef": 0.05,
            "z_loss_coef": 0.01, "bias_update_rate": 0.01}


def tiny_moe(mtp: int = 0, **moe) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = model_config(dict(family="mixtral", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_hidden=48, max_seq_len=32, moe={**BALANCED, **moe}, mtp=dict(depth=mtp)))
    return build(cfg)


def windows(rows: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (rows, 17), generator=torch.Generator().manual_seed(seed))


def runner_of(model: torch.nn.Module, compile: bool = False) -> StepRunner:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves the weights, the bias moves
    return StepRunner(model, CausalLMObjective(), optimizer, "fp32", grad_clip=0.0, compile=compile)


def test_the_auxiliary_losses_reach_the_gradient_weighted_by_each_micro_batchs_targets():
    model = tiny_moe()
    batches = [windows(3, 1), windows(1, 2)]  # 48 and 16 targets: shares 3/4 and 1/4
    runner = runner_of(model)
    runner.backward(batches)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    # by hand: Σ_i (loss_sum_i + aux_i · n_i) / N, every micro-batch's forward in training mode
    reference = tiny_moe()
    reference.load_state_dict(model.state_dict())
    reference.train()
    objective, total = CausalLMObjective(), 0.0
    n = sum(objective.num_targets(b) for b in batches)
    for batch in batches:
        out = objective(reference, batch)
        total = total + (out.loss_sum + sum(aux_losses(reference).values()) * objective.num_targets(batch)) / n
    total.backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-6, rtol=1e-5)
    assert model.layers[0].mlp.router.weight.grad.abs().sum() > 0


def test_the_bias_moves_once_per_step_by_the_sign_of_the_steps_summed_load_gap():
    model = tiny_moe()
    runner = runner_of(model)
    batches = [windows(2, 3), windows(2, 4)]
    loads = []
    original_add = runner.moe.add

    def recording_add():
        loads.append([m.last_load.clone() for m in moe_layers(model)])
        original_add()

    runner.moe.add = recording_add
    result = runner.run_step(batches)
    for i, layer in enumerate(moe_layers(model)):
        load = (loads[0][i] + loads[1][i]).float()
        torch.testing.assert_close(layer.router.expert_bias, 0.01 * torch.sign(load.mean() - load))
        share = load / load.sum()
        assert result.metrics[f"moe/layer{layer.layer}/load_max"] == pytest.approx(float(share.max()))
        assert result.metrics[f"moe/layer{layer.layer}/dropped"] == 0
    assert {"moe/load_balance", "moe/seq_balance", "moe/z_loss"} <= result.metrics.keys()

    before = [m.router.expert_bias.clone() for m in moe_layers(model)]
    runner.evaluate(iter([windows(2, 5)]), None)  # evaluation: frozen
    runner.run_step(batches, accept=lambda loss: False)  # a step not taken: no nudge
    assert all(torch.equal(b, m.router.expert_bias) for b, m in zip(before, moe_layers(model)))


def test_a_compiled_step_computes_the_eager_steps_losses_gradients_and_bias():
    # with a multi-token prediction module (model.mtp) too, whose block is routed: one compile covers both
    eager, compiled = tiny_moe(mtp=1), tiny_moe(mtp=1)
    batches = [windows(2, 6)]
    eager_result = runner_of(eager).run_step(batches)
    compiled_runner = runner_of(compiled, compile=True)
    compiled_result = compiled_runner.run_step(batches)
    assert float(compiled_result.loss) == pytest.approx(float(eager_result.loss), abs=1e-5)
    for key in ("moe/load_balance", "moe/seq_balance", "moe/z_loss", "mtp/depth1"):
        assert float(compiled_result.metrics[key]) == pytest.approx(float(eager_result.metrics[key]), abs=1e-6)
    for a, b in zip(moe_layers(eager), moe_layers(compiled)):
        assert torch.equal(a.router.expert_bias, b.router.expert_bias)
    assert float(compiled_result.grad_norm) == pytest.approx(float(eager_result.grad_norm), rel=1e-4)
    # other windows route otherwise: the graphs stay those compiled (the experts' loop runs eagerly)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    for seed in (7, 8):
        compiled_runner.run_step([windows(2, seed)])
    assert counters["stats"]["unique_graphs"] == graphs


def test_pretraining_an_moe_logs_its_losses_and_loads_and_resumes_its_bias(make_recipe, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    moe = {f"model.moe.{k}": v for k, v in BALANCED.items()}
    recipe = make_recipe(**{"model.family": "mixtral", "train.lr": 1e-2, "train.tensorboard": True, **moe})
    run_pretrain(recipe)
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r and "moe/layer0/entropy" in r]
    assert len(records) == 8 and records[-1]["loss"] < records[0]["loss"] - 0.2
    keys = {k for k in records[0] if k.startswith("moe/")}
    per_layer = {f"moe/layer{i}/{s}" for i in range(2) for s in ("load_min", "load_max", "entropy", "dropped")}
    assert keys == per_layer | {"moe/load_balance", "moe/seq_balance", "moe/z_loss"}
    assert all(0 <= r["moe/layer1/load_min"] <= 0.25 <= r["moe/layer1/load_max"] <= 1 for r in records)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert len(events.Scalars("moe/layer0/entropy")) == 8

    # the bias is saved with the checkpoints: a run stopped at step 4 and resumed ends where the whole one did
    whole = json.loads((tmp_path / "run" / "checkpoints" / "step_00000008" / "model.json").read_text())
    assert whole["family"] == "mixtral"
    from lmforge.checkpoints.load import load_model

    full, _ = load_model(tmp_path / "run")
    assert any(m.router.expert_bias.abs().sum() > 0 for m in moe_layers(full))
    run_pretrain(make_recipe(run_dir=tmp_path / "split", **{"model.family": "mixtral", "train.lr": 1e-2,
                                                            "train.stop_at_step": 4, **moe}))
    run_pretrain(make_recipe(run_dir=tmp_path / "split", **{"model.family": "mixtral", "train.lr": 1e-2, **moe}))
    resumed, _ = load_model(tmp_path / "split")
    for a, b in zip(moe_layers(full), moe_layers(resumed)):
        assert torch.equal(a.router.expert_bias, b.router.expert_bias)
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in full.state_dict().items())


def test_muon_orthogonalises_each_experts_matrix_on_its_own_and_mup_trains_the_experts_at_lr_over_m():
    from lmforge.train.loop import TrainConfig
    from lmforge.train.muon import NS_DTYPES, newton_schulz, update_scale
    from lmforge.train.optim import build_optimizer

    model = tiny_moe()
    optimizer = build_optimizer(model, TrainConfig(optimizer="muon", weight_decay=0.0))
    w1 = model.layers[0].mlp.experts.w1
    kinds = {id(p): g["kind"] for g in optimizer.param_groups for p in g["params"]}
    assert kinds[id(w1)] == "muon" and kinds[id(model.layers[0].mlp.router.weight)] == "muon"
    group = next(g for g in optimizer.param_groups if id(w1) in {id(p) for p in g["params"]})
    before = w1.detach().clone()
    w1.grad = torch.randn_like(w1)
    for p in model.parameters():
        if p is not w1:
            p.grad = None
    optimizer.step()
    # the first step's momentum is (1 - β) G; Nesterov's update G + β (M - G)
    beta = group["momentum"]
    update = w1.grad.lerp((1 - beta) * w1.grad, beta) if group["nesterov"] else (1 - beta) * w1.grad
    dtype = NS_DTYPES[group["ns_dtype"]]
    expected = torch.stack([b - group["lr"] * update_scale(w1.shape, group["scale"])
                            * newton_schulz(u, group["ns_steps"], group["coefficients"], dtype)
                            for b, u in zip(before, update)])
    torch.testing.assert_close(w1.detach(), expected, atol=1e-6, rtol=0)

    mup = build(model_config(dict(family="mixtral", vocab_size=64, d_model=64, n_layers=2, n_heads=4, ffn_hidden=48,
                                  max_seq_len=32, mup={"base_width": 16}, moe={"n_experts": 4, "n_experts_per_token": 2})))
    adamw = build_optimizer(mup, TrainConfig(lr=1e-2))
    rates = {id(p): g["lr"] for g in adamw.param_groups for p in g["params"]}
    assert rates[id(mup.layers[1].mlp.experts.w2)] == pytest.approx(1e-2 / 4)  # µP's hidden-matrix rate, m = 4
    assert rates[id(mup.embed.weight)] == pytest.approx(1e-2)


def test_activation_checkpointing_recomputes_the_routing_without_counting_the_load_twice():
    """The recompute in the backward runs each MoE forward again; what it records is an assignment of the same
    values, so the step's loads, auxiliary losses, gradients and bias are those of the run without checkpointing."""
    from lmforge.distributed.parallelize import apply_activation_checkpointing

    plain, checkpointed = tiny_moe(), tiny_moe()
    apply_activation_checkpointing(checkpointed)
    batches = [windows(2, 7), windows(2, 8)]
    expected, got = runner_of(plain).run_step(batches), runner_of(checkpointed).run_step(batches)
    assert got.metrics.keys() == expected.metrics.keys()
    for key, value in expected.metrics.items():
        assert float(got.metrics[key]) == pytest.approx(float(value), abs=1e-6), key
    assert float(got.grad_norm) == pytest.approx(float(expected.grad_norm), rel=1e-5)
    for a, b in zip(moe_layers(plain), moe_layers(checkpointed)):
        assert torch.equal(a.router.expert_bias, b.router.expert_bias)
