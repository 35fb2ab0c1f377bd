"""The loop's two stop rules beside ``max_steps``: too many non-finite steps in a row
(``train.max_nonfinite_steps``) and the time limits (``train.max_minutes``, ``train.stop_at_step``).
The loss-spike guard is ``train.spikes``."""

from __future__ import annotations

import time

import torch

from lmforge.core.run import RunDiverged, log


class NonFiniteGuard:
    """Counts the steps whose loss or gradient norm was NaN/inf (the step runner skipped each
    update) and stops the run after ``max_in_a_row`` of them in a row. ``total`` goes into
    the checkpoint's trainer state and the summary."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.total = 0
        self.in_a_row = 0

    def observe(self, step: int, skipped: bool, loss: float, grad_norm: torch.Tensor) -> None:
        """After step ``step`` (1-based); raises ``RunDiverged`` once too many in a row were skipped."""
        self.total += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped:
            log.warning("step %d: loss %s, gradient norm %s: optimizer step skipped", step, loss, float(grad_norm))
        if self.in_a_row >= self.max_in_a_row:
            raise RunDiverged(
                f"non-finite loss or gradient norm for {self.in_a_row} steps in a row, each skipped (step "
                f"{step}: loss {loss}, gradient norm {float(grad_norm)}); lower train.lr, raise "
                f"train.warmup_steps, or resume from the last checkpoint"
            )


class TimeLimit:
    """``max_minutes`` of wall time from now, and ``stop_at_step``: where a run stops early, with
    a checkpoint (the schedule still spans ``max_steps``); either None is no limit."""

    def __init__(self, max_minutes: float | None, stop_at_step: int | None):
        self.max_minutes, self.stop_at_step = max_minutes, stop_at_step
        self.start = time.perf_counter()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def reached(self, done: int) -> bool:
        """Whether the run stops after ``done`` steps."""
        return (self.max_minutes is not None and self.elapsed_s() / 60 >= self.max_minutes) or (
            self.stop_at_step is not None and done >= self.stop_at_step)
