"""The one training loop. Pre-training, SFT and preference training differ only by objective and data.

``train`` is a short loop over named parts, each chosen once for the run:

- the step runner (``train.step``): forward/backward of the step's micro-batches, clipping,
  the optimizer step, evaluation; for one process, a data-parallel rank or a pipeline rank;
- the checkpointer (``train.checkpointer``): resume (``train.resume``), saves (sharded and in
  the background under ``torchrun``), superseded checkpoints, the restore of a rollback;
- the evaluator (``train.evaluate``): when to validate, and the validation loss, bits per
  byte and metrics (per dataset of a mixture, and their weighted mean);
- the step log (``train.step_log``): ``metrics.jsonl``/TensorBoard/``train.loggers`` on rank 0, the console, MFU;
- the guards: non-finite steps and time limits (``train.guards``), loss spikes (``train.spikes``);
- the gradient noise scale (``train.noise_scale``), every ``noise_scale_every`` steps when on.

Each optimizer step draws ``grad_accum`` micro-batches; the step runner divides every
micro-batch's summed loss by the target count of the whole step (so each token weighs the
same), and the learning rate follows the schedule of ``train.optim``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from lmforge.core.config import at_least, option, positive, seed_field, to_dict, unit_interval
from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.distributed.mesh import ParallelContext
from lmforge.distributed.pipeline import PipelineRunner
from lmforge.objectives.base import Objective
from lmforge.train.checkpoint import read_resume_state
from lmforge.train.checkpointer import TrainerState, build_checkpointer, resume_checkpoint
from lmforge.train.dp import DPStepRunner, PrivacyPlan
from lmforge.train.ema import AverageConfig, build_average
from lmforge.train.evaluate import (  # noqa: F401 (evaluate, ValidationSet: the stages' import)
    Evaluator,
    ValidationSet,
    evaluate,
    is_scored_metric,
    is_validation_metric,
)
from lmforge.train.forward import DTYPES, autocast_context  # noqa: F401 (autocast_context: the stages' import)
from lmforge.train.guards import NonFiniteGuard, TimeLimit
from lmforge.train.lamb import LambConfig
from lmforge.train.loggers import check_installed
from lmforge.train.metrics import peak_source
from lmforge.train.muon import MuonConfig
from lmforge.train.noise_scale import NoiseScale
from lmforge.train.optim import build_optimizer, lr_at
from lmforge.train.spikes import SpikeConfig, SpikeGuard, StepRange
from lmforge.train.step import build_step_runner
from lmforge.train.step_log import StepLog


@dataclass
class TrainConfig:
    """Optimizer, schedule, batch, precision, evaluation and checkpointing of a training run."""

    max_steps: int = positive(1000, help="optimizer steps; the schedule spans them")
    optimizer: Literal["adamw", "muon", "lamb"] = option(
        "adamw",
        help="adamw; muon (Muon on the blocks' matrices, train.muon, and AdamW on the rest); "
        "lamb (Adam with a per-tensor trust ratio, train.lamb)",
    )
    muon: MuonConfig = option(default_factory=MuonConfig, help="Muon's keys (train.optimizer: muon)")
    lamb: LambConfig = option(default_factory=LambConfig, help="LAMB's keys (train.optimizer: lamb)")
    lr: float = positive(3e-4, help="peak learning rate (of AdamW; of LAMB; of the parameters Muon leaves to AdamW)")
    min_lr_ratio: float = unit_interval(0.1, help="the schedule ends at lr * min_lr_ratio")
    warmup_steps: int = at_least(0, 100, help="steps of linear warm-up to lr")
    warmup_start: float = at_least(
        0, 0.0, help="the rate the warm-up starts from: 0, or for continued pre-training the previous run's final rate "
        "(re-warming, Ibrahim et al. 2024); a parameter group with a peak of its own (Muon's matrices, µP's) starts "
        "at the same fraction of its peak"
    )
    schedule: Literal["cosine", "wsd", "constant"] = option(
        "cosine",
        help="after warm-up: cosine decay to the end, "
        "wsd (warmup-stable-decay: flat, then a linear decay), or constant",
    )
    decay_fraction: float = unit_interval(0.2, low_open=True, help="wsd: share of steps spent decaying")
    weight_decay: float = at_least(0, 0.1, help="on weight matrices only (AdamW's and LAMB's)")
    beta1: float = unit_interval(0.9, high_open=True, help="AdamW's (and LAMB's) β1")
    beta2: float = unit_interval(0.95, high_open=True, help="AdamW's (and LAMB's) β2")
    eps: float = positive(1e-8, help="AdamW's (and LAMB's) ε")
    grad_clip: float = at_least(0, 1.0, help="max global gradient norm; 0 disables clipping")
    micro_batch_size: int = positive(8, help="sequences per forward/backward on each rank")
    batch_tokens: int | None = positive(None, help="target tokens per optimizer step; None = one micro-batch")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = option(
        "auto", help="autocast dtype; fp16 adds dynamic loss scaling; auto = bf16 where it is faster than fp32"
    )
    activation_checkpointing: bool = option(False, help="recompute each block in the backward pass")
    compile: bool = option(False, help="torch.compile the model's forward and the loss as one graph")
    seed: int = seed_field(0, help="the seed of torch's random numbers: the model's initialisation, dropout")
    device: str = option("auto", help="auto | cpu | cuda | cuda:N")
    eval_every: int = at_least(0, 100, help="steps between validations (0: only at the end)")
    eval_tasks: list[str] = option(
        default_factory=list,
        help="task files, suites or bundled task names (`lmforge eval`'s --tasks) scored every eval_every steps and "
        "at the end, as eval/<task>/<metric>: the stage builds the scorer "
        "(lmforge.stages.scoring.eval_tasks_scorer)",
    )
    eval_batches: int | None = positive(
        20,
        help="validation micro-batches per evaluation (per dataset of a mixture), "
        "over all data-parallel ranks (None: the whole split)",
    )
    log_every: int = positive(10, help="steps between console lines (metrics.jsonl gets every step)")
    checkpoint_every: int = at_least(
        0, 500, help="steps between checkpoints (0: none but the one always written at the end)"
    )
    keep_checkpoints: int = at_least(1, 2, help="the final checkpoint is always kept")
    resume: str = option("auto", help="auto: newest valid checkpoint in run_dir | never | a checkpoint directory")
    tensorboard: bool = option(True, help="mirror metrics.jsonl's scalars to run_dir/tensorboard")
    loggers: list[Literal["wandb", "mlflow"]] = option(
        default_factory=list,
        help="experiment trackers that also get the scalars, the resolved config and the report's plots: wandb "
        "(offline in run_dir/wandb unless WANDB_MODE is set), "
        "mlflow (run_dir/mlruns unless MLFLOW_TRACKING_URI is set)",
    )
    max_minutes: float | None = positive(None, help="stop (with a checkpoint) after this much wall time")
    stop_at_step: int | None = positive(
        None, help="stop (with a checkpoint) at this step; the schedule still spans max_steps"
    )
    max_nonfinite_steps: int = positive(
        3, help="stop after this many steps in a row with a NaN/inf loss or gradient norm (each skipped)"
    )
    spikes: SpikeConfig = option(default_factory=SpikeConfig, help="loss-spike detection: warn, skip or roll back")
    noise_scale_every: int = at_least(
        0,
        0,
        help="steps between measurements of the gradient noise scale B_simple in tokens (train.noise_scale; "
        "first micro-batch vs the whole step, so it needs >= 2 micro-batches per step); 0: off",
    )
    noise_scale_decay: float = unit_interval(
        0.9, high_open=True, help="moving-average decay per measurement of |G|² and tr(Σ)"
    )
    average: AverageConfig | None = option(
        None, help="keep an average of the weights (an EMA, or the last N steps' mean: train.ema) in each checkpoint's "
        "average/, validated at the end as average/val_loss"
    )

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
        check_installed(self.loggers)


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


def scheduled_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Set each parameter group's learning rate for step ``step`` (0-based) on the schedule of
    ``cfg``, from the group's ``peak_lr`` (Muon's matrices have their own) or ``train.lr``; return
    the rate of ``train.lr``, the one logged."""
    def at(peak: float) -> float:
        return lr_at(step, peak=peak, max_steps=cfg.max_steps, warmup_steps=cfg.warmup_steps, schedule=cfg.schedule,
                     min_lr_ratio=cfg.min_lr_ratio, decay_fraction=cfg.decay_fraction,
                     warmup_start=cfg.warmup_start * peak / cfg.lr)
    for group in optimizer.param_groups:
        group["lr"] = at(group.get("peak_lr", cfg.lr))
    return at(cfg.lr)


def train(
    *,
    model: nn.Module,
    objective: Objective,
    train_batches: Iterator,
    cfg: TrainConfig,
    run_dir: Path,
    recipe: Any,
    grad_accum: int = 1,
    val_batches: Callable[[], Iterator] | list[ValidationSet] | None = None,
    flops_per_token: float | None = None,
    tokenizer_dir: str | Path | None = None,
    parallel: ParallelContext | None = None,
    pipeline: PipelineRunner | None = None,
    precision_reason: str | None = None,
    scorer: Callable[[nn.Module], dict] | None = None,
    privacy: PrivacyPlan | None = None,
) -> dict:
    """Train ``model`` in place for ``cfg.max_steps`` optimizer steps; return a summary.

    ``train_batches`` must have ``state_dict()``/``load_state_dict()`` for exact resume;
    ``val_batches()`` returns a fresh finite iterator over validation batches; a list of
    ``ValidationSet`` (a mixture's datasets) is evaluated set by set (``Evaluator``).
    In a distributed run ``model`` is already parallelized (blocks compiled there when
    ``cfg.compile``), ``train_batches`` yields this data-parallel rank's rows, and
    ``pipeline`` (a pipeline rank's stage and schedule) replaces forward/backward.
    ``precision_reason``: why ``cfg.precision`` was chosen, when the stage chose it before the
    loop (``run_precision``); it goes into the summary with the precision. ``scorer(model)``
    (the stage's, e.g. of ``cfg.eval_tasks``) adds its figures to each validation's record.
    ``privacy`` (a ``dp:`` recipe): DP-SGD's step (``train.dp``); training stops before the step
    that would spend more than its budget, and the ε spent is in each record and the summary.
    """
    if not isinstance(objective, Objective):
        raise TypeError(f"{type(objective).__name__} is not an Objective: subclass lmforge.objectives.base.Objective")
    run_dir = Path(run_dir)
    optimizer = build_optimizer(model, cfg)
    checkpointer = build_checkpointer(run_dir, cfg, recipe, tokenizer_dir, model, optimizer, parallel)
    found = checkpointer.find()
    precision, reason = choose_precision(cfg, found[1].trainer_state.get("precision") if found else None,
                                         training_device(model, parallel))
    runner = (DPStepRunner(model, objective, optimizer, precision, privacy, cfg.micro_batch_size, parallel) if privacy else
              build_step_runner(model, objective, optimizer, precision, cfg.grad_clip, cfg.compile, parallel, pipeline))
    spikes = SpikeGuard(cfg.spikes)
    spikes.check_loader(train_batches)
    noise = noise_scale_tracker(cfg, grad_accum)
    average = build_average(cfg.average, model, cfg.max_steps, distributed=parallel is not None)
    state = TrainerState(train_batches, precision, runner.scaler, spikes, NonFiniteGuard(cfg.max_nonfinite_steps),
                         noise=noise, objective=objective, average=average, privacy=privacy)
    start_step = checkpointer.resume(found, state)
    step_log = StepLog(run_dir, cfg.tensorboard, checkpointer.is_first_rank, start_step if found else None,
                       cfg.max_steps, cfg.log_every, runner.device, precision, runner.world_size, flops_per_token,
                       cfg.loggers, to_dict(recipe) if recipe is not None else None)
    evaluator = Evaluator(val_batches, cfg.eval_every, cfg.eval_batches, runner.evaluate,
                          score=(lambda: scorer(model)) if scorer is not None else None)
    summary: dict = {"start_step": start_step, "step": start_step, "precision": precision,
                     "precision_reason": precision_reason or reason}
    if start_step >= cfg.max_steps:
        log.info("run already complete at step %d (max_steps %d)", start_step, cfg.max_steps)
        step_log.close()
        return {**summary, "already_complete": True}  # the stage keeps the run's summary.json (completed_summary)

    model.train()
    if cfg.compile:
        log.info("compiling the model (torch.compile; the first step takes longer)")
    step_log.start(start_step)
    limit = TimeLimit(cfg.max_minutes, cfg.stop_at_step)
    last_ckpt, record = None, {}
    try:
        for step in (steps := StepRange(start_step, cfg.max_steps)):
            started = time.perf_counter()
            lr = scheduled_lr(optimizer, step, cfg)
            micro_batches = [next(train_batches) for _ in range(grad_accum)]
            timings = {"batches": time.perf_counter() - started, **batch_timings(train_batches)}
            n_tokens = runner.tokens(micro_batches)
            measure = noise is not None and (step + 1) % cfg.noise_scale_every == 0
            result = runner.run_step(micro_batches, accept=spikes.accept(step), measure_noise=measure)
            loss = result.loss.item()
            state.nonfinite.observe(step + 1, result.skipped, loss, result.grad_norm)
            if (spike := spikes.take_event()) is not None:
                back = checkpointer.roll_back(spike, state, step_log, grad_accum) if spike.action == "rolled_back" else None
                log.warning("%s", spike.line())
                if back is not None:
                    steps.rewind(back)
                    continue
                step_log.event(spike.record())
            state.tokens_seen += n_tokens
            if average is not None:
                average.update(step + 1)
            record = step_log.record(step, result, loss, lr, started, n_tokens, state.tokens_seen, state.nonfinite.total,
                                     timings)
            record.update(batch_metrics(train_batches))
            if result.noise is not None and not result.skipped:
                record.update(noise.observe(result.noise))
            done = step + 1
            is_last = done == cfg.max_steps
            stopping = limit.reached(done) or (privacy is not None and privacy.over_budget())
            if evaluator.due(done, final=is_last or stopping):
                record.update(evaluator())
                if average is not None and is_last and average.ready():
                    with average.swapped_in():
                        record.update({f"average/{k}": v for k, v in evaluator().items()})
            step_log.write(record, is_last)
            if checkpointer.due(done, final=is_last or stopping):
                last_ckpt = checkpointer.save(done, state, final=is_last or stopping)
            checkpointer.commit_written()
            if stopping and not is_last:
                log.info("stopping at step %d (max_minutes=%s, stop_at_step=%s); resume with train.resume=auto",
                         done, cfg.max_minutes, cfg.stop_at_step)
                break
    finally:
        step_log.close()
    checkpointer.commit_pending()
    return {**summary, "step": step + 1, "max_steps": cfg.max_steps, "stopped_early": step + 1 < cfg.max_steps,
            "final_loss": loss, "wall_s": limit.elapsed_s(), **step_log.averages(),
            "checkpoint": str(last_ckpt) if last_ckpt else None, "nonfinite_steps": state.nonfinite.total,
            **{k: v for k, v in record.items() if is_validation_metric(k.removeprefix("average/")) or is_scored_metric(k)}, **(noise.summary() if noise else {}),
            **(privacy.summary() if privacy else {})}


def batch_timings(batches) -> dict[str, float]:
    """Where a batch source's time went since it was last asked, for sources that say so (RL's
    rollout batches: sampling, rewards, the reference's and the critic's forwards): a
    ``pop_timings() -> {phase: seconds}``. Its phases are part of the step's ``time/batches_s``."""
    pop = getattr(batches, "pop_timings", None)
    return pop() if pop is not None else {}


def batch_metrics(batches) -> dict[str, float]:
    """What a batch source says of the step's batches, for sources that say so (a token loader's
    mixture shares drawn, curriculum row length and scores: ``TokenLoader.pop_metrics``)."""
    pop = getattr(batches, "pop_metrics", None)
    return pop() if pop is not None else {}


def noise_scale_tracker(cfg: TrainConfig, grad_accum: int) -> NoiseScale | None:
    """The moving averages of the gradient noise scale, when ``train.noise_scale_every`` asks for them."""
    if cfg.noise_scale_every == 0:
        return None
    if grad_accum < 2:
        raise InputError(f"train.noise_scale_every = {cfg.noise_scale_every} compares the first micro-batch's gradient "
                         "with the whole step's, so it needs at least 2 micro-batches per step, but a step has 1: "
                         "raise train.batch_tokens to at least twice the tokens of a micro-batch (or set "
                         "train.noise_scale_every=0)")
    return NoiseScale(cfg.noise_scale_decay)


def training_device(model: nn.Module, parallel: ParallelContext | None) -> torch.device:
    """The device a run computes on: its rank's under ``torchrun``, else the model's."""
    return parallel.device if parallel is not None else next(model.parameters()).device


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """The precision to train in and why. ``auto``: bf16 on GPUs that support it, else fp16; on
    CPUs bf16 only where its matmul peak clearly beats fp32's (CPUs without native bf16 dot
    products run it slower), from the peaks measured once per machine and cached."""
    if precision != "auto":
        return precision, "set in the recipe"
    if device.type == "cuda":
        return ("bf16", "auto: this GPU supports bf16") if torch.cuda.is_bf16_supported() else \
            ("fp16", "auto: this GPU has no bf16")
    fp32, fp32_source = peak_source(device, torch.float32)
    bf16, bf16_source = peak_source(device, torch.bfloat16)
    choice = "bf16" if bf16 >= 1.3 * fp32 else "fp32"
    sources = fp32_source if fp32_source == bf16_source else f"fp32 {fp32_source}, bf16 {bf16_source}"
    log.info("precision auto -> %s (matmul peak: bf16 %.0f, fp32 %.0f GFLOP/s; %s)",
             choice, bf16 / 1e9, fp32 / 1e9, sources)
    return choice, f"auto: bf16 matmul {bf16 / fp32:.1f}x fp32 on this CPU, {sources}"


def choose_precision(cfg: TrainConfig, recorded: str | None, device: torch.device) -> tuple[str, str]:
    """``train.precision`` and why; for ``auto``, ``recorded``, the precision of the run being
    resumed (a resumed run keeps its choice), else what ``resolve_precision`` picks for this machine."""
    if cfg.precision == "auto" and recorded in DTYPES:
        return recorded, "auto: kept from the checkpoint resumed"
    return resolve_precision(cfg.precision, device)


def run_precision(cfg: TrainConfig, run_dir: str | Path, device: torch.device,
                  parallel: ParallelContext | None = None) -> tuple[str, str]:
    """``choose_precision`` for a stage that needs the precision before the loop starts (to
    evaluate, score a reference or parallelize first): it passes the precision to ``train`` in
    ``cfg.precision`` and the reason in ``precision_reason``, so the loop does not choose again.
    Under ``parallel`` rank 0 chooses and every rank gets its choice."""
    chosen = [None]
    if parallel is None or parallel.is_logging_rank:
        ckpt = resume_checkpoint(cfg, run_dir)
        state = read_resume_state(ckpt) if ckpt is not None else None  # verified once: the loop's read is cached
        chosen = [choose_precision(cfg, state.trainer_state.get("precision") if state else None, device)]
    if parallel is not None:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def precision_line(summary: dict) -> list[str]:
    """The report line of a stage's summary saying which precision it trained in and why."""
    if not summary.get("precision"):
        return []
    reason = summary.get("precision_reason")
    return [f"- precision {summary['precision']}" + (f" ({reason})" if reason else "")]
