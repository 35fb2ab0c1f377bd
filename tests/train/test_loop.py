import copy
import dataclasses
import json
import logging
import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.clm import CausalLMObjective, LossOutput, causal_lm_loss
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.loop import TrainConfig, evaluate, train
from lmforge.train.metrics import read_metrics, store_peak
from lmforge.train.optim import build_adamw


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)]


def test_stopping_and_resuming_gives_the_same_losses_as_an_uninterrupted_run(make_recipe, tmp_path):
    full = make_recipe(tmp_path / "full", **{"train.max_steps": 8})
    run_pretrain(full)
    half = make_recipe(tmp_path / "half", **{"train.max_steps": 8, "train.stop_at_step": 4})  # killed at step 4
    stopped = run_pretrain(half)
    assert stopped["step"] == 4
    resumed = make_recipe(tmp_path / "half", **{"train.max_steps": 8, "train.resume": "auto"})
    summary = run_pretrain(resumed)
    assert summary["start_step"] == 4
    assert losses(tmp_path / "half") == losses(tmp_path / "full")  # bit-identical, step by step
    assert len(losses(tmp_path / "full")) == 8


def test_checkpoints_are_complete_checksummed_and_pruned(make_recipe, tmp_path):
    run_pretrain(make_recipe(**{"train.max_steps": 12, "train.keep_checkpoints": 2}))
    ckpts = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step_00000008", "step_00000012"]
    files = {p.name for p in ckpts[-1].iterdir()}
    assert {"model.safetensors", "model.json", "optimizer.pt", "rng.pt", "trainer_state.json", "config.yaml",
            "tokenizer.json", "tokenizer_config.json", "checksums.json"} <= files
    state = json.loads((ckpts[-1] / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["loader"]["samples"] == 12 * 2 * 4
    assert not list((tmp_path / "run" / "checkpoints").glob(".*"))  # no temporary directories left


def test_resume_skips_a_corrupt_checkpoint_and_uses_the_previous_one(make_recipe, tmp_path):
    run_pretrain(make_recipe(**{"train.max_steps": 8}))
    newest = tmp_path / "run" / "checkpoints" / "step_00000008" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-64])  # truncated
    summary = run_pretrain(make_recipe(**{"train.max_steps": 8}))
    assert summary["start_step"] == 4 and summary["step"] == 8


def test_a_finished_run_is_not_trained_again(make_recipe):
    run_pretrain(make_recipe())
    again = run_pretrain(make_recipe())
    assert again["start_step"] == 8 and again["step"] == 8


def test_gradient_accumulation_equals_one_big_batch(make_recipe, tmp_path):
    # 2 micro-batches of 4 and 1 micro-batch of 8 see the same 8 windows: same update
    a = make_recipe(tmp_path / "a", **{"train.max_steps": 1, "train.warmup_steps": 0, "train.micro_batch_size": 4, "train.batch_tokens": 256})
    b = make_recipe(tmp_path / "b", **{"train.max_steps": 1, "train.warmup_steps": 0, "train.micro_batch_size": 8, "train.batch_tokens": 256})
    run_pretrain(a)
    run_pretrain(b)
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "a" / "checkpoints" / "step_00000001" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "checkpoints" / "step_00000001" / "model.safetensors"))
    assert losses(tmp_path / "a")[0] == pytest.approx(losses(tmp_path / "b")[0], rel=1e-6)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6), k


def test_metrics_record_every_step_with_the_promised_fields(make_recipe, tmp_path):
    summary = run_pretrain(make_recipe(**{"train.tensorboard": True}))
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 9))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_bytes", "tokens"):
        assert key in records[0]
    assert "val_loss" in records[3] and "val_bpb" in records[3] and "val_loss" not in records[2]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert summary["val_loss"] == records[-1]["val_loss"]
    assert summary["val_loss"] < summary["unigram_entropy"] + 1.0  # 8 steps: loss left random-init territory
    assert records[-1]["loss"] < math.log(512)


def test_learning_rate_follows_warmup_then_cosine(make_recipe, tmp_path):
    run_pretrain(make_recipe(**{"train.max_steps": 10, "train.warmup_steps": 2}))
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run")]
    # step n (1-based, as logged): warm-up 3e-3 * n / 2, then cosine over steps 3..10 to 10% on step 10
    expected = [1.5e-3, 3e-3] + [3e-4 + 0.5 * 2.7e-3 * (1 + math.cos(math.pi * (n - 2) / 8)) for n in range(3, 11)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[-1] == 3e-3 * 0.1


def test_learning_rate_follows_warmup_stable_decay_to_the_minimum_on_the_last_step(make_recipe, tmp_path):
    run_pretrain(make_recipe(**{"train.max_steps": 10, "train.warmup_steps": 2, "train.schedule": "wsd",
                                "train.decay_fraction": 0.2}))
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 11))
    # warm-up on steps 1-2, stable on 3-8, the decay's 0.2 * 10 = 2 steps (9, 10) below peak, ending at 10%
    expected = [1.5e-3, 3e-3] + [3e-3] * 6 + [3e-4 + 2.7e-3 * 1 / 2, 3e-4]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-12)
    assert records[-1]["lr"] == 3e-3 * 0.1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_train_the_model(make_recipe, tmp_path, precision):
    run_pretrain(make_recipe(**{"train.precision": precision, "train.max_steps": 4}))
    ls = losses(tmp_path / "run")
    assert all(math.isfinite(v) for v in ls) and ls[-1] < ls[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_checkpointing_and_compile_keep_the_losses(make_recipe, tmp_path, precision):
    """bf16 too: its training attention takes ``attend``'s float32 route on this CPU, recomputed by AC."""
    base = {"train.max_steps": 3, "train.precision": precision}
    run_pretrain(make_recipe(tmp_path / "plain", **base))
    run_pretrain(make_recipe(tmp_path / "ac", **base, **{"train.activation_checkpointing": True}))
    assert losses(tmp_path / "ac") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)
    run_pretrain(make_recipe(tmp_path / "compiled", **base, **{"train.compile": True}))
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "plain"), rel=1e-4)
    # parameter names are unchanged by the wrapper: the checkpoint loads into a plain model
    from lmforge.checkpoints.load import load_model

    load_model(tmp_path / "ac")


def test_non_finite_loss_steps_are_skipped_and_enough_in_a_row_stop_with_a_clear_error(tmp_path):
    class Broken(CausalLMObjective):
        def __call__(self, model, batch):
            out = super().__call__(model, batch)
            return LossOutput(out.loss_sum * float("nan"), out.n_targets)

    model = Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=16))

    class Batches:
        def __next__(self):
            return torch.randint(0, 50, (2, 9))

        def state_dict(self):
            return {}

    cfg = TrainConfig(max_steps=3, warmup_steps=0, precision="fp32", tensorboard=False, device="cpu")
    with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient norm for 3 steps in a row, each skipped "
                                                 r"\(step 3: loss nan"):
        train(model=model, objective=Broken(), train_batches=Batches(), cfg=cfg, run_dir=tmp_path, recipe=cfg)


def test_evaluation_reports_mean_loss_and_bits_per_byte():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=16))
    token_bytes = torch.arange(50) % 4 + 1
    batches = [torch.randint(0, 50, (3, 9)) for _ in range(2)]
    result = evaluate(model, CausalLMObjective(token_bytes), iter(batches), torch.device("cpu"), "fp32", None)
    with torch.no_grad():
        nll = sum(torch.nn.functional.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten(), reduction="sum")
                  for b in batches)
    n_bytes = sum(int(token_bytes[b[:, 1:]].sum()) for b in batches)
    assert result["val_loss"] == pytest.approx(nll.item() / 48, rel=1e-5)
    assert result["val_bpb"] == pytest.approx(nll.item() / (math.log(2) * n_bytes), rel=1e-5)


def test_pretraining_builds_its_validation_loader_once_per_run(make_recipe, monkeypatch):
    import lmforge.stages.pretrain as pretrain

    built = []

    class CountingLoader(pretrain.TokenLoader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(kwargs["split"])

    monkeypatch.setattr(pretrain, "TokenLoader", CountingLoader)
    summary = run_pretrain(make_recipe(**{"train.max_steps": 8, "train.eval_every": 2}))
    assert built == ["train", "val"] and "val_loss" in summary  # four evaluations, one validation loader


def test_every_evaluation_reads_the_same_validation_batches_as_a_new_loader_would(make_recipe):
    from lmforge.data.loader import TokenLoader
    from lmforge.data.shards import read_manifest
    from lmforge.stages.pretrain import build_model, validation_loader

    recipe = make_recipe()
    cpu = torch.device("cpu")
    val = validation_loader(recipe.data, read_manifest(recipe.data.datasets[0].path), 4)
    torch.manual_seed(0)
    model, objective = build_model(recipe.model, cpu), CausalLMObjective()
    first = evaluate(model, objective, val.restart(), cpu, "fp32", 2)  # stops part-way through the split
    second = evaluate(model, objective, val.restart(), cpu, "fp32", 2)
    assert first == second and first["val_loss"] > 0
    fresh = TokenLoader(dataclasses.replace(val.cfg), 4, split="val", loop=False)
    again, new = list(val.restart()), list(fresh)
    assert len(again) == len(new) > 2 and all(torch.equal(a, b) for a, b in zip(again, new))


def test_objective_metrics_are_logged_as_means_per_target_over_accumulated_micro_batches(tmp_path):
    class WithMetrics(CausalLMObjective):
        def __call__(self, model, batch):
            out = super().__call__(model, batch)
            # per target: the first token of each window, so the mean is easy to check
            out.metrics = {"first_token": batch[:, :1].float().sum() * (batch.shape[1] - 1)}
            return out

    model = Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=16))
    seen = []

    class Batches:
        def __next__(self):
            b = torch.randint(0, 50, (2, 9))
            seen.append(b)
            return b

        def state_dict(self):
            return {}

    cfg = TrainConfig(max_steps=2, warmup_steps=0, precision="fp32", tensorboard=False, device="cpu",
                      micro_batch_size=2, batch_tokens=32)
    train(model=model, objective=WithMetrics(), train_batches=Batches(), cfg=cfg, run_dir=tmp_path, recipe=cfg,
          grad_accum=2)
    records = read_metrics(tmp_path)
    for step, record in enumerate(records):
        first = torch.cat([b[:, 0] for b in seen[2 * step: 2 * step + 2]]).float().mean()
        assert record["first_token"] == pytest.approx(float(first))
    batches = [torch.randint(0, 50, (3, 9))]
    result = evaluate(model, WithMetrics(), iter(batches), torch.device("cpu"), "fp32", None)
    assert result["val_first_token"] == pytest.approx(float(batches[0][:, 0].float().mean()))


def test_train_config_defaults_are_the_issues_optimizer_settings():
    cfg = TrainConfig()
    assert (cfg.beta1, cfg.beta2) == (0.9, 0.95) and cfg.eps == 1e-8 and cfg.weight_decay == 0.1
    assert cfg.grad_clip == 1.0 and cfg.min_lr_ratio == 0.1


MARK = 49  # a batch whose first token is MARK gets an infinite gradient from OverflowingObjective


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=16))


class IndexedBatches:
    """Batch i is a fixed function of i, so a resumed run sees the same batches; the batches
    numbered in ``marked`` (0-based) start with MARK."""

    def __init__(self, marked: tuple[int, ...] = ()):
        self.i, self.marked = 0, marked

    def batch(self, i: int) -> torch.Tensor:
        b = torch.randint(0, MARK, (2, 9), generator=torch.Generator().manual_seed(i))
        if i in self.marked:
            b[0, 0] = MARK
        return b

    def __next__(self) -> torch.Tensor:
        self.i += 1
        return self.batch(self.i - 1)

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]


class ScaledObjective(CausalLMObjective):
    """The causal LM loss of step k times ``scales[k]``: gradients far above the clipping norm."""

    def __init__(self, scales: list[float]):
        super().__init__()
        self.scales = list(scales)

    def __call__(self, model, batch):
        out = super().__call__(model, batch)
        return LossOutput(out.loss_sum * self.scales.pop(0), out.n_targets)


def test_gradients_are_clipped_to_norm_one_and_the_logged_norm_is_the_one_before_clipping(tmp_path):
    model = tiny_model()
    initial = copy.deepcopy(model)
    scales = [1000.0, 3.0]  # a different clipping factor on each step: Adam's update then depends on clipping
    cfg = TrainConfig(max_steps=2, warmup_steps=0, schedule="constant", lr=1e-2, precision="fp32", tensorboard=False,
                      device="cpu")
    batches = IndexedBatches()
    train(model=model, objective=ScaledObjective(scales), train_batches=batches, cfg=cfg, run_dir=tmp_path, recipe=cfg)
    logged = [r["grad_norm"] for r in read_metrics(tmp_path)]

    def reference(max_norm: float) -> tuple[nn.Module, list[float]]:
        """Two plain AdamW steps with torch's clip_grad_norm_ at ``max_norm``."""
        ref = copy.deepcopy(initial)
        opt = build_adamw(ref, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay)
        norms = []
        for i, scale in enumerate(scales):
            b = batches.batch(i)
            loss = causal_lm_loss(ref(b[:, :-1]), b[:, 1:]) * scale / b[:, 1:].numel()
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
            opt.step()
            opt.zero_grad()
        return ref, norms

    clipped, norms = reference(1.0)
    unclipped, _ = reference(float("inf"))
    assert min(norms) > 1 and logged == pytest.approx(norms, rel=1e-5)  # both steps are clipped
    gap_to_unclipped = 0.0
    for (name, p), q, u in zip(model.named_parameters(), clipped.parameters(), unclipped.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name
        gap_to_unclipped = max(gap_to_unclipped, float((p - u).detach().abs().max()))
    assert gap_to_unclipped > 1e-3  # without clipping the parameters would visibly differ


def test_mfu_is_model_flops_per_second_over_the_cached_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LMFORGE_PEAK_FLOPS")  # the suite's fixed peaks would answer before the cache
    store_peak(torch.device("cpu"), torch.float32, 7e9)  # the peak the loop must divide by
    model = tiny_model()
    flops_per_token = model.cfg.flops_per_token(8)
    cfg = TrainConfig(max_steps=3, warmup_steps=0, precision="fp32", tensorboard=False, device="cpu")
    (tmp_path / "run").mkdir()
    summary = train(model=model, objective=CausalLMObjective(), train_batches=IndexedBatches(), cfg=cfg,
                    run_dir=tmp_path / "run", recipe=cfg, flops_per_token=flops_per_token)
    records = read_metrics(tmp_path / "run")
    assert [r["tokens"] for r in records] == [16, 32, 48]  # 2 windows of 8 targets per step
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(16 / r["step_s"], rel=1e-9)
        assert r["mfu"] == pytest.approx(flops_per_token * r["tokens_per_s"] / 7e9, rel=1e-9)
    assert summary["mfu"] == pytest.approx((records[1]["mfu"] + records[2]["mfu"]) / 2)  # the first step is warm-up


class InfiniteGradient(torch.autograd.Function):
    """Zero in the forward pass, an infinite gradient in the backward pass: an overflow on demand."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return torch.full(ctx.shape, float("inf"), dtype=grad.dtype, device=grad.device)


class OverflowingObjective(CausalLMObjective):
    """The causal LM loss; on a batch starting with MARK the embedding also gets an infinite gradient."""

    def __call__(self, model, batch):
        out = super().__call__(model, batch)
        if int(batch[0, 0]) == MARK:
            out.loss_sum = out.loss_sum + InfiniteGradient.apply(model.embed.weight)
        return out


def train_fp16(run_dir, max_steps: int = 4, **overrides) -> dict:
    """fp16 training whose step 2 overflows; a checkpoint after every step."""
    run_dir.mkdir(exist_ok=True)
    cfg = TrainConfig(max_steps=max_steps, warmup_steps=0, precision="fp16", lr=1e-2, tensorboard=False, device="cpu",
                      checkpoint_every=1, keep_checkpoints=10, **overrides)
    return train(model=tiny_model(), objective=OverflowingObjective(), train_batches=IndexedBatches(marked=(1,)),
                 cfg=cfg, run_dir=run_dir, recipe=cfg)


def after_step(run_dir, step: int) -> tuple[dict, dict]:
    """The scaler state and the weights a run's checkpoint holds after ``step``."""
    from safetensors.torch import load_file

    ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
    return json.loads((ckpt / "trainer_state.json").read_text())["scaler"], load_file(str(ckpt / "model.safetensors"))


def test_fp16_uses_dynamic_loss_scaling_and_skips_a_step_with_infinite_gradients(tmp_path):
    train_fp16(tmp_path)
    scaler1, weights1 = after_step(tmp_path, 1)
    scaler2, weights2 = after_step(tmp_path, 2)
    initial = tiny_model().state_dict()
    assert scaler1["scale"] == 2.0**16  # GradScaler's initial scale; step 1 did not overflow
    assert any(not torch.equal(weights1[k], initial[k]) for k in weights1)  # and was applied
    assert scaler2["scale"] == scaler1["scale"] / 2  # step 2 overflowed: the scale is halved...
    assert all(torch.equal(weights2[k], weights1[k]) for k in weights1)  # ...and the update skipped
    assert not math.isfinite(read_metrics(tmp_path)[1]["grad_norm"])
    assert math.isfinite(read_metrics(tmp_path)[1]["loss"])


def test_fp16_loss_scale_is_restored_exactly_on_resume(tmp_path):
    train_fp16(tmp_path / "full")
    train_fp16(tmp_path / "half", stop_at_step=3)
    train_fp16(tmp_path / "half")  # resume=auto from step 3, after the overflow halved the scale
    for step in (3, 4):
        (full_scaler, full_weights), (half_scaler, half_weights) = after_step(tmp_path / "full", step), after_step(
            tmp_path / "half", step)
        assert half_scaler == full_scaler and full_scaler["scale"] == 2.0**15
        assert all(torch.equal(half_weights[k], full_weights[k]) for k in full_weights)
    assert losses(tmp_path / "half") == losses(tmp_path / "full")


def test_mfu_above_100_percent_is_never_reported(tmp_path, monkeypatch, caplog):
    """On AMD EPYC the fp16 peak timed on torch.mm was 10x below what the model's F.linear
    layers ran at, and the loop printed MFU 1854%."""
    monkeypatch.setenv("LMFORGE_PEAK_FLOPS", "float32=1e3")  # far below any real rate
    model = tiny_model()
    cfg = TrainConfig(max_steps=3, warmup_steps=0, precision="fp32", tensorboard=False, device="cpu")
    (tmp_path / "run").mkdir()
    summary = train(model=model, objective=CausalLMObjective(), train_batches=IndexedBatches(), cfg=cfg,
                    run_dir=tmp_path / "run", recipe=cfg, flops_per_token=model.cfg.flops_per_token(8))
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert not any("mfu" in r for r in read_metrics(tmp_path / "run")) and summary["mfu"] is None
    warnings = [r.getMessage() for r in caplog.records if "MFU is not reported" in r.getMessage()]
    assert len(warnings) == 1 and "LMFORGE_PEAK_FLOPS" in warnings[0]


@pytest.fixture()
def info_log(caplog):
    with caplog.at_level(logging.INFO, logger="lmforge"):
        yield caplog


def test_every_metrics_row_carries_wall_clock_time_counted_from_each_restart(make_recipe, tmp_path):
    run_pretrain(make_recipe(**{"train.stop_at_step": 4}))
    run_pretrain(make_recipe())  # resumes at step 4
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 9))  # the resumed file is whole and in order
    times = [r["time"] for r in records]
    assert times == sorted(times) and all(r["elapsed_s"] >= 0 for r in records)
    started = [r["time"] - r["elapsed_s"] for r in records]  # when the run (re)started, per row
    assert max(started[:4]) == pytest.approx(min(started[:4]), abs=1e-3)
    assert max(started[4:]) == pytest.approx(min(started[4:]), abs=1e-3)
    assert started[4] >= times[3]  # the resumed rows count from the restart, after the first run's last row


def test_compiling_is_announced_before_the_first_step(tmp_path, monkeypatch, info_log):
    import lmforge.train.step as step

    monkeypatch.setattr(step, "compile_objective", lambda objective: objective)  # the message, not the compile
    cfg = TrainConfig(max_steps=2, warmup_steps=0, precision="fp32", tensorboard=False, device="cpu", compile=True,
                      log_every=1)
    (tmp_path / "run").mkdir()
    train(model=tiny_model(), objective=CausalLMObjective(), train_batches=IndexedBatches(), cfg=cfg,
          run_dir=tmp_path / "run", recipe=cfg)
    messages = [r.getMessage() for r in info_log.records]
    compiling = [i for i, m in enumerate(messages) if m.startswith("compiling the model (torch.compile")]
    first_step = next(i for i, m in enumerate(messages) if re.match(r"step \d+/", m))
    assert len(compiling) == 1 and compiling[0] < first_step


def test_console_lines_without_a_terminal_carry_an_eta_until_the_last(tmp_path, info_log):
    cfg = TrainConfig(max_steps=4, warmup_steps=0, precision="fp32", tensorboard=False, device="cpu", log_every=2)
    (tmp_path / "run").mkdir()
    train(model=tiny_model(), objective=CausalLMObjective(), train_batches=IndexedBatches(), cfg=cfg,
          run_dir=tmp_path / "run", recipe=cfg)
    lines = [r.getMessage() for r in info_log.records if re.match(r"step \d+/", r.getMessage())]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
    assert re.search(r" \| eta \d+s$", lines[0]) and "eta" not in lines[1]


def test_the_eta_is_the_remaining_steps_at_the_mean_time_of_the_steps_after_the_first(monkeypatch):
    import lmforge.train.step_log as step_log

    log = step_log.StepLog(None, False, False, None, max_steps=10, log_every=1, device=torch.device("cpu"),
                           precision="fp32", world_size=1, flops_per_token=None)
    log.start(0)
    clock = iter([30.0, 32.0, 40.0, 40.0])  # step 1 compiles for 30 s, steps 2 and 3 take 2 and 8 s
    monkeypatch.setattr(step_log, "time", SimpleNamespace(perf_counter=lambda: next(clock), time=lambda: 0.0))
    result = step_log.StepResult(loss=torch.tensor(1.0), grad_norm=torch.tensor(1.0), n_targets=1, metrics={})
    first = log.record(0, result, 1.0, 1e-3, 0.0, 1, 1, 0)
    assert log.eta_s(first) == pytest.approx(30.0 * 9)  # only the first step to go by
    log.record(1, result, 1.0, 1e-3, 30.0, 1, 2, 0)
    third = log.record(2, result, 1.0, 1e-3, 32.0, 1, 3, 0)
    assert log.eta_s(third) == pytest.approx(5.0 * 7)  # (40 - 30) / 2 s a step, 7 steps left


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (45.4, "45s"), (125, "2m05s"), (3720, "1h02m"),
                                               (-3, "0s")])
def test_an_eta_reads_in_seconds_minutes_or_hours(seconds, text):
    from lmforge.train.step_log import format_eta, format_step

    assert format_eta(seconds) == text
    record = {"step": 2, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0}
    assert format_step(record, 10, seconds).endswith(f"| eta {text}") and "eta" not in format_step(record, 10)


def test_auto_precision_measures_the_peaks_once_per_machine_and_later_stages_reuse_them(
        make_recipe, tmp_path, monkeypatch):
    """A one-second peak measured afresh in each stage disagreed 3x between stages on one machine;
    the first measurement now takes as long as `lmforge bench peak`'s and is cached for all."""
    from lmforge.stages import pretrain
    from lmforge.train import metrics
    from lmforge.train.loop import resolve_precision

    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LMFORGE_PEAK_FLOPS")
    timed = []

    def measure(device, dtype, n, seconds):  # a machine whose bf16 matmul runs 4x fp32
        timed.append((dtype, n, seconds))
        return {torch.float32: 1e12, torch.bfloat16: 4e12}[dtype]

    monkeypatch.setattr(metrics, "measure_matmul_peak", measure)
    first = run_pretrain(make_recipe(tmp_path / "a", **{"train.precision": "auto", "train.max_steps": 2}))
    assert timed == [(torch.float32, metrics.STABLE_SIZE, metrics.STABLE_SECONDS),
                     (torch.bfloat16, metrics.STABLE_SIZE, metrics.STABLE_SECONDS)]
    assert first["precision"] == "bf16"
    assert first["precision_reason"] == "auto: bf16 matmul 4.0x fp32 on this CPU, peak measured now and cached"
    assert json.loads((tmp_path / "cache" / "peak_flops.json").read_text())[metrics.machine_key(torch.device("cpu"))] \
        == {"float32": 1e12, "bfloat16": 4e12}
    second = run_pretrain(make_recipe(tmp_path / "b", **{"train.precision": "auto", "train.max_steps": 2}))
    assert len(timed) == 2  # nothing timed again: not by the second stage, nor for its MFU
    assert second["precision_reason"] == "auto: bf16 matmul 4.0x fp32 on this CPU, cached peak"
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["precision_reason"] == second["precision_reason"]
    lines = pretrain.report(second, tmp_path / "b", tmp_path / "loss.png")
    assert "- precision bf16 (auto: bf16 matmul 4.0x fp32 on this CPU, cached peak)" in lines
    assert resolve_precision("fp32", torch.device("cpu")) == ("fp32", "set in the recipe")
