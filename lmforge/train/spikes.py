"""Loss spikes: detect them, and warn, skip the update, or roll back and skip the batches.

A step's loss is a spike when its z-score against the losses of the last ``window``
accepted steps, ``z = (loss - mean) / std`` (sample standard deviation), exceeds
``threshold`` once ``min_observations`` losses are in the window. OLMo-core's
``SkipStepOptimizer`` skips such a step at 6 sigma over a window of 128 (it acts after
``max(20, window // 2)`` losses); PaLM (Chowdhery et al. 2022, sec. 5.1) restarted from a
checkpoint about 100 steps before a spike and skipped some 200-500 batches. Policies:

- ``warn``: log the event; the update is applied and its loss enters the window.
- ``skip``: the update is not applied (the gradients are dropped; AdamW's moments and step
  count stay as they were). The step still consumes its step number and its batches, so the
  learning-rate schedule and the data order are those of a run without the spike.
- ``rollback``: restore the newest checkpoint (weights, optimizer, loader, spike window),
  make the loader skip every sample served from it up to the spike's step inclusive (plus
  ``skip_steps_after`` more steps' worth), and continue. The skipped ranges are part of the
  loader state, so the run is the one whose loader never served those samples. A spike with
  no checkpoint before it, past ``max_rollbacks``, or during the replay of a rolled-back
  stretch (the model, not the data, is then to blame) is skipped instead.

A spiking loss never enters the window under ``skip``/``rollback``; ``max_consecutive``
spikes in a row mean the loss moved to a new level rather than spiked, so the window
starts over. Each event is a console line, a ``metrics.jsonl`` record
(``"event": "loss_spike"``) and a row of the run report.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lmforge.core.config import at_least, check_ranges, option, positive
from lmforge.core.run import log

EVENT = "loss_spike"


@dataclass
class SpikeConfig:
    """``train.spikes``: the loss-spike detector and what it does on a spike (off by default)."""

    policy: Literal["off", "warn", "skip", "rollback"] = option(
        "off",
        help="on a spike: off (no detection), warn, skip the update, or rollback to the newest checkpoint "
        "and skip its batches",
    )
    window: int = at_least(2, 128, help="accepted step losses the mean and standard deviation are taken over")
    threshold: float = positive(6.0, help="a spike: this many standard deviations above the window's mean")
    min_observations: int = at_least(2, 64, help="losses in the window before any step is judged")
    max_consecutive: int = positive(10, help="spikes in a row that restart the window (a new loss level, not a spike)")
    max_rollbacks: int = at_least(0, 3, help="per run; later spikes are skipped")
    skip_steps_after: int = at_least(0, 0, help="rollback: also skip the batches of this many steps after the spike")

    def __post_init__(self) -> None:
        check_ranges(self, "train.spikes.")
        if self.min_observations > self.window:
            raise ValueError(f"train.spikes.min_observations = {self.min_observations} must be at most "
                             f"train.spikes.window = {self.window}")


def z_score(history: list[float], loss: float) -> tuple[float, float, float]:
    """``(z, mean, std)`` of ``loss`` against ``history`` (at least two losses), with the sample
    standard deviation; a constant history makes any higher loss infinitely far above it."""
    mean = math.fsum(history) / len(history)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in history) / (len(history) - 1))
    if std > 0:
        return (loss - mean) / std, mean, std
    return (math.inf if loss > mean else 0.0), mean, std


@dataclass
class SpikeDetector:
    """The rolling window of accepted losses and the decision on the next one."""

    window: int
    threshold: float
    min_observations: int
    max_consecutive: int
    losses: deque = field(default_factory=deque)
    consecutive: int = 0  # spikes in a row so far

    def judge(self, loss: float) -> tuple[float, float, float] | None:
        """``(z, mean, std)`` when ``loss`` is a spike (it is then left out of the window),
        else None (``loss`` joins it). A non-finite loss is not judged: the loop stops on it."""
        if not math.isfinite(loss):
            return None
        if len(self.losses) >= self.min_observations:
            z, mean, std = z_score(list(self.losses), loss)
            if z > self.threshold:
                self.consecutive += 1
                if self.consecutive >= self.max_consecutive:
                    log.warning("%d loss spikes in a row: the loss moved to a new level; the spike window "
                                "starts over", self.consecutive)
                    self.losses.clear()
                    self.consecutive = 0
                return z, mean, std
        self.accept(loss)
        return None

    def accept(self, loss: float) -> None:
        self.consecutive = 0
        self.losses.append(loss)
        while len(self.losses) > self.window:
            self.losses.popleft()

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(float(x) for x in state["losses"][-self.window:])
        self.consecutive = int(state["consecutive"])


@dataclass
class SpikeEvent:
    """One spike and what was done about it (``action``: warned, skipped or rolled_back)."""

    step: int  # 1-based, as metrics.jsonl counts steps
    loss: float
    z: float
    mean: float
    std: float
    policy: str
    action: str
    rollback_to: int | None = None  # the checkpoint's step
    skipped_samples: list[int] | None = None  # [start, stop) of the loader's global samples

    def record(self) -> dict:
        """The ``metrics.jsonl`` record; its keys do not clash with a step's (``loss``...)."""
        out = {"step": self.step, "event": EVENT, "policy": self.policy, "action": self.action,
               "spike_loss": self.loss, "spike_z": self.z, "window_mean": self.mean, "window_std": self.std}
        if self.rollback_to is not None:
            out.update(rollback_to=self.rollback_to, skipped_samples=self.skipped_samples)
        return out

    def line(self) -> str:
        text = (f"step {self.step}: loss spike {self.loss:.4f} ({self.z:.1f} sigma above the mean "
                f"{self.mean:.4f} +- {self.std:.4f})")
        if self.action == "rolled_back":
            start, stop = self.skipped_samples
            return f"{text}: rolled back to step {self.rollback_to}, skipping samples [{start}, {stop})"
        return f"{text}: {'update skipped' if self.action == 'skipped' else 'update applied'}"


class SpikeGuard:
    """The loop's side of ``train.spikes``: judges each step's loss before its update and
    carries out the policy; its ``state_dict`` goes into the checkpoint's trainer state."""

    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self.detector = SpikeDetector(cfg.window, cfg.threshold, cfg.min_observations, cfg.max_consecutive)
        self.rollbacks: list[dict] = []  # the metrics records of the rollbacks of this run
        self.event: SpikeEvent | None = None

    def check_loader(self, loader: Any) -> None:
        if self.cfg.policy == "rollback" and not hasattr(loader, "skip_samples"):
            raise ValueError(f"train.spikes.policy=rollback needs a loader that can skip samples "
                             f"({type(loader).__name__} cannot); use skip or warn")

    def accept(self, step: int) -> Callable[[torch.Tensor], bool] | None:
        """What ``train_step`` asks before applying step ``step``'s update (0-based); None when off."""
        if self.cfg.policy == "off":
            return None
        return lambda loss: self.judge(step + 1, float(loss))

    def judge(self, step: int, loss: float) -> bool:
        """Whether step ``step``'s update is applied; a spike leaves its event for ``take_event``."""
        spike = self.detector.judge(loss)
        if spike is None:
            return True
        policy = self.cfg.policy
        action = {"warn": "warned", "skip": "skipped", "rollback": "rolled_back"}[policy]
        if action == "rolled_back" and not self.can_roll_back(step):
            action = "skipped"
        if action == "warned":
            self.detector.accept(loss)
        self.event = SpikeEvent(step, loss, *spike, policy=policy, action=action)
        return action == "warned"

    def can_roll_back(self, step: int) -> bool:
        if len(self.rollbacks) >= self.cfg.max_rollbacks:
            log.warning("step %d: loss spike after %d rollbacks (train.spikes.max_rollbacks): skipping the update",
                        step, len(self.rollbacks))
            return False
        if self.rollbacks and step <= self.rollbacks[-1]["step"]:
            log.warning("step %d: loss spike again while replaying after the rollback at step %d: skipping the "
                        "update", step, self.rollbacks[-1]["step"])
            return False
        return True

    def take_event(self) -> SpikeEvent | None:
        event, self.event = self.event, None
        return event

    def rolled_back(self, event: SpikeEvent, checkpoint_step: int, loader: Any, spike_samples_end: int,
                    samples_per_step: int) -> None:
        """After the checkpoint is restored into ``loader`` (and everything else): skip the samples
        from it to the spike (and ``skip_steps_after`` steps beyond) and every earlier rollback's."""
        start, stop = loader.samples, spike_samples_end + self.cfg.skip_steps_after * samples_per_step
        event.rollback_to, event.skipped_samples = checkpoint_step, [start, stop]
        self.rollbacks.append(event.record())
        for r in self.rollbacks:
            loader.skip_samples(*r["skipped_samples"])

    def state_dict(self) -> dict:
        return {"detector": self.detector.state_dict(), "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict | None, rollback: bool = False) -> None:
        """A checkpoint's spike state (none in one written with spikes off or before they existed);
        a rollback restores the window only and keeps the run's rollback history."""
        if not state:
            self.detector.losses.clear()
            self.detector.consecutive = 0
            return
        self.detector.load_state_dict(state["detector"])
        if not rollback:
            self.rollbacks = list(state["rollbacks"])


def report_lines(records: list[dict]) -> list[str]:
    """The run report's table of loss-spike events from ``metrics.jsonl`` records (none: no lines)."""
    events = [r for r in records if r.get("event") == EVENT]
    if not events:
        return []
    lines = ["", "| step | loss spike | z | window mean ± std | policy | action |", "|---|---|---|---|---|---|"]
    for r in events:
        action = r["action"].replace("_", " ")
        if r.get("rollback_to") is not None:
            start, stop = r["skipped_samples"]
            action += f" to step {r['rollback_to']}, samples [{start}, {stop}) skipped"
        lines.append(f"| {r['step']} | {r['spike_loss']:.4f} | {r['spike_z']:.1f} | {r['window_mean']:.4f} ± "
                     f"{r['window_std']:.4f} | {r['policy']} | {action} |")
    return lines


class StepRange:
    """``range(start, stop)`` over step numbers that a rollback can rewind."""

    def __init__(self, start: int, stop: int):
        self.next, self.stop = start, stop

    def __iter__(self) -> StepRange:
        return self

    def __next__(self) -> int:
        if self.next >= self.stop:
            raise StopIteration
        self.next += 1
        return self.next - 1

    def rewind(self, step: int) -> None:
        """The next step is ``step`` (0-based: the step after the checkpoint at ``step``)."""
        self.next = step
