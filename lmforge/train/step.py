"""The step runner: one optimizer step over a step's micro-batches, and evaluation, chosen
once per run for the way the model is laid out.

- ``StepRunner``: one process.
- ``DataParallelStepRunner``: a rank of an FSDP / tensor-parallel run under ``torchrun``. The
  micro-batch loop is the same; counts and sums cross the data-parallel ranks, and the loss is
  scaled so that FSDP's gradient mean becomes the per-target mean of the global batch.
- ``PipelineStepRunner``: a rank of a pipeline, where ``torch.distributed.pipelining``'s
  schedule runs forward and backward of each micro-batch over the stages.

Each micro-batch's summed loss is divided by the target count of the whole step, so
accumulating k micro-batches gives the same update as one batch k times larger. A step whose
loss or gradient norm is not finite never reaches the weights (``StepResult.skipped``).
A step asked to (``measure_noise``) also reports the squared norm of its first micro-batch's
gradient beside the whole step's, for the gradient noise scale (``train.noise_scale``).

A mixture-of-experts model (``model.moe``) adds its auxiliary losses to each micro-batch's loss,
weighted by the micro-batch's share of the step's targets: the gradient is that of the
target-weighted mean over the global batch of each micro-batch's auxiliary loss (each itself a
mean over its tokens and MoE layers), so accumulation and data parallelism leave it unchanged,
and the logged ``moe/<loss>`` is that mean. The step's expert loads, summed over micro-batches
and data-parallel ranks, nudge the aux-loss-free selection bias after the optimizer step
(``model.moe.LoadTracker``) and go into the step's metrics. A model with multi-token prediction
(``model.mtp``) adds λ/D times each depth's summed loss over the step's main target count, as the
main loss is divided, and logs ``mtp/depth<k>``, depth k's mean loss per target over the step.
Evaluation adds nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from lmforge.core.config import ConfigError
from lmforge.distributed.clip import clip_grad_norm_, total_grad_norm
from lmforge.distributed.mesh import ParallelContext
from lmforge.distributed.pipeline import PipelineRunner
from lmforge.distributed.scaler import DistributedGradScaler
from lmforge.model import moe, mtp
from lmforge.objectives.base import Objective
from lmforge.train.evaluate import evaluate
from lmforge.train.forward import autocast_context, local_value, loss_context, to_device
from lmforge.train.noise_scale import NoiseSample


class StepResult(NamedTuple):
    loss: torch.Tensor  # mean loss per target over the step
    grad_norm: torch.Tensor  # before clipping
    n_targets: int
    metrics: dict[str, torch.Tensor]  # the objective's extra metrics, mean per target (and its maxima, the largest)
    skipped: bool = False  # a non-finite loss or gradient norm: the optimizer step was not taken
    noise: NoiseSample | None = None  # the small- and big-batch gradients, when the step measured them
    # seconds from the step's start to its one host sync, after the forwards, backwards and gradient
    # clipping (on a GPU the sync waits for them, so the figure is their compute, not their launch)
    backward_s: float = 0.0


def compile_objective(objective: Objective) -> Callable:
    """Forward and loss compiled as one graph: on CPU this fuses the norms, RoPE, SwiGLU and
    the fp32 cross-entropy around the matmuls. Batches keep their padded length
    (``Objective.static_shapes``), so the graph compiles once rather than once per trimmed
    length. Evaluation keeps the eager objective, so a short last validation batch costs no
    recompilation."""
    objective.static_shapes = True
    return torch.compile(objective.__call__, dynamic=False)


class StepRunner:
    """Training steps and evaluation in one process. ``precision`` fp16 brings a loss scaler;
    ``compile`` runs the objective's forward and loss as one compiled graph."""

    parallel: ParallelContext | None = None
    pipeline: PipelineRunner | None = None

    def __init__(self, model: nn.Module, objective: Objective, optimizer: torch.optim.Optimizer, precision: str,
                 grad_clip: float, compile: bool = False):
        self.model, self.objective, self.optimizer = model, objective, optimizer
        self.precision, self.grad_clip = precision, grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.run_device()
        self.scaler = self.loss_scaler() if precision == "fp16" else None
        self.forward_loss = compile_objective(objective) if compile else objective
        self.moe = moe.LoadTracker(model, self.sum_over_ranks)  # empty (false) for a model without experts

    # what differs between a process and a rank of a distributed run
    dp = 1  # data-parallel ranks the step's batch is spread over
    world_size = 1

    def run_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def loss_scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device.type)

    def total(self, n_targets: int) -> int:
        """The step's target count over every data-parallel rank, from this rank's."""
        return n_targets

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def max_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def loss_layout(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def clip_gradients(self) -> torch.Tensor:
        """Clip to ``grad_clip`` (0: no clipping); the global norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip if self.grad_clip > 0 else float("inf"))

    def gradient_norm(self) -> torch.Tensor:
        """The global norm of the gradients accumulated so far (not clipped)."""
        return torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None], 2.0, foreach=True)

    # the same for every runner
    def tokens(self, micro_batches: list) -> int:
        """Tokens the step processes over every data-parallel rank (for tokens/s and MFU)."""
        return self.dp * sum(self.objective.num_tokens(b) for b in micro_batches)

    def run_step(self, micro_batches: list, accept: Callable[[torch.Tensor], bool] | None = None,
                 measure_noise: bool = False) -> StepResult:
        """One optimizer step over ``micro_batches``. ``accept(loss)`` false (a loss spike, see
        ``train.spikes``) drops the update. ``measure_noise`` (at least two micro-batches): the
        result carries the first micro-batch's and the step's gradients (``StepResult.noise``)."""
        small: list[tuple[int, float]] = []
        began = time.perf_counter()
        loss, n_targets, metric_sums, maxima = self.backward(micro_batches, small.append if measure_noise else None)
        scaler = self.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        grad_norm = self.clip_gradients()
        # a non-finite loss or gradient norm never reaches the weights (the one host sync of the step);
        # fp16's scaler skips overflowed gradients itself and halves its scale: not counted here
        skipped = not bool(torch.isfinite(loss) & (torch.isfinite(grad_norm) | (scaler is not None)))
        backward_s = time.perf_counter() - began
        apply = not skipped and (accept is None or accept(loss))
        if scaler is not None:
            if apply:
                scaler.step(self.optimizer)  # skipped when the scaled gradients overflowed
            scaler.update()
        elif apply:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.moe:
            self.moe.finish_step(update_bias=apply)  # after the step, so the bias moves once per update
        noise = NoiseSample(small[0][0], n_targets, small[0][1], float(grad_norm) ** 2) if small else None
        metrics = {k: v / n_targets for k, v in metric_sums.items()} | maxima | self.moe.metrics()
        return StepResult(loss, grad_norm, n_targets, metrics, skipped, noise, backward_s)

    def first_batch_gradient(self, first_batch, n_targets: int) -> tuple[int, float]:
        """After the first micro-batch's backward: its target count over every data-parallel rank
        and the squared norm of its mean gradient per target. The gradients hold its summed loss
        over the step's ``n_targets`` (FSDP's mean over ranks already scaled to a sum), times the
        fp16 loss scale."""
        n_first = self.total(self.objective.num_targets(first_batch))
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        norm = float(self.gradient_norm()) / scale
        return n_first, (norm * n_targets / n_first) ** 2

    def backward(self, micro_batches: list, first_gradient: Callable[[tuple[int, float]], None] | None = None
                 ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Forward and backward of the step's micro-batches: the mean loss per target of the
        global batch, its target count, the objective's metric sums and its maxima (on every rank).
        ``first_gradient`` receives the first micro-batch's ``first_batch_gradient``."""
        n_targets = self.total(sum(self.objective.num_targets(b) for b in micro_batches))
        loss_total = torch.zeros((), device=self.device)
        metric_sums: dict[str, torch.Tensor] = {}
        maxima: dict[str, torch.Tensor] = {}
        depth_sums: list[list[torch.Tensor]] = []  # per MTP depth: its summed loss and targets over the step
        for i, batch in enumerate(micro_batches):
            if self.moe:
                moe.clear(self.model)
            mtp.clear(self.model)
            with self.loss_layout():
                with autocast_context(self.device, self.precision):
                    out = self.forward_loss(self.model, to_device(batch, self.device))
                loss = out.loss_sum / n_targets
                aux = moe.aux_losses(self.model) if self.moe else {}
                share = self.objective.num_targets(batch) / n_targets  # this micro-batch's share of the step's targets
                total = loss + sum(aux.values()) * share if aux else loss
                depths = mtp.recorded_losses(self.model)
                if depths:  # λ/D · Σ_k (depth k's summed loss) / the step's main targets, as the main loss
                    total = total + mtp.mtp_modules(self.model).loss_weight / len(depths) * sum(s for s, _ in depths) / n_targets
                    depth_sums = [[a + s.detach().float(), b + c] for (a, b), (s, c) in
                                  zip(depth_sums or [[0.0, 0] for _ in depths], depths)]
                scaled = total * self.dp  # FSDP averages gradients over the data-parallel ranks: a sum
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            loss_total += local_value(loss.detach()).float()
            for name, value in aux.items():  # summed per target, as the objective's metrics (run_step divides)
                value = value.detach().float() * (share * n_targets)
                metric_sums[f"moe/{name}"] = metric_sums.get(f"moe/{name}", 0.0) + value
            if self.moe:
                self.moe.add()
            for name, value in out.metrics.items():
                metric_sums[name] = metric_sums.get(name, 0.0) + local_value(value.detach()).float()
            for name, value in out.maxima.items():
                value = local_value(value.detach()).float()
                maxima[name] = torch.maximum(maxima[name], value) if name in maxima else value
            if first_gradient is not None and i == 0:
                first_gradient(self.first_batch_gradient(batch, n_targets))
        metric_sums = {k: self.sum_over_ranks(v) for k, v in metric_sums.items()}
        for depth, (loss_sum, count) in enumerate(depth_sums, start=1):  # logged as each depth's mean per target
            loss_sum, count = self.sum_over_ranks(loss_sum), self.sum_over_ranks(count.float())
            metric_sums[f"mtp/depth{depth}"] = loss_sum / count.clamp(min=1) * n_targets  # run_step divides by n_targets
        return (self.sum_over_ranks(loss_total), n_targets, metric_sums, {k: self.max_over_ranks(v) for k, v in maxima.items()})

    def evaluate(self, batches: Iterator, max_batches: int | None) -> dict:
        """``train.evaluate.evaluate`` of the eager objective, on this runner's layout."""
        return evaluate(self.model, self.objective, batches, self.device, self.precision, max_batches, self.parallel,
                        self.pipeline)


class DataParallelStepRunner(StepRunner):
    """A rank of an FSDP / tensor-parallel run: the model is already parallelized (its blocks
    compiled there when ``train.compile``), each rank draws its own micro-batches."""

    def __init__(self, model: nn.Module, objective: Objective, optimizer: torch.optim.Optimizer, precision: str,
                 grad_clip: float, parallel: ParallelContext):
        self.parallel = parallel
        self.dp, self.world_size = parallel.layout.dp, parallel.layout.world_size
        super().__init__(model, objective, optimizer, precision, grad_clip)

    def run_device(self) -> torch.device:
        return self.parallel.device

    def loss_scaler(self) -> torch.amp.GradScaler:
        return DistributedGradScaler(self.device)  # one overflow verdict for every rank

    def total(self, n_targets: int) -> int:
        count = torch.tensor(float(n_targets), dtype=torch.float64, device=self.device)
        return int(self.parallel.all_reduce_dp(count).item())

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce_dp(value)

    def max_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.parallel.dp_flat.get_group())
        return value

    def loss_layout(self) -> contextlib.AbstractContextManager:
        return loss_context(self.parallel)

    def clip_gradients(self) -> torch.Tensor:
        return clip_grad_norm_(self.params, self.grad_clip, self.parallel)

    def gradient_norm(self) -> torch.Tensor:
        return total_grad_norm([p.grad for p in self.params if p.grad is not None], self.parallel)


class PipelineStepRunner(DataParallelStepRunner):
    """A pipeline rank: ``pipeline`` (this rank's stage and schedule) owns the micro-batches of
    each loop micro-batch and runs their forward and backward over the stages."""

    def __init__(self, model: nn.Module, objective: Objective, optimizer: torch.optim.Optimizer, precision: str,
                 grad_clip: float, parallel: ParallelContext, pipeline: PipelineRunner):
        self.pipeline = pipeline
        super().__init__(model, objective, optimizer, precision, grad_clip, parallel)
        balanced = [m for m in self.moe.layers if m.cfg.aux_loss_coef or m.cfg.seq_aux_loss_coef or m.cfg.z_loss_coef
                    or m.cfg.bias_update_rate]
        if balanced:
            raise ConfigError("pipeline parallelism does not support model.moe's balancing (aux_loss_coef, "
                              "seq_aux_loss_coef, z_loss_coef, bias_update_rate): the schedule runs each stage's "
                              "backward without the step runner's auxiliary losses; set them to 0 or parallel.pp = 1")

    def backward(self, micro_batches: list, first_gradient: Callable[[tuple[int, float]], None] | None = None
                 ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        n_targets = self.total(sum(self.objective.num_targets(b) for b in micro_batches))
        loss_total = torch.zeros((), device=self.device)
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0  # a host sync: once a step
        for i, batch in enumerate(micro_batches):
            with autocast_context(self.device, self.precision):
                loss_total += self.pipeline.train_batch(batch, divisor=n_targets / self.dp, scale=scale) / self.dp
            if first_gradient is not None and i == 0:
                first_gradient(self.first_batch_gradient(batch, n_targets))
        self.parallel.all_reduce_pp(loss_total)  # a pipeline's loss is known on its last stage
        return self.sum_over_ranks(loss_total), n_targets, {}, {}


def build_step_runner(model: nn.Module, objective: Objective, optimizer: torch.optim.Optimizer, precision: str,
                      grad_clip: float, compile: bool = False, parallel: ParallelContext | None = None,
                      pipeline: PipelineRunner | None = None) -> StepRunner:
    """The runner for this process: a pipeline rank, a data-parallel rank, or one process
    (where ``compile`` compiles the objective; a distributed run compiles its blocks in
    ``parallelize_model``)."""
    if pipeline is not None:
        return PipelineStepRunner(model, objective, optimizer, precision, grad_clip, parallel, pipeline)
    if parallel is not None:
        return DataParallelStepRunner(model, objective, optimizer, precision, grad_clip, parallel)
    return StepRunner(model, objective, optimizer, precision, grad_clip, compile)
