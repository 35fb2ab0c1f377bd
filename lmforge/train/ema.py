"""Checkpoint averaging during training (``train.average``): an exponential moving average of the
weights, or the uniform average of the weights after each of the run's last N steps.

- ``ema``: θ̄_0 = θ_0 and θ̄_t = β·θ̄_{t−1} + (1 − β)·θ_t after each optimizer step t (Polyak
  averaging as an EMA; Sanyal et al. 2023, "Early Weight Averaging meets High Learning Rates for
  LLM Pre-training", find such averages of a high-rate run match a decayed one early).
- ``last_n``: (1/N)·Σ_{t = T−N+1}^{T} θ_t over the last N of T = ``max_steps`` steps, the average
  OLMo-core's model-merging callback keeps before its merge step (averaging checkpoints of the
  stable phase of a WSD schedule stands in for its decay).

The running state (θ̄, or the sum of the window so far, in float32) is ``average.safetensors`` in
each checkpoint, so a resumed run continues it exactly; ``average/`` beside it is the averaged
model as a checkpoint of its own, which every verb that takes a checkpoint loads
(``lmforge eval checkpoint=runs/x/checkpoints/step_00000300/average``). At the run's end the loop
validates the average too (``average/val_loss`` beside ``val_loss``). One process only so far.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lmforge.checkpoints.files import model_state_for_saving, write_checksums, write_model_config
from lmforge.core.config import ConfigError, option, positive, unit_interval
from lmforge.core.io import InputError, reading
from lmforge.core.run import log

STATE_FILE = "average.safetensors"
MODEL_DIR = "average"


@dataclass
class AverageConfig:
    """Which average of the weights the run keeps beside its own."""

    method: Literal["ema", "last_n"] = option(
        "ema", help="ema: θ̄ ← decay·θ̄ + (1 − decay)·θ after every step; last_n: the mean of the weights after each of "
        "the run's last `last_n` steps (OLMo-core's model merging)"
    )
    decay: float = unit_interval(0.99, low_open=True, high_open=True, help="ema: β, the old average's weight per step")
    last_n: int = positive(100, help="last_n: steps averaged, the last of the run (at most train.max_steps)")


class ModelAverage:
    """The average of ``model``'s trainable parameters over a run of ``max_steps`` steps."""

    def __init__(self, model: nn.Module, cfg: AverageConfig, max_steps: int):
        if cfg.method == "last_n" and cfg.last_n > max_steps:
            raise ConfigError(f"train.average.last_n = {cfg.last_n} averages more steps than the run has "
                              f"(train.max_steps = {max_steps}): set it to at most {max_steps}")
        self.model, self.cfg, self.max_steps = model, cfg, max_steps
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.updates = 0  # steps averaged so far
        self.state = self.start_state()

    def start_state(self) -> list[torch.Tensor]:
        """θ̄_0 = θ_0 for the EMA; an empty sum for the window."""
        if self.cfg.method == "ema":
            return [p.detach().float().clone() for p in self.params]
        return [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

    @property
    def first_step(self) -> int:
        """The first step (1-based) whose weights enter the average."""
        return 1 if self.cfg.method == "ema" else self.max_steps - self.cfg.last_n + 1

    @torch.no_grad()
    def update(self, done: int) -> None:
        """Fold in the weights after step ``done`` (1-based)."""
        if done < self.first_step:
            return
        current = [p.detach().float() for p in self.params]
        if self.cfg.method == "ema":
            torch._foreach_lerp_(self.state, current, 1.0 - self.cfg.decay)  # θ̄ + (1 − β)(θ − θ̄)
        else:
            torch._foreach_add_(self.state, current)
        self.updates += 1

    def ready(self) -> bool:
        """Whether there is an average to use (a ``last_n`` window has begun)."""
        return self.cfg.method == "ema" or self.updates > 0

    def averaged(self) -> list[torch.Tensor]:
        """The averaged parameters, in ``self.names``' order (float32)."""
        if self.cfg.method == "ema":
            return self.state
        return [s / self.updates for s in self.state]

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """The model holds the averaged weights inside the block, its own again after it."""
        own = [p.detach().clone() for p in self.params]
        for p, a in zip(self.params, self.averaged()):
            p.copy_(a)
        try:
            yield
        finally:
            for p, o in zip(self.params, own):
                p.copy_(o)

    # -- checkpoint
    def state_dict(self) -> dict:
        return {"method": self.cfg.method, "decay": self.cfg.decay, "last_n": self.cfg.last_n, "updates": self.updates}

    def write_files(self, directory: Path, tokenizer_dir: str | Path | None) -> None:
        """Into a checkpoint being written: the running state, and the averaged model as ``average/``."""
        save_file({n: s.contiguous().cpu() for n, s in zip(self.names, self.state)}, str(directory / STATE_FILE))
        if not self.ready():
            return
        with self.swapped_in():
            weights = {k: v.cpu().clone() for k, v in model_state_for_saving(self.model).items()}  # not views
        out = directory / MODEL_DIR
        out.mkdir()
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        write_model_config(out, self.model.cfg, tokenizer_dir)
        write_checksums(out)

    @torch.no_grad()
    def load(self, ckpt: Path, saved: dict | None) -> None:
        """Continue from the state ``ckpt`` holds (``saved``: its ``trainer_state``'s ``average``); a
        checkpoint written without averaging, or with other settings, starts the average afresh there."""
        path = ckpt / STATE_FILE
        if saved is None or not path.is_file():
            log.warning("train.average: %s holds no average; it starts from this step's weights", ckpt)
            self.updates, self.state = 0, self.start_state()
            return
        if (saved["method"], saved["decay"], saved["last_n"]) != (self.cfg.method, self.cfg.decay, self.cfg.last_n):
            raise InputError(f"{ckpt}: its average was kept with method={saved['method']}, decay={saved['decay']}, "
                             f"last_n={saved['last_n']}, this run's train.average differs: keep the checkpoint's "
                             "settings, or use a new run_dir or train.resume=never")
        with reading(path):
            tensors = load_file(str(path), device=str(self.params[0].device))
        if sorted(tensors) != sorted(self.names):
            raise InputError(f"{path}: holds the average of other parameters than this model's trainable ones")
        self.state = [tensors[n] for n in self.names]
        self.updates = int(saved["updates"])


def check_average(cfg: AverageConfig | None, distributed: bool) -> None:
    """Refuse ``train.average`` under ``torchrun`` (a stage calls this before any work)."""
    if cfg is not None and distributed:
        raise ConfigError("train.average keeps its average in one process so far: launch without torchrun, or "
                          "remove train.average (average finished checkpoints with `lmforge merge` instead)")


def build_average(cfg: AverageConfig | None, model: nn.Module, max_steps: int, distributed: bool) -> ModelAverage | None:
    """The run's ``ModelAverage`` (None without ``train.average``); refused under ``torchrun``."""
    check_average(cfg, distributed)
    return ModelAverage(model, cfg, max_steps) if cfg is not None else None
