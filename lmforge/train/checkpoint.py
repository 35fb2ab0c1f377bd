"""Training checkpoints: the model checkpoint plus everything needed to resume exactly.

``run_dir/checkpoints/step_00000100/`` holds the model files (see
``lmforge.model.checkpoint``) plus ``optimizer.pt``, ``rng.pt`` (torch RNG states),
``trainer_state.json`` (step, tokens seen, loader and loss-scaler state) and the
resolved ``config.yaml``. Each is written into a temporary directory that is renamed
into place, with checksums; only the newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmforge.core.config import save_config
from lmforge.core.io import atomic_directory, atomic_write_json
from lmforge.model.checkpoint import load_weights, verify_checksums, write_checksums, write_model_files
from lmforge.model.transformer import Transformer

OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
TRAINER_STATE = "trainer_state.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


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
) -> Path:
    target = checkpoint_dir(run_dir, step)
    with atomic_directory(target) as tmp:
        write_model_files(tmp, model, tokenizer_dir)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        torch.save(rng_state(), tmp / RNG)
        atomic_write_json(tmp / TRAINER_STATE, {"step": step, **trainer_state, "python_random": _py_random_state()})
        save_config(recipe, tmp)
        write_checksums(tmp)
    prune_checkpoints(run_dir, keep)
    return target


def _py_random_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    ckpts = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
    for old in ckpts[: max(0, len(ckpts) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class ResumeState:
    step: int
    trainer_state: dict


def load_training_checkpoint(ckpt: Path, model: Transformer, optimizer: torch.optim.Optimizer) -> ResumeState:
    """Restore weights, optimizer and RNG states in place; return the step and trainer state."""
    from safetensors.torch import load_file

    verify_checksums(ckpt)
    device = next(model.parameters()).device
    load_weights(model, load_file(str(ckpt / "model.safetensors"), device=str(device)), where=str(ckpt))
    optimizer.load_state_dict(torch.load(ckpt / OPTIMIZER, map_location=device, weights_only=True))
    rng = torch.load(ckpt / RNG, weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    state = json.loads((ckpt / TRAINER_STATE).read_text())
    version, internal, gauss = state.pop("python_random")
    random.setstate((version, tuple(internal), gauss))
    return ResumeState(step=state.pop("step"), trainer_state=state)
