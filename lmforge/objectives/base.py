"""What every training objective is: the one shape the training loop calls.

An objective turns a micro-batch into a summed loss and counts the targets the sum covers;
the loop divides each micro-batch's sum by the target count of the whole step, so every
target weighs the same however the step is split into micro-batches or ranks. A new
objective (a policy loss, a penalty, distillation) is one subclass of ``Objective`` here in
``objectives/``: the loop needs nothing else from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class LossOutput:
    """An objective's result on one micro-batch."""

    loss_sum: torch.Tensor  # summed loss over the micro-batch's targets (tokens, or sequences/pairs)
    n_targets: int  # how many targets the sum covers
    n_bytes: int | None = None  # UTF-8 bytes of those targets, for bits per byte (None: not counted)
    # Extra quantities summed over the same targets (e.g. DPO's chosen rewards); the loop logs
    # each as its mean per target, like the loss. Detached: they never reach the gradient.
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    # Quantities the loop logs as their maximum over the step's micro-batches and ranks (an RL
    # step's largest importance ratio, its longest response), detached like ``metrics``.
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective(ABC):
    """A loss over micro-batches of one format (token windows, SFT rows, preference pairs...)."""

    # Set by ``train.step.compile_objective``: a compiled objective keeps each batch at its padded
    # length rather than trimming the padding (``reference.trim_padding``), since every new length
    # would compile the graph again; the padding is masked, so the loss is the same.
    static_shapes: bool = False

    @abstractmethod
    def num_targets(self, batch: Any) -> int:
        """Targets ``__call__``'s loss sums over; the loop divides by their total over the step."""

    def num_tokens(self, batch: Any) -> int:
        """Tokens the model processes, for tokens/s and MFU: by default the targets."""
        return self.num_targets(batch)

    @abstractmethod
    def __call__(self, model: nn.Module, batch: Any) -> LossOutput:
        """The summed loss of ``batch`` under ``model`` (with gradient when grad mode is on)."""

    def state_dict(self) -> dict | None:
        """What a stateful objective (DoReMi's domain weights) keeps in a checkpoint's trainer state,
        so a resumed run continues it exactly; None: the objective has no state."""
        return None

    def load_state_dict(self, state: dict | None) -> None:
        """Restore ``state_dict()``'s ``state`` (None: the checkpoint holds none)."""
        if state is not None:
            raise ValueError(f"{type(self).__name__} has no state, but the checkpoint holds some for it")
