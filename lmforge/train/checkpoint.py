"""Training checkpoints: the model checkpoint plus everything needed to resume exactly.

``run_dir/checkpoints/step_00000100/`` holds the model files (see
``lmforge.checkpoints.files``) plus ``optimizer.pt``, ``rng.pt`` (torch RNG states),
``trainer_state.json`` (step, tokens seen, loader and loss-scaler state) and the
resolved ``config.yaml``. Each is written into a temporary directory that is renamed
into place, with checksums; only the newest ``keep`` checkpoints are kept.

A distributed run writes the model and optimizer as DCP shards instead (every rank its
own, maybe in the background) and rank 0 the rest; its last checkpoint also gets a
gathered ``model.safetensors`` for ``lmforge export``. Either kind resumes in any
layout the sharded one allows: a sharded checkpoint also resumes in a single process.

Weights are checked before every save: a checkpoint is never written from NaN or inf.
A background save is committed as soon as every rank's shards are on disk
(``commit_if_written``), and the temporary directories of a killed run's unfinished saves
are removed when the next run starts (``remove_unfinished_checkpoints``).

Finding a run's checkpoints and loading a model from one (``resolve_checkpoint``,
``load_model``) are ``lmforge.checkpoints.load``'s.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lmforge.checkpoints.files import (
    WEIGHTS,
    load_weights,
    nonfinite_weights,
    read_weights,
    verify_checksums,
    write_checksums,
    write_model_config,
    write_model_files,
)
from lmforge.checkpoints.load import check_finite_checkpoint, checkpoint_dir, checkpoint_dirs
from lmforge.core.config import save_config
from lmforge.core.io import (
    InputError,
    atomic_directory,
    atomic_write_json,
    reading,
    remove_temporaries,
    replace_directory,
    temporary_directory,
)
from lmforge.core.run import RunDiverged
from lmforge.distributed.checkpoint import is_sharded_checkpoint, load_sharded, read_model_state, save_sharded
from lmforge.model.transformer import Transformer

OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
TRAINER_STATE = "trainer_state.json"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_training_checkpoint(
    run_dir: Path,
    step: int,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    recipe: Any,
    tokenizer_dir: str | Path | None,
    keep: int,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """``write_extra(directory)`` adds files of its own (``train.ema``'s average) before the checksums."""
    target = checkpoint_dir(run_dir, step)
    refuse_nonfinite_weights(model, target)
    with atomic_directory(target) as tmp:
        write_model_files(tmp, model, tokenizer_dir)
        if write_extra is not None:
            write_extra(tmp)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        torch.save(rng_state(), tmp / RNG)
        atomic_write_json(tmp / TRAINER_STATE, {"step": step, **trainer_state, "python_random": _py_random_state()})
        save_config(recipe, tmp)
        write_checksums(tmp)
    prune_checkpoints(run_dir, keep)
    return target


def refuse_nonfinite_weights(model: torch.nn.Module, target: Path, distributed: bool = False) -> None:
    """Raise ``RunDiverged`` instead of writing ``target`` when a weight holds NaN or inf
    (``distributed``: on any rank; every rank calls this and gets the same verdict)."""
    local = [(k, v.to_local() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()]
    bad = nonfinite_weights((k, v.detach()) for k, v in local)
    count = len(bad)
    if distributed:
        total = torch.tensor(float(count), device=next(model.parameters()).device)
        dist.all_reduce(total)
        count = int(total.item())
    if count:
        names = ", ".join(bad[:3]) or "on another rank"
        raise RunDiverged(
            f"step {int(target.name.removeprefix('step_'))}: the weights hold non-finite values ({names}); checkpoint "
            f"{target} not written. Resume from the last checkpoint with a lower train.lr or more train.warmup_steps")


def remove_unfinished_checkpoints(run_dir: Path) -> list[Path]:
    """Remove what a killed run of ``run_dir`` was writing (temporary checkpoint directories, a
    fine-tuning run's ``final/``, its summary), with a log line; call it before the run writes."""
    from lmforge.core.run import log

    removed = remove_temporaries(Path(run_dir) / "checkpoints") + remove_temporaries(run_dir)
    if removed:
        log.info("removed %d temporary files and directories a killed run left in %s: %s", len(removed), run_dir,
                 ", ".join(str(p.relative_to(run_dir)) for p in removed))
    return removed


def _py_random_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the ``keep`` (>= 1, as ``TrainConfig`` checks) newest checkpoints, by step."""
    ckpts = checkpoint_dirs(run_dir)
    for old in ckpts[: max(0, len(ckpts) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def set_aside_later_checkpoints(run_dir: Path, step: int) -> Path | None:
    """Move checkpoints of ``run_dir`` past ``step`` into ``checkpoints.superseded-<time>/``.

    A run that starts over (``train.resume=never``) or from an earlier checkpoint begins a new
    history; checkpoints of the old one past its start would otherwise outrank its own (pruning
    and ``resume=auto`` go by step). They are kept, not deleted: return where they went.
    """
    later = [p for p in checkpoint_dirs(run_dir) if p.name > checkpoint_dir(run_dir, step).name]  # zero-padded
    if not later:
        return None
    aside = Path(run_dir) / f"checkpoints.superseded-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(parents=True, exist_ok=True)
    for path in later:
        path.rename(aside / path.name)
    return aside


@dataclass
class ResumeState:
    step: int
    trainer_state: dict  # tokens seen, loader, precision, loss scaler
    python_random: list


def read_resume_state(ckpt: Path) -> ResumeState:
    """Verify a training checkpoint's checksums and finite weights and read its ``trainer_state.json``,
    the one read of it: the loop chooses its precision from it, then ``load_training_checkpoint``."""
    verify_checksums(ckpt)
    check_finite_checkpoint(ckpt)
    with reading(ckpt / TRAINER_STATE):
        state = json.loads((ckpt / TRAINER_STATE).read_text())
        return ResumeState(step=state.pop("step"), python_random=state.pop("python_random"), trainer_state=state)


def load_training_checkpoint(ckpt: Path, state: ResumeState, model: Transformer, optimizer: torch.optim.Optimizer,
                             sharded_model: bool = False) -> None:
    """Restore the weights, optimizer and RNG states of ``ckpt``, whose ``state`` ``read_resume_state``
    gave, in place.

    A sharded (DCP) checkpoint loads into any layout, a single process included;
    ``sharded_model`` (a parallelized model) needs one."""
    device = next(model.parameters()).device
    if is_sharded_checkpoint(ckpt):
        load_sharded(ckpt, model, optimizer)
    elif sharded_model:
        raise InputError(f"{ckpt}: written by a single-process run, which a distributed run cannot resume; "
                         "resume it in one process, or start over with train.resume=never")
    else:
        try:
            load_weights(model, read_weights(ckpt, device), where=str(ckpt))
        except InputError as exc:
            raise InputError(f"{exc}; to train a different model, use a new run_dir or train.resume=never") from exc
        with reading(ckpt / OPTIMIZER):
            optimizer_state = torch.load(ckpt / OPTIMIZER, map_location=device, weights_only=True)
        optimizer.load_state_dict(optimizer_state)
    with reading(ckpt / RNG):
        rng = torch.load(ckpt / RNG, weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    version, internal, gauss = state.python_random
    random.setstate((version, tuple(internal), gauss))


@dataclass
class PendingCheckpoint:
    """A sharded checkpoint whose shards are written (or being written in the background);
    ``commit()`` waits for them, lets rank 0 add the other files and renames it into place."""

    tmp: Path
    target: Path
    future: Future | None
    files: dict = field(default_factory=dict)  # what rank 0 writes beside the shards, captured at save time

    def commit(self) -> Path:
        if self.future is not None:
            self.future.result()
        dist.barrier()
        if dist.get_rank() == 0:
            f = self.files
            if f["with_weights"]:  # the single-file format lmforge export / generate / sft read
                from safetensors.torch import save_file

                weights = read_model_state(self.tmp)
                if f["model_cfg"].tie_embeddings:
                    weights.pop("lm_head.weight", None)
                save_file({k: v.contiguous() for k, v in weights.items()}, str(self.tmp / WEIGHTS),
                          metadata={"format": "pt"})
            write_model_config(self.tmp, f["model_cfg"], f["tokenizer_dir"])
            torch.save(f["rng"], self.tmp / RNG)
            atomic_write_json(self.tmp / TRAINER_STATE, f["trainer_state"])
            save_config(f["recipe"], self.tmp)
            write_checksums(self.tmp)
            replace_directory(self.tmp, self.target)
            prune_checkpoints(self.target.parent.parent, f["keep"])
        dist.barrier()
        return self.target


def save_sharded_training_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    recipe: Any,
    tokenizer_dir: str | Path | None,
    keep: int,
    *,
    with_weights: bool,
    async_group=None,
) -> PendingCheckpoint:
    """Every rank writes its shards into one temporary directory (named by rank 0); with
    ``async_group`` in the background. Call ``commit()`` on the result (every rank)."""
    target = checkpoint_dir(run_dir, step)
    refuse_nonfinite_weights(model, target, distributed=True)
    name = [None]
    if dist.get_rank() == 0:
        name = [str(temporary_directory(target))]
    dist.broadcast_object_list(name, src=0)
    tmp = Path(name[0])
    future = save_sharded(tmp, model, optimizer, async_group)
    files = {"with_weights": with_weights, "model_cfg": model.cfg, "tokenizer_dir": tokenizer_dir, "rng": rng_state(),
             "trainer_state": {"step": step, **trainer_state, "python_random": _py_random_state()},
             "recipe": recipe, "keep": keep}
    return PendingCheckpoint(tmp, target, future, files)


def commit_if_written(pending: list[PendingCheckpoint], device: torch.device) -> Path | None:
    """Commit the background checkpoint in ``pending`` once every rank's shards are on disk (not
    only at the next checkpoint, so a crash loses no more than the steps since); one all-reduce
    of a flag while a save is pending. Every rank calls this after each step."""
    if not pending:
        return None
    future = pending[0].future
    written = torch.tensor(float(future is None or future.done()), device=device)
    dist.all_reduce(written, op=dist.ReduceOp.MIN)
    return pending.pop(0).commit() if written.item() == 1.0 else None
