"""The loop's checkpointer: where a run resumes from, what its checkpoints hold, when they are
written and committed, and the restore of a loss-spike rollback.

``Checkpointer`` serves one process (each checkpoint written whole, in the foreground);
``ShardedCheckpointer`` a rank of a distributed run, where rank 0 decides what every rank
reads (the newest valid checkpoint), every rank writes its DCP shards (maybe in the
background, committed once every rank's are on disk) and rank 0 the other files. The files
themselves are ``train.checkpoint``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.checkpoints.load import checkpoint_dirs, latest_valid_checkpoint
from lmforge.core.config import to_dict
from lmforge.core.io import InputError
from lmforge.core.run import log, record_config
from lmforge.core.untrusted import read_yaml
from lmforge.distributed.checkpoint import is_sharded_checkpoint
from lmforge.distributed.mesh import ParallelContext
from lmforge.objectives.base import Objective
from lmforge.train.checkpoint import (
    PendingCheckpoint,
    ResumeState,
    commit_if_written,
    load_training_checkpoint,
    read_resume_state,
    remove_unfinished_checkpoints,
    save_sharded_training_checkpoint,
    save_training_checkpoint,
    set_aside_later_checkpoints,
)
from lmforge.train.ema import ModelAverage
from lmforge.train.guards import NonFiniteGuard
from lmforge.train.noise_scale import NoiseScale
from lmforge.train.spikes import SpikeEvent, SpikeGuard
from lmforge.train.step_log import StepLog

if TYPE_CHECKING:
    from lmforge.train.loop import TrainConfig


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


@dataclass
class TrainerState:
    """What a checkpoint's ``trainer_state.json`` holds beside the step: the state of the loop's
    stateful parts, under the file's keys."""

    loader: Any  # with state_dict() / load_state_dict()
    precision: str
    scaler: torch.amp.GradScaler | None
    spikes: SpikeGuard
    nonfinite: NonFiniteGuard
    tokens_seen: int = 0
    noise: NoiseScale | None = None  # the gradient noise scale's averages, when it is measured
    privacy: Any = None  # DP-SGD's accountant (train.dp.PrivacyPlan), in a dp run
    objective: Objective | None = None  # a stateful objective's state (DoReMi's domain weights)
    average: ModelAverage | None = None  # train.average's weights (their files beside the checkpoint's)

    def state_dict(self) -> dict:
        state = {"tokens_seen": self.tokens_seen, "loader": self.loader.state_dict(), "precision": self.precision,
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                 "spikes": self.spikes.state_dict(), "nonfinite_steps": self.nonfinite.total}
        if self.noise is not None:
            state["noise_scale"] = self.noise.state_dict()
        if self.privacy is not None:
            state["dp"] = self.privacy.state_dict()
        if self.objective is not None and (objective := self.objective.state_dict()) is not None:
            state["objective"] = objective
        if self.average is not None:
            state["average"] = self.average.state_dict()
        return state

    def load_state_dict(self, state: dict, rollback: bool = False) -> None:
        """A checkpoint's state (keys missing from older checkpoints take their start values); a
        rollback keeps the run's count of non-finite steps and its rollback history."""
        self.loader.load_state_dict(state["loader"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.spikes.load_state_dict(state.get("spikes"), rollback=rollback)
        self.tokens_seen = state.get("tokens_seen", 0)
        if self.noise is not None:
            self.noise.load_state_dict(state.get("noise_scale"))
        if self.privacy is not None and not rollback:  # the privacy of rolled-back steps stays spent
            self.privacy.load_state_dict(state.get("dp"))
        if self.objective is not None:
            self.objective.load_state_dict(state.get("objective"))
        if not rollback:
            self.nonfinite.total = state.get("nonfinite_steps", 0)


class Checkpointer:
    """The checkpoints of a single-process run in ``run_dir``."""

    is_first_rank = True  # the rank that finds checkpoints and writes the files beside the shards
    sharded_model = False  # a parallelized model, which resumes only from sharded checkpoints

    def __init__(self, run_dir: Path, cfg: TrainConfig, recipe: Any, tokenizer_dir: str | Path | None,
                 model: nn.Module, optimizer: torch.optim.Optimizer):
        self.run_dir, self.cfg, self.recipe, self.tokenizer_dir = Path(run_dir), cfg, recipe, tokenizer_dir
        self.model, self.optimizer = model, optimizer

    # what differs between a process and a rank of a distributed run
    def share(self, value: Any) -> Any:
        """The first rank's ``value``, on every rank."""
        return value

    def barrier(self) -> None:
        pass

    def write(self, step: int, trainer_state: dict, final: bool, average: ModelAverage | None = None) -> Path:
        extra = (lambda tmp: average.write_files(tmp, self.tokenizer_dir)) if average is not None else None
        path = save_training_checkpoint(self.run_dir, step, self.model, self.optimizer, trainer_state, self.recipe,
                                        self.tokenizer_dir, self.cfg.keep_checkpoints, write_extra=extra)
        log.info("step %d: checkpoint %s", step, path)
        return path

    def commit_written(self) -> None:
        """Commit the background saves that every rank has finished writing (none in one process)."""

    def commit_pending(self) -> None:
        """Wait for the background saves and commit them (none in one process)."""

    # the same for every checkpointer
    def find(self) -> tuple[Path, ResumeState] | None:
        """The checkpoint ``train.resume`` names and its verified state, after the first rank removed
        what a killed run was writing; every rank gets the first rank's choice."""
        if self.is_first_rank:
            remove_unfinished_checkpoints(self.run_dir)
        ckpt = resume_checkpoint(self.cfg, self.run_dir)
        if self.cfg.resume == "auto":
            ckpt = self.share(ckpt)
        return (ckpt, read_resume_state(ckpt)) if ckpt is not None else None

    def resume(self, found: tuple[Path, ResumeState] | None, state: TrainerState) -> int:
        """Restore ``found`` (``find``'s) into the model, optimizer and ``state``; set aside the
        checkpoints of an earlier history past it. Returns the step to start from."""
        start_step = 0
        if found is not None:
            ckpt, resume_state = found
            self.restore(ckpt, resume_state, state)
            start_step = resume_state.step
            log.info("resuming from %s (step %d)", ckpt, start_step)
            if self.is_first_rank:
                _log_recipe_changes(ckpt, self.recipe)
        if self.is_first_rank:
            aside = set_aside_later_checkpoints(self.run_dir, start_step)
            if aside is not None:
                log.warning("checkpoints past step %d of an earlier run (train.resume=%s) moved to %s",
                            start_step, self.cfg.resume, aside)
        self.barrier()
        return start_step

    def restore(self, ckpt: Path, resume_state: ResumeState, state: TrainerState, rollback: bool = False) -> None:
        """Load a checkpoint's weights, optimizer, RNGs and trainer state (resume, rollback)."""
        if is_sharded_checkpoint(ckpt):
            drop_empty_param_groups(self.optimizer)
        load_training_checkpoint(ckpt, resume_state, self.model, self.optimizer,
                                 sharded_model=self.sharded_model)
        state.load_state_dict(resume_state.trainer_state, rollback=rollback)
        if state.average is not None:
            state.average.load(ckpt, resume_state.trainer_state.get("average"))

    def due(self, done: int, final: bool) -> bool:
        """Whether to checkpoint after ``done`` steps; ``final``: the last step, or the run stops there."""
        return (self.cfg.checkpoint_every > 0 and done % self.cfg.checkpoint_every == 0) or final

    def save(self, step: int, state: TrainerState, final: bool) -> Path:
        """Checkpoint step ``step``; the run's config becomes the one its newest checkpoint was trained with."""
        path = self.write(step, state.state_dict(), final, state.average)
        if self.is_first_rank:
            record_config(self.recipe, self.run_dir)
        return path

    def roll_back(self, spike: SpikeEvent, state: TrainerState, step_log: StepLog, grad_accum: int) -> int | None:
        """Restore the newest checkpoint and make the loader skip the samples from it to ``spike``
        (``train.spikes.policy=rollback``); its step, or None when there is none (the update stays skipped)."""
        self.commit_pending()
        found = self.share(latest_valid_checkpoint(self.run_dir) if self.is_first_rank else None)
        if found is None:
            spike.action = "skipped"
            log.warning("step %d: no checkpoint to roll back to; skipping the update", spike.step)
            return None
        loader = state.loader
        spike_end, back = loader.samples, read_resume_state(found)
        self.restore(found, back, state, rollback=True)
        state.spikes.rolled_back(spike, back.step, loader, spike_end, grad_accum * loader.batch_size * loader.world_size)
        step_log.reopen(back.step, [event for event in state.spikes.rollbacks if event["step"] > back.step])
        return back.step


class ShardedCheckpointer(Checkpointer):
    """The checkpoints of a distributed run: DCP shards of every rank, the last one also with a
    gathered ``model.safetensors``; with ``parallel.async_checkpoint`` the others are written in
    the background and committed as soon as every rank's shards are on disk."""

    sharded_model = True

    def __init__(self, run_dir: Path, cfg: TrainConfig, recipe: Any, tokenizer_dir: str | Path | None,
                 model: nn.Module, optimizer: torch.optim.Optimizer, parallel: ParallelContext):
        super().__init__(run_dir, cfg, recipe, tokenizer_dir, model, optimizer)
        self.device = parallel.device
        self.is_first_rank = dist.get_rank() == 0
        self.async_group = dist.new_group(backend="gloo") if parallel.cfg.async_checkpoint else None
        self.pending: list[PendingCheckpoint] = []
        drop_empty_param_groups(optimizer)

    def share(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def write(self, step: int, trainer_state: dict, final: bool, average: ModelAverage | None = None) -> Path:
        self.commit_pending()  # ``average``: refused under torchrun (train.ema.build_average)  # the previous background save must be committed first
        save = save_sharded_training_checkpoint(
            self.run_dir, step, self.model, self.optimizer, trainer_state, self.recipe, self.tokenizer_dir,
            self.cfg.keep_checkpoints, with_weights=final, async_group=None if final else self.async_group)
        if save.future is None:
            path = save.commit()
            log.info("step %d: sharded checkpoint %s", step, path)
            return path
        self.pending.append(save)
        log.info("step %d: sharded checkpoint %s being written in the background", step, save.target)
        return save.target

    def commit_written(self) -> None:
        if self.pending and (committed := commit_if_written(self.pending, self.device)):
            log.info("checkpoint %s committed", committed)

    def commit_pending(self) -> None:
        while self.pending:
            log.info("checkpoint %s committed", self.pending.pop().commit())


def build_checkpointer(run_dir: Path, cfg: TrainConfig, recipe: Any, tokenizer_dir: str | Path | None,
                       model: nn.Module, optimizer: torch.optim.Optimizer,
                       parallel: ParallelContext | None = None) -> Checkpointer:
    if parallel is not None:
        return ShardedCheckpointer(run_dir, cfg, recipe, tokenizer_dir, model, optimizer, parallel)
    return Checkpointer(run_dir, cfg, recipe, tokenizer_dir, model, optimizer)


def drop_empty_param_groups(optimizer: torch.optim.Optimizer) -> None:
    """DCP's flattened optimizer state cannot hold or load an empty group (LoRA: no undecayed
    vectors), also when one process resumes a distributed run's checkpoint."""
    optimizer.param_groups = [group for group in optimizer.param_groups if group["params"]]


def _log_recipe_changes(ckpt: Path, recipe: Any) -> None:
    """Warn about each setting that differs from the recipe the checkpoint was written with."""
    saved_path = ckpt / "config.yaml"
    if recipe is None or not saved_path.is_file():
        return
    try:
        saved = read_yaml(saved_path)
    except (OSError, InputError):  # a damaged or hostile config.yaml: nothing to compare against
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
