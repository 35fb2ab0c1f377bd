"""Finding a run's checkpoints and loading a model from one: what every verb calls to load "a
checkpoint or a run".

A path is a checkpoint directory of either kind (``model.safetensors``, see
``lmforge.checkpoints.files``, or a distributed run's DCP shards, read by
``lmforge.distributed.checkpoint``), a fine-tuning run's ``final/``, or a run directory, whose
newest ``checkpoints/step_N`` that verifies is used. A Hugging Face folder is refused with the
``lmforge import`` that converts it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.checkpoints.files import (
    MODEL_CONFIG,
    WEIGHTS,
    build_model,
    check_finite_state,
    check_finite_weights,
    load_model_config,
    read_weights,
    verify_checksums,
)
from lmforge.core.io import InputError
from lmforge.distributed.checkpoint import is_sharded_checkpoint, iter_model_state, read_model_state
from lmforge.model.reward import RewardModel, with_reward_head
from lmforge.model.transformer import Transformer


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where step ``step`` of the run ``run_dir`` is checkpointed (zero-padded: names sort by step)."""
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """A training run's ``checkpoints/step_N`` directories, oldest step first (N is zero-padded)."""
    return sorted((Path(run_dir) / "checkpoints").glob("step_*"))


def _weights_in_shards(directory: Path) -> bool:
    """Whether ``directory`` holds its weights only as a distributed run's DCP shards."""
    return not (directory / WEIGHTS).is_file() and is_sharded_checkpoint(directory)


def check_finite_checkpoint(directory: str | Path) -> None:
    """Refuse a checkpoint of either kind whose weights hold NaN or inf, reading one tensor (or,
    sharded, about a GiB) at a time; an ``InputError`` names the tensors."""
    directory = Path(directory)
    check_finite_weights(directory, iter_model_state(directory) if _weights_in_shards(directory) else None)


def read_checkpoint_weights(directory: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A checkpoint's weights by parameter name: ``model.safetensors``, or else the shards of a
    distributed (DCP) checkpoint, gathered in this process whatever layout wrote them. Weights
    holding NaN or inf are an ``InputError`` (a diverged run's: nothing to generate or export from)."""
    directory = Path(directory)
    if not _weights_in_shards(directory):
        return read_weights(directory, device)
    try:
        state = {k: v.to(device) for k, v in read_model_state(directory).items()}
    except InputError:
        raise
    except Exception as exc:  # DCP raises its own error types for truncated files
        raise InputError(f"{directory}: cannot read weights: {exc}") from exc
    check_finite_state(directory, state)
    return state


def latest_valid_checkpoint(run_dir: str | Path) -> Path | None:
    """Newest ``run_dir/checkpoints/step_*`` whose checksums verify and whose weights are finite;
    a corrupt or non-finite one is skipped with a warning."""
    from lmforge.core.run import log

    for candidate in reversed(checkpoint_dirs(run_dir)):
        try:
            verify_checksums(candidate)
            check_finite_checkpoint(candidate)
            return candidate
        except InputError as exc:
            log.warning("skipping checkpoint %s: %s", candidate, exc)
    return None


def resolve_checkpoint(path: str | Path, verify: bool = True) -> Path:
    """A checkpoint directory, a fine-tuning run's ``final/``, or the newest valid checkpoint of a
    run directory; with ``verify``, the one returned has had its checksums checked."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: not a checkpoint: the path does not exist (give a checkpoint directory or a run directory)")
    if (path / "config.json").is_file() and not (path / MODEL_CONFIG).is_file():
        raise InputError(f"{path}: a Hugging Face model folder, not an lmforge checkpoint; convert it first with "
                         f"`lmforge import {path} <checkpoint_dir>`")
    for direct in (path, path / "final"):  # final/: a fine-tuning run's finished (merged) model
        if (direct / WEIGHTS).is_file() or is_sharded_checkpoint(direct):
            if verify:
                verify_checksums(direct)
            return direct
    latest = latest_valid_checkpoint(path)
    if latest is None:
        raise InputError(f"{path}: not a checkpoint (no {WEIGHTS}) and no valid checkpoint under {path / 'checkpoints'}")
    return latest


def load_model(path: str | Path, device: str | torch.device = "cpu", verify: bool = True) -> tuple[Transformer, Path]:
    """Build the model saved at ``path`` (a checkpoint of either kind, or a run directory: see
    ``resolve_checkpoint``) and load its weights; return it, in evaluation mode (no dropout; the
    training loop turns training on), and the checkpoint directory used."""
    directory = resolve_checkpoint(path, verify)
    cfg = load_model_config(directory)
    model = build_model(cfg, read_checkpoint_weights(directory, device), str(directory), device)
    return model.eval(), directory


def load_reward_model(path: str | Path, device: str | torch.device = "cpu") -> RewardModel:
    """A reward model saved by ``lmforge reward`` (its ``final/`` directory or run directory)."""
    backbone, directory = load_model(path, device=device)
    return with_reward_head(backbone, directory, device)
