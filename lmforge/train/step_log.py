"""What the loop reports about each step: the record that goes to ``metrics.jsonl`` (and
TensorBoard and the trackers of ``train.loggers``) on the logging rank, the progress bar and
console lines, and the throughput and MFU averages of the run's summary."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from lmforge.core.run import log, progress_bar
from lmforge.train.forward import DTYPES
from lmforge.train.metrics import PEAK_ENV, MetricsLogger, is_domain_loss, peak_flops, peak_memory_bytes, utilization
from lmforge.train.step import StepResult

# objective metrics worth a place on the console line (all of them go to metrics.jsonl): the
# preference objectives' margin and accuracy, KTO's KL baseline and DPO's kl_k1; RL's mean reward
# and KL to the reference (GRPO's kl_ref, with objective.kl_coef > 0; PPO's kl, the KL in its reward)
CONSOLE_METRICS = ("margin", "accuracy", "kl", "kl_k1", "reward_mean", "kl_ref")


class NoMetrics:
    """The metrics of ranks other than 0: nothing is written."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class StepLog:
    """The records of one run. Each step's carries its wall-clock ``time`` (unix seconds) and
    ``elapsed_s`` since the run (re)started. ``resume_step``: the step resumed from (the records past it are
    dropped from ``metrics.jsonl``), None for a fresh run. ``flops_per_token`` (the model's)
    turns throughput into MFU against the measured peak of ``device`` in ``precision``.
    ``loggers`` (``train.loggers``) get the records' scalars and ``config`` once."""

    def __init__(self, run_dir: Path, tensorboard: bool, logging_rank: bool, resume_step: int | None,
                 max_steps: int, log_every: int, device: torch.device, precision: str, world_size: int,
                 flops_per_token: float | None, loggers: list[str] | tuple[str, ...] = (), config: dict | None = None):
        self.run_dir, self.tensorboard, self.logging_rank = run_dir, tensorboard, logging_rank
        self.loggers, self.config = loggers, config  # train.loggers, and the resolved recipe they get once
        self.max_steps, self.log_every, self.device, self.precision = max_steps, log_every, device, precision
        self.world_size, self.flops_per_token = world_size, flops_per_token
        self.metrics = self.open_metrics(resume_step)
        self.peak = peak_flops(device, DTYPES[precision]) if flops_per_token and logging_rank else None
        self.bar, self.start_step = tqdm(disable=True), 0
        self.started = time.time()  # when the run (re)started: the records' elapsed_s counts from here
        self.first_step_done: float | None = None  # perf_counter at the end of the first step, for the ETA
        self.tok_rates: list[float] = []
        self.mfus: list[float] = []
        self.phase_sums: dict[str, float] = {}  # seconds per phase of a step (``time/<phase>_s``), for the averages

    def open_metrics(self, resume_step: int | None) -> MetricsLogger | NoMetrics:
        if not self.logging_rank:
            return NoMetrics()
        return MetricsLogger(self.run_dir, self.tensorboard, resume_step, self.loggers, self.config)

    def start(self, start_step: int) -> None:
        """The progress bar of the steps from ``start_step``."""
        self.start_step, self.started, self.first_step_done = start_step, time.time(), None
        if self.logging_rank:
            self.bar = progress_bar(self.max_steps, "training", unit="step", initial=start_step)

    def reopen(self, step: int, events: list[dict]) -> None:
        """After a rollback to the checkpoint at ``step``: the records past it are dropped, except
        ``events`` (the rollbacks, which stay on record)."""
        self.metrics.close()
        self.metrics = self.open_metrics(step)
        for event in events:
            self.metrics.log(event)

    def event(self, record: dict) -> None:
        self.metrics.log(record)

    def record(self, step: int, result: StepResult, loss: float, lr: float, started: float, n_tokens: int,
               tokens_seen: int, nonfinite_steps: int, timings: dict[str, float] | None = None) -> dict:
        """The record of step ``step`` (0-based), which began at ``time.perf_counter()`` ``started``.
        Its ``time/<phase>_s`` split the step's seconds: ``batches`` (drawing the micro-batches, with
        the phases of ``timings`` inside it, e.g. RL's ``rollout``), ``forward_backward`` (with
        gradient clipping) and ``optimizer`` (the rest: the update, logging)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        dt = now - started
        if step == self.start_step:
            self.first_step_done = now
        wall = time.time()
        record = {"step": step + 1, "time": wall, "elapsed_s": wall - self.started,  # wall clock, for time plots
                  "loss": loss, "lr": lr, "grad_norm": float(result.grad_norm),
                  "tokens": tokens_seen, "targets": result.n_targets, "tokens_per_s": n_tokens / dt, "step_s": dt,
                  "memory_bytes": peak_memory_bytes(self.device), "nonfinite_steps": nonfinite_steps}
        timings = dict(timings or {})
        batches = timings.pop("batches", 0.0)
        split = {"batches": batches, **timings, "forward_backward": result.backward_s,
                 "optimizer": max(dt - batches - result.backward_s, 0.0)}
        record.update({f"time/{phase}_s": seconds for phase, seconds in split.items()})
        record.update({name: float(value) for name, value in result.metrics.items()})
        if self.flops_per_token and self.peak:  # model FLOPs of the global batch over the peak of every device
            achieved = self.flops_per_token * n_tokens / dt
            if (mfu := utilization(achieved, self.peak * self.world_size)) is None:
                log.warning("step %d ran at %.3g FLOP/s per device, above the %s peak of %.3g: MFU is not reported "
                            "(run `lmforge bench peak` on an idle machine, or set %s)", step + 1,
                            achieved / self.world_size, self.precision, self.peak, PEAK_ENV)
                self.peak, self.mfus = None, []
            else:
                record["mfu"] = mfu
        if step > self.start_step:  # the first step pays for warm-up (allocation, compilation)
            self.tok_rates.append(record["tokens_per_s"])
            for phase, seconds in split.items():
                self.phase_sums[phase] = self.phase_sums.get(phase, 0.0) + seconds
            if "mfu" in record:
                self.mfus.append(record["mfu"])
        return record

    def write(self, record: dict, is_last: bool) -> None:
        """To ``metrics.jsonl``, the progress bar, and every ``log_every`` steps (and each validation) the console."""
        self.metrics.log(record)
        bar = self.bar
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
        if bar.disable and (record["step"] % self.log_every == 0 or is_last or "val_loss" in record):
            log.info("%s", format_step(record, self.max_steps, None if is_last else self.eta_s(record)))
        elif "val_loss" in record:
            bar.write(format_step(record, self.max_steps))

    def eta_s(self, record: dict) -> float | None:
        """Seconds left: the remaining steps at the average time of the steps after the first (which
        pays for compilation) since the run (re)started, or at the first's while it is the only one."""
        done = record["step"] - self.start_step
        if self.first_step_done is None or done < 1:
            return None
        if done == 1:
            return record["step_s"] * (self.max_steps - record["step"])
        per_step = (time.perf_counter() - self.first_step_done) / (done - 1)
        return per_step * (self.max_steps - record["step"])

    def averages(self) -> dict:
        """Tokens/s, MFU and the seconds of each phase of a step (``time/<phase>_s``), averaged over
        the steps after the first."""
        steps = len(self.tok_rates)
        return {"tokens_per_s": _mean(self.tok_rates), "mfu": _mean(self.mfus),
                **{f"time/{phase}_s": total / steps for phase, total in self.phase_sums.items()}}

    def close(self) -> None:
        self.bar.close()
        self.metrics.close()
        self.metrics = NoMetrics()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def format_eta(seconds: float) -> str:
    """``45s``, ``2m05s``, ``1h02m``: a remaining time for a console line."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_step(r: dict, max_steps: int, eta_s: float | None = None) -> str:
    """The console line of step record ``r``; ``eta_s``: the seconds the remaining steps should take."""
    text = f"step {r['step']}/{max_steps} loss {r['loss']:.4f} lr {r['lr']:.2e} gnorm {r['grad_norm']:.2f} {r['tokens_per_s']:.0f} tok/s"
    if "mfu" in r:
        text += f" mfu {100 * r['mfu']:.1f}%"
    text += "".join(f" {k} {v:.3f}" for k, v in r.items() if k in CONSOLE_METRICS)
    if "noise_scale" in r:
        text += f" noise scale {r['noise_scale']:.3g} tok"
    if "val_loss" in r:
        text += f" | val loss {r['val_loss']:.4f}"
    if "val_bpb" in r:
        text += f" bpb {r['val_bpb']:.4f}"
    if domains := [(k.removeprefix("val/").removesuffix("/loss"), v) for k, v in r.items() if is_domain_loss(k)]:
        text += " (" + ", ".join(f"{name} {v:.4f}" for name, v in domains) + ")"
    if eta_s is not None:
        text += f" | eta {format_eta(eta_s)}"
    return text
