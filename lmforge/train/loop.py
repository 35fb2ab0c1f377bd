"""The one training loop. Pre-training, SFT and preference training differ only by objective and data.

Each optimizer step draws ``grad_accum`` micro-batches, divides every micro-batch's summed
loss by the target-token count of the whole step (so each token weighs the same), runs
forward/backward under the configured precision, clips, steps AdamW at the scheduled
learning rate, logs metrics, and now and then evaluates and checkpoints.

Under ``torchrun`` the same loop runs on every rank with a ``ParallelContext``: the target
count and the logged loss are summed over data-parallel ranks, the loss is scaled so that
FSDP's gradient mean becomes the per-token mean of the global batch, a pipeline runs its
schedule in place of forward/backward, only rank 0 logs, and checkpoints are sharded.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from tqdm import tqdm

from lmforge.core.config import at_least, positive, seed_field, to_dict, unit_interval
from lmforge.core.io import InputError
from lmforge.core.run import log, progress_bar, record_config
from lmforge.distributed.checkpoint import is_sharded_checkpoint
from lmforge.distributed.clip import clip_grad_norm_
from lmforge.distributed.mesh import ParallelContext, data_parallel_rank
from lmforge.distributed.parallelize import reshard
from lmforge.distributed.pipeline import PipelineRunner
from lmforge.distributed.scaler import DistributedGradScaler
from lmforge.train.checkpoint import (
    PendingCheckpoint,
    ResumeState,
    checkpoint_dirs,
    commit_if_written,
    latest_valid_checkpoint,
    load_training_checkpoint,
    read_resume_state,
    remove_unfinished_checkpoints,
    save_sharded_training_checkpoint,
    save_training_checkpoint,
    set_aside_later_checkpoints,
)
from lmforge.train.metrics import PEAK_ENV, MetricsLogger, peak_flops, peak_memory_bytes, utilization
from lmforge.train.optim import build_adamw, lr_at
from lmforge.train.spikes import SpikeConfig, SpikeEvent, SpikeGuard, StepRange

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class TrainConfig:
    """Optimizer, schedule, batch, precision, evaluation and checkpointing of a training run."""

    max_steps: int = positive(1000)
    lr: float = positive(3e-4)  # peak learning rate
    min_lr_ratio: float = unit_interval(0.1)  # the schedule ends at lr * min_lr_ratio
    warmup_steps: int = at_least(0, 100)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = unit_interval(0.2, low_open=True)  # wsd: share of steps spent decaying
    weight_decay: float = at_least(0, 0.1)  # on weight matrices only
    beta1: float = unit_interval(0.9, high_open=True)
    beta2: float = unit_interval(0.95, high_open=True)
    eps: float = positive(1e-8)
    grad_clip: float = at_least(0, 1.0)  # max global gradient norm; 0 disables clipping
    micro_batch_size: int = positive(8)  # sequences per forward/backward on each rank
    batch_tokens: int | None = positive(None)  # target tokens per optimizer step; None = one micro-batch
    # autocast dtype; fp16 adds dynamic loss scaling; auto = bf16 where it is faster than fp32
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    activation_checkpointing: bool = False  # recompute each block in the backward pass
    compile: bool = False  # torch.compile the model's forward and the loss as one graph
    seed: int = seed_field(0)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    eval_every: int = at_least(0, 100)  # steps between validations (0: only at the end)
    eval_batches: int | None = positive(20)  # validation micro-batches per evaluation, over all data-parallel ranks (None: the whole split)
    log_every: int = positive(10)  # steps between console lines (metrics.jsonl gets every step)
    checkpoint_every: int = at_least(0, 500)  # steps between checkpoints (0: none but the one always written at the end)
    keep_checkpoints: int = at_least(1, 2)  # the final checkpoint is always kept
    resume: str = "auto"  # auto: newest valid checkpoint in run_dir | never | a checkpoint directory
    tensorboard: bool = True
    max_minutes: float | None = positive(None)  # stop (with a checkpoint) after this much wall time
    stop_at_step: int | None = positive(None)  # stop (with a checkpoint) at this step; the schedule still spans max_steps
    max_nonfinite_steps: int = positive(3)  # stop after this many steps in a row with a NaN/inf loss or gradient norm (each skipped)
    spikes: SpikeConfig = field(default_factory=SpikeConfig)  # loss-spike detection: warn, skip or roll back

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.micro_batch_size < 1:
            raise ValueError("max_steps and micro_batch_size must be positive")
        if self.warmup_steps < 0 or self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps must be in [0, max_steps], got {self.warmup_steps}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1 (the final checkpoint is always kept), got {self.keep_checkpoints}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps must be at least 1, got {self.max_nonfinite_steps}")


class Objective(Protocol):
    """``num_targets``: tokens the loss covers; optional ``num_tokens``: tokens processed (for throughput)."""

    def num_targets(self, batch: Any) -> int: ...
    def __call__(self, model: nn.Module, batch: Any) -> Any: ...  # LossOutput


def resolve_device(name: str) -> torch.device:
    """``auto``: the first GPU if there is one, else the CPU; a GPU asked for must be there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InputError(f"device {name!r} is not a device (use auto, cpu, cuda or cuda:N): {exc}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {name!r}: this PyTorch ({torch.__version__}) sees no CUDA GPU; use device=auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError(f"device {name!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return device


def accumulation_steps(cfg: TrainConfig, tokens_per_micro_batch: int, world_size: int = 1) -> int:
    """Micro-batches per optimizer step so that a step sees about ``batch_tokens`` tokens."""
    if cfg.batch_tokens is None:
        return 1
    per_round = tokens_per_micro_batch * world_size
    steps = max(1, round(cfg.batch_tokens / per_round))
    if steps * per_round != cfg.batch_tokens:
        log.info("batch_tokens %d is not a multiple of %d tokens per micro-batch round: using %d",
                 cfg.batch_tokens, per_round, steps * per_round)
    return steps


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto``: bf16 on GPUs that support it, else fp16; on CPUs bf16 only where its matmul
    peak clearly beats fp32's (CPUs without native bf16 dot products run it slower)."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    fp32 = peak_flops(device, torch.float32, quick=True)
    bf16 = peak_flops(device, torch.bfloat16, quick=True)
    choice = "bf16" if bf16 >= 1.3 * fp32 else "fp32"
    log.info("precision auto -> %s (matmul peak: bf16 %.0f, fp32 %.0f GFLOP/s)", choice, bf16 / 1e9, fp32 / 1e9)
    return choice


def autocast_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def compile_objective(objective: Objective) -> Callable:
    """Forward and loss compiled as one graph: on CPU this fuses the norms, RoPE, SwiGLU and
    the fp32 cross-entropy around the matmuls. Evaluation keeps the eager objective, so a
    short last validation batch costs no recompilation."""
    return torch.compile(objective.__call__, dynamic=False)


class StepResult(NamedTuple):
    loss: torch.Tensor  # mean loss per target over the step
    grad_norm: torch.Tensor  # before clipping
    n_targets: int
    metrics: dict[str, torch.Tensor]  # the objective's extra metrics, mean per target
    skipped: bool = False  # a non-finite loss or gradient norm: the optimizer step was not taken


def train_step(
    model: nn.Module,
    objective: Objective,
    micro_batches: list,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    params: list[torch.Tensor],
    precision: str,
    grad_clip: float,
    forward_loss: Callable | None = None,
    parallel: ParallelContext | None = None,
    pipeline: PipelineRunner | None = None,
    accept: Callable[[torch.Tensor], bool] | None = None,
) -> StepResult:
    """One optimizer step over ``micro_batches``.

    Each micro-batch's summed loss is divided by the target count of the whole step, so
    accumulating k micro-batches gives the same update as one batch k times larger.
    ``forward_loss`` replaces ``objective(model, batch)``, e.g. with its compiled form.
    With ``parallel`` the step is one of a distributed run (see ``parallel_backward``).
    ``accept(loss)`` false (a loss spike, see ``train.spikes``) drops the update.
    """
    if parallel is not None:
        loss_total, n_targets, metric_sums = parallel_backward(model, objective, micro_batches, precision, parallel,
                                                               pipeline, forward_loss, scaler)
    else:
        loss_total, n_targets, metric_sums = local_backward(model, objective, micro_batches, precision, params[0].device,
                                                            forward_loss, scaler)
    if scaler is not None:
        scaler.unscale_(optimizer)
    if parallel is not None:
        grad_norm = clip_grad_norm_(params, grad_clip, parallel)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    # a non-finite loss or gradient norm never reaches the weights (the one host sync of the step);
    # fp16's scaler skips overflowed gradients itself and halves its scale: not counted here
    skipped = not bool(torch.isfinite(loss_total) & (torch.isfinite(grad_norm) | (scaler is not None)))
    apply = not skipped and (accept is None or accept(loss_total))  # accept: the loss-spike guard
    if scaler is not None:
        if apply:
            scaler.step(optimizer)  # skipped when the scaled gradients overflowed
        scaler.update()
    elif apply:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_total, grad_norm, n_targets, {k: v / n_targets for k, v in metric_sums.items()}, skipped)


def local_backward(model, objective, micro_batches, precision: str, device: torch.device,
                   forward_loss: Callable | None = None,
                   scaler: torch.amp.GradScaler | None = None) -> tuple[torch.Tensor, int, dict]:
    """Forward and backward of one step's micro-batches in one process: the mean loss per
    target, the target count and the objective's metric sums."""
    n_targets = sum(objective.num_targets(b) for b in micro_batches)
    loss_total = torch.zeros((), device=device)
    metric_sums: dict[str, torch.Tensor] = {}
    forward_loss = forward_loss or objective
    for batch in micro_batches:
        with autocast_context(device, precision):
            out = forward_loss(model, to_device(batch, device))
        loss = out.loss_sum / n_targets
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_total += loss.detach()
        for name, value in getattr(out, "metrics", {}).items():
            metric_sums[name] = metric_sums.get(name, 0.0) + value.detach().float()
    return loss_total, n_targets, metric_sums


def _local(value: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallelism is a replicated DTensor: its plain value."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def loss_context(parallel: ParallelContext) -> contextlib.AbstractContextManager:
    """Cross-entropy over vocabulary-sharded logits, where tensor parallelism keeps them sharded."""
    layout = parallel.layout
    if layout.tp > 1 and layout.pp == 1 and parallel.cfg.loss_parallel:
        return loss_parallel()
    return contextlib.nullcontext()


def parallel_backward(model, objective, micro_batches, precision, parallel: ParallelContext,
                      pipeline: PipelineRunner | None = None, forward_loss: Callable | None = None,
                      scaler: torch.amp.GradScaler | None = None) -> tuple[torch.Tensor, int, dict]:
    """Forward and backward of one step's micro-batches on one rank of a distributed run.

    The target count is summed over data-parallel ranks, so each token of the global batch
    weighs the same; FSDP averages gradients over those ranks, so each rank's loss is
    scaled by their number to turn the average into a sum. Returns the global mean loss,
    the global target count and the objective's metric sums (every rank gets them).
    """
    device = parallel.device
    dp = parallel.layout.dp
    n_targets = int(parallel.all_reduce_dp(torch.tensor(
        float(sum(objective.num_targets(b) for b in micro_batches)), dtype=torch.float64, device=device)).item())
    loss_total = torch.zeros((), device=device)
    metric_sums: dict[str, torch.Tensor] = {}
    forward_loss = forward_loss or objective
    scale = scaler.get_scale() if scaler is not None and pipeline is not None else 1.0  # a host sync: once a step
    for batch in micro_batches:
        with autocast_context(device, precision):
            if pipeline is not None:
                loss_total += pipeline.train_batch(batch, divisor=n_targets / dp, scale=scale) / dp
                continue
            with loss_context(parallel):
                out = forward_loss(model, to_device(batch, device))
                loss = out.loss_sum / n_targets
                (scaler.scale(loss * dp) if scaler is not None else loss * dp).backward()
        loss_total += _local(loss.detach()).float()
        for name, value in getattr(out, "metrics", {}).items():
            metric_sums[name] = metric_sums.get(name, 0.0) + _local(value.detach()).float()
    parallel.all_reduce_pp(loss_total)  # a pipeline's loss is known on its last stage
    parallel.all_reduce_dp(loss_total)
    for value in metric_sums.values():
        parallel.all_reduce_dp(value)
    return loss_total, n_targets, metric_sums


def batch_rows(batch: Any) -> int:
    """Rows of a batch: a tensor's first dimension, or that of a dict of tensors (SFT and preference rows)."""
    return len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch)


@torch.no_grad()
def evaluate(model: nn.Module, objective: Objective, batches: Iterator, device: torch.device, precision: str,
             max_batches: int | None, parallel: ParallelContext | None = None,
             pipeline: PipelineRunner | None = None) -> dict:
    """Mean loss per target (nats), the objective's metrics as ``val_<name>``, and bits per byte
    when the objective counts bytes.

    ``max_batches`` counts micro-batches over all data-parallel ranks (``TrainConfig.eval_batches``;
    each rank takes its share rounded up), so the figure covers the same rows whatever the world
    size when it is a multiple of theirs. Distributed, each data-parallel
    rank evaluates its rows and the sums are added up; only whole global batches are evaluated
    (every rank must run the same forwards), so a last partial batch that a single process
    would include is left out.
    """
    if parallel is not None and max_batches is not None:
        max_batches = -(-max_batches // parallel.layout.dp)  # this rank's share, rounded up
    was_training = model.training
    model.eval()
    loss_sum, n_targets, n_bytes = 0.0, 0, 0
    metric_sums: dict[str, float] = {}
    full_rows = None
    for i, batch in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        if parallel is not None:
            rows = torch.tensor(batch_rows(batch), device=device)
            dist.all_reduce(rows, op=dist.ReduceOp.MIN)
            full_rows = full_rows or int(rows)
            if int(rows) == 0 or int(rows) < full_rows:
                left = torch.tensor(batch_rows(batch), device=device)
                dist.all_reduce(left)  # said, not dropped silently: rank 0 logs it
                if int(left) and parallel.is_logging_rank:
                    log.warning("validation: the last, partial global batch (%d rows over the data-parallel ranks) is "
                                "left out under torchrun (every rank must run the same forwards); a validation set "
                                "that is a multiple of micro_batch_size x ranks is evaluated whole", int(left))
                break
        if batch_rows(batch) == 0:
            continue
        if pipeline is not None:
            with autocast_context(device, precision):
                batch_loss, batch_bytes = pipeline.eval_batch(batch)
            loss_sum += batch_loss
            n_targets += objective.num_targets(batch)
            n_bytes += batch_bytes
            continue
        with autocast_context(device, precision), (loss_context(parallel) if parallel else contextlib.nullcontext()):
            out = objective(model, to_device(batch, device))
        loss_sum += _local(out.loss_sum).item()
        n_targets += out.n_targets
        n_bytes += getattr(out, "n_bytes", 0) or 0
        for name, value in getattr(out, "metrics", {}).items():
            metric_sums[name] = metric_sums.get(name, 0.0) + float(_local(value))
    model.train(was_training)
    if parallel is not None:
        reshard(model)
        names = sorted(metric_sums)
        sums = parallel.all_reduce_dp(torch.tensor([loss_sum, n_targets, n_bytes, *[metric_sums[k] for k in names]],
                                                   dtype=torch.float64, device=device))
        loss_sum, n_targets, n_bytes = float(sums[0]), int(sums[1]), int(sums[2])
        metric_sums = {k: float(v) for k, v in zip(names, sums[3:])}
    if n_targets == 0:
        return {}
    result = {"val_loss": loss_sum / n_targets}
    result.update({f"val_{name}": value / n_targets for name, value in metric_sums.items()})
    if n_bytes:
        result["val_bpb"] = loss_sum / (math.log(2) * n_bytes)
    return result


def train(
    *,
    model: nn.Module,
    objective: Objective,
    train_batches: Iterator,
    cfg: TrainConfig,
    run_dir: Path,
    recipe: Any,
    grad_accum: int = 1,
    val_batches: Callable[[], Iterator] | None = None,
    flops_per_token: float | None = None,
    tokenizer_dir: str | Path | None = None,
    parallel: ParallelContext | None = None,
    pipeline: PipelineRunner | None = None,
) -> dict:
    """Train ``model`` in place for ``cfg.max_steps`` optimizer steps; return a summary.

    ``train_batches`` must have ``state_dict()``/``load_state_dict()`` for exact resume;
    ``val_batches()`` returns a fresh finite iterator over validation batches.
    In a distributed run ``model`` is already parallelized (blocks compiled there when
    ``cfg.compile``), ``train_batches`` yields this data-parallel rank's rows, and
    ``pipeline`` (a pipeline rank's stage and schedule) replaces forward/backward.
    """
    run_dir = Path(run_dir)
    device = parallel.device if parallel is not None else next(model.parameters()).device
    forward_loss = compile_objective(objective) if cfg.compile and parallel is None else objective
    logging_rank = parallel is None or parallel.is_logging_rank
    world_size = parallel.layout.world_size if parallel is not None else 1
    _, dp = data_parallel_rank(parallel)
    async_group = dist.new_group(backend="gloo") if parallel is not None and parallel.cfg.async_checkpoint else None
    pending: list[PendingCheckpoint] = []
    optimizer = build_adamw(model, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]

    start_step, tokens_seen, nonfinite_steps, nonfinite_in_a_row = 0, 0, 0, 0
    if parallel is None or dist.get_rank() == 0:
        remove_unfinished_checkpoints(run_dir)
    ckpt = resume_checkpoint(cfg, run_dir)
    if parallel is not None and cfg.resume == "auto":  # every rank resumes from the one rank 0 found
        found = [str(ckpt) if ckpt is not None else None]
        dist.broadcast_object_list(found, src=0)
        ckpt = Path(found[0]) if found[0] is not None else None
    state = read_resume_state(ckpt) if ckpt is not None else None
    precision = choose_precision(cfg, state.trainer_state.get("precision") if state else None, device)
    scaler = None
    if precision == "fp16":
        scaler = DistributedGradScaler(device) if parallel is not None else torch.amp.GradScaler(device.type)
    if parallel is not None or (ckpt is not None and is_sharded_checkpoint(ckpt)):
        # DCP's flattened optimizer state cannot hold or load an empty group (LoRA: no undecayed vectors),
        # also when one process resumes a distributed run's checkpoint
        optimizer.param_groups = [group for group in optimizer.param_groups if group["params"]]
    guard = SpikeGuard(cfg.spikes)
    guard.check_loader(train_batches)

    def restore(ckpt: Path, state: ResumeState, rollback: bool = False) -> None:
        """Load a checkpoint's weights, optimizer, loader, loss scale and spike window (resume, rollback)."""
        load_training_checkpoint(ckpt, state, model, optimizer, sharded_model=parallel is not None)
        train_batches.load_state_dict(state.trainer_state["loader"])
        if scaler is not None and state.trainer_state.get("scaler"):
            scaler.load_state_dict(state.trainer_state["scaler"])
        guard.load_state_dict(state.trainer_state.get("spikes"), rollback=rollback)

    if state is not None:
        restore(ckpt, state)
        start_step, tokens_seen = state.step, state.trainer_state.get("tokens_seen", 0)
        nonfinite_steps = state.trainer_state.get("nonfinite_steps", 0)
        log.info("resuming from %s (step %d)", ckpt, start_step)
        if logging_rank:
            _log_recipe_changes(ckpt, recipe)
    if parallel is None or dist.get_rank() == 0:
        aside = set_aside_later_checkpoints(run_dir, start_step)
        if aside is not None:
            log.warning("checkpoints past step %d of an earlier run (train.resume=%s) moved to %s",
                        start_step, cfg.resume, aside)
    if parallel is not None:
        dist.barrier()
    metrics = (MetricsLogger(run_dir, cfg.tensorboard, resume_step=start_step if ckpt is not None else None)
               if logging_rank else _NoMetrics())
    peak = peak_flops(device, DTYPES[precision]) if flops_per_token and logging_rank else None

    def trainer_state() -> dict:
        return {"tokens_seen": tokens_seen, "loader": train_batches.state_dict(), "precision": precision,
                "scaler": scaler.state_dict() if scaler is not None else None, "spikes": guard.state_dict(),
                "nonfinite_steps": nonfinite_steps}

    def checkpoint(step: int, final: bool = False) -> Path:
        if parallel is None:
            path = save_training_checkpoint(run_dir, step, model, optimizer, trainer_state(), recipe, tokenizer_dir,
                                            cfg.keep_checkpoints)
            log.info("step %d: checkpoint %s", step, path)
            return path
        while pending:  # the previous background save must be committed first
            log.info("checkpoint %s committed", pending.pop().commit())
        save = save_sharded_training_checkpoint(
            run_dir, step, model, optimizer, trainer_state(), recipe, tokenizer_dir, cfg.keep_checkpoints,
            with_weights=final, async_group=None if final else async_group)
        if save.future is None:
            path = save.commit()
            log.info("step %d: sharded checkpoint %s", step, path)
            return path
        pending.append(save)
        log.info("step %d: sharded checkpoint %s being written in the background", step, save.target)
        return save.target

    def roll_back(spike: SpikeEvent) -> int | None:
        """Restore the newest checkpoint and make the loader skip the samples from it to ``spike``
        (``train.spikes.policy=rollback``); its step, or None when there is none (the update stays skipped)."""
        nonlocal tokens_seen, metrics
        while pending:
            log.info("checkpoint %s committed", pending.pop().commit())
        found = [str(latest_valid_checkpoint(run_dir) or "") if parallel is None or dist.get_rank() == 0 else None]
        if parallel is not None:
            dist.broadcast_object_list(found, src=0)
        if not found[0]:
            spike.action = "skipped"
            log.warning("step %d: no checkpoint to roll back to; skipping the update", spike.step)
            return None
        spike_end, back = train_batches.samples, read_resume_state(Path(found[0]))
        metrics.close()
        restore(Path(found[0]), back, rollback=True)
        guard.rolled_back(spike, back.step, train_batches, spike_end,
                          grad_accum * train_batches.batch_size * train_batches.world_size)
        tokens_seen = back.trainer_state.get("tokens_seen", 0)
        metrics = MetricsLogger(run_dir, cfg.tensorboard, resume_step=back.step) if logging_rank else _NoMetrics()
        for event in guard.rollbacks:  # the rollbacks past the checkpoint stay on record
            if event["step"] > back.step:
                metrics.log(event)
        return back.step

    summary: dict = {"start_step": start_step, "step": start_step, "precision": precision}
    if start_step >= cfg.max_steps:
        log.info("run already complete at step %d (max_steps %d)", start_step, cfg.max_steps)
        metrics.close()
        return {**summary, "already_complete": True}  # the stage keeps the run's summary.json (completed_summary)

    model.train()
    bar = (progress_bar(cfg.max_steps, "training", unit="step", initial=start_step) if logging_rank
           else tqdm(disable=True))
    t_start = time.perf_counter()
    tok_rates, mfus = [], []
    last_ckpt = None
    step = start_step
    for step in (steps := StepRange(start_step, cfg.max_steps)):
        t0 = time.perf_counter()
        lr = lr_at(step, peak=cfg.lr, max_steps=cfg.max_steps, warmup_steps=cfg.warmup_steps, schedule=cfg.schedule,
                   min_lr_ratio=cfg.min_lr_ratio, decay_fraction=cfg.decay_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = [next(train_batches) for _ in range(grad_accum)]
        n_tokens = dp * sum(getattr(objective, "num_tokens", objective.num_targets)(b) for b in micro_batches)
        result = train_step(model, objective, micro_batches, optimizer, scaler, params, precision, cfg.grad_clip,
                            forward_loss, parallel, pipeline, accept=guard.accept(step))
        loss_value, grad_norm, n_targets = result.loss.item(), result.grad_norm, result.n_targets
        nonfinite_steps += result.skipped
        nonfinite_in_a_row = nonfinite_in_a_row + 1 if result.skipped else 0
        if result.skipped:
            log.warning("step %d: loss %s, gradient norm %s: optimizer step skipped", step + 1, loss_value, float(grad_norm))
        if nonfinite_in_a_row >= cfg.max_nonfinite_steps:
            metrics.close()
            raise FloatingPointError(
                f"non-finite loss or gradient norm for {nonfinite_in_a_row} steps in a row, each skipped (step "
                f"{step + 1}: loss {loss_value}, gradient norm {float(grad_norm)}); lower train.lr, raise "
                f"train.warmup_steps, or resume from the last checkpoint"
            )
        if (spike := guard.take_event()) is not None:
            back = roll_back(spike) if spike.action == "rolled_back" else None
            log.warning("%s", spike.line())
            if back is not None:
                steps.rewind(back)
                continue
            metrics.log(spike.record())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        tokens_seen += n_tokens
        record = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                  "tokens": tokens_seen, "targets": n_targets, "tokens_per_s": n_tokens / dt, "step_s": dt,
                  "memory_bytes": peak_memory_bytes(device), "nonfinite_steps": nonfinite_steps}
        record.update({name: float(value) for name, value in result.metrics.items()})
        if flops_per_token and peak:  # model FLOPs of the global batch over the peak of every device
            if (mfu := utilization(flops_per_token * n_tokens / dt, peak * world_size)) is None:
                log.warning("step %d ran at %.3g FLOP/s per device, above the %s peak of %.3g: MFU is not reported "
                            "(run `lmforge bench peak` on an idle machine, or set %s)", step + 1,
                            flops_per_token * n_tokens / dt / world_size, precision, peak, PEAK_ENV)
                peak, mfus = None, []
            else:
                record["mfu"] = mfu
        if step > start_step:  # the first step pays for warm-up (allocation, compilation)
            tok_rates.append(record["tokens_per_s"])
            if "mfu" in record:
                mfus.append(record["mfu"])
        done = step + 1
        is_last = done == cfg.max_steps
        out_of_time = (cfg.max_minutes is not None and (time.perf_counter() - t_start) / 60 >= cfg.max_minutes) or (
            cfg.stop_at_step is not None and done >= cfg.stop_at_step)
        if val_batches is not None and ((cfg.eval_every and done % cfg.eval_every == 0) or is_last or out_of_time):
            record.update(evaluate(model, objective, val_batches(), device, precision, cfg.eval_batches, parallel,
                                   pipeline))
        metrics.log(record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
        if bar.disable and (done % cfg.log_every == 0 or is_last or "val_loss" in record):
            _log_step(record, cfg.max_steps)
        elif "val_loss" in record:
            bar.write(_format_step(record, cfg.max_steps))
        if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or is_last or out_of_time:
            last_ckpt = checkpoint(done, final=is_last or out_of_time)
            if logging_rank:  # the run's config is the one its newest checkpoint was trained with
                record_config(recipe, run_dir)
        if pending and (committed := commit_if_written(pending, device)):
            log.info("checkpoint %s committed", committed)
        if out_of_time and not is_last:
            log.info("stopping at step %d (max_minutes=%s, stop_at_step=%s); resume with train.resume=auto",
                     done, cfg.max_minutes, cfg.stop_at_step)
            break
    bar.close()
    metrics.close()
    while pending:
        pending.pop().commit()
    summary.update(
        step=step + 1,
        final_loss=loss_value,
        wall_s=time.perf_counter() - t_start,
        tokens_per_s=sum(tok_rates) / len(tok_rates) if tok_rates else None,
        mfu=sum(mfus) / len(mfus) if mfus else None,
        checkpoint=str(last_ckpt) if last_ckpt else None,
        nonfinite_steps=nonfinite_steps,
        **{k: v for k, v in record.items() if k.startswith("val_")},
    )
    return summary


def resume_checkpoint(cfg: TrainConfig, run_dir: str | Path) -> Path | None:
    """The checkpoint ``train.resume`` names: the newest valid one of ``run_dir`` (auto), none
    (never), or the directory given."""
    if cfg.resume == "auto":
        ckpt = latest_valid_checkpoint(run_dir)
        if ckpt is None and checkpoint_dirs(run_dir):  # never start over quietly: that discards the history
            raise InputError(f"{Path(run_dir) / 'checkpoints'}: no valid checkpoint (each is damaged or holds non-finite "
                             "weights, as warned above); repair or move them, or start over with train.resume=never "
                             "(which sets them aside)")
        return ckpt
    if cfg.resume == "never":
        return None
    ckpt = Path(cfg.resume)
    if not ckpt.is_dir():
        raise InputError(f"train.resume: checkpoint {ckpt} not found (use auto, never or a checkpoint directory)")
    return ckpt


def choose_precision(cfg: TrainConfig, recorded: str | None, device: torch.device) -> str:
    """``train.precision``; for ``auto``, ``recorded``, the precision of the run being resumed
    (a resumed run keeps its choice), else what ``resolve_precision`` picks for this machine."""
    if cfg.precision == "auto" and recorded in DTYPES:
        return recorded
    return resolve_precision(cfg.precision, device)


def run_precision(cfg: TrainConfig, run_dir: str | Path, device: torch.device,
                  parallel: ParallelContext | None = None) -> str:
    """``choose_precision`` for a stage that needs the precision before the loop starts (to
    evaluate, score a reference or parallelize first): it passes the result to ``train`` in
    ``cfg.precision``, so the loop does not choose again. Under ``parallel`` rank 0 chooses
    and every rank gets its choice (``auto``'s quick timings could differ between ranks)."""
    chosen = [None]
    if parallel is None or parallel.is_logging_rank:
        ckpt = resume_checkpoint(cfg, run_dir)
        state = read_resume_state(ckpt) if ckpt is not None else None  # verified once: the loop's read is cached
        chosen = [choose_precision(cfg, state.trainer_state.get("precision") if state else None, device)]
    if parallel is not None:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def _log_recipe_changes(ckpt: Path, recipe: Any) -> None:
    """Warn about each setting that differs from the recipe the checkpoint was written with."""
    saved_path = ckpt / "config.yaml"
    if recipe is None or not saved_path.is_file():
        return
    try:
        saved = yaml.safe_load(saved_path.read_text())
    except (OSError, yaml.YAMLError):
        return
    for key, (before, now) in _differences(saved, to_dict(recipe)).items():
        log.warning("resuming with a changed setting: %s was %r, now %r", key, before, now)


def _differences(a: Any, b: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for key in dict.fromkeys([*a, *b]):
            out.update(_differences(a.get(key), b.get(key), f"{prefix}{key}."))
        return out
    return {} if a == b else {prefix.rstrip("."): (a, b)}


class _NoMetrics:
    """The metrics of ranks other than 0: nothing is written."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


# objective metrics worth a place on the console line (all of them go to metrics.jsonl)
CONSOLE_METRICS = ("margin", "accuracy", "kl")


def _format_step(r: dict, max_steps: int) -> str:
    text = f"step {r['step']}/{max_steps} loss {r['loss']:.4f} lr {r['lr']:.2e} gnorm {r['grad_norm']:.2f} {r['tokens_per_s']:.0f} tok/s"
    if "mfu" in r:
        text += f" mfu {100 * r['mfu']:.1f}%"
    text += "".join(f" {k} {v:.3f}" for k, v in r.items() if k in CONSOLE_METRICS)
    if "val_loss" in r:
        text += f" | val loss {r['val_loss']:.4f}"
    if "val_bpb" in r:
        text += f" bpb {r['val_bpb']:.4f}"
    return text


def _log_step(r: dict, max_steps: int) -> None:
    log.info("%s", _format_step(r, max_steps))
