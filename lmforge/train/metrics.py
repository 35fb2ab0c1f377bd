"""Metrics: JSON lines (the source of truth) plus TensorBoard and ``train.loggers`` (W&B, MLflow);
the report's plots; hardware peak FLOP/s for MFU."""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lmforge.core.io import InputError, atomic_write_json, atomic_write_text
from lmforge.core.run import log
from lmforge.train.loggers import Tracker, forget_runs, log_figures, open_trackers
from lmforge.train.spikes import report_lines

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Appends one JSON object per record to ``metrics.jsonl`` and mirrors its scalars to TensorBoard
    and to the trackers of ``loggers`` (``train.loggers``: wandb, mlflow), which also get ``config``
    (the resolved recipe) once. The trackers open at the first record, so a run found already
    complete opens none."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None,
                 loggers: list[str] | tuple[str, ...] = (), config: dict | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None and self.path.exists():
            # drop records past the checkpoint we resume from (they will be logged again) and a torn
            # last line; replaced in one step, so a failure here leaves the old file whole
            kept = [r for r in parse_metrics(self.path) if r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        if resume_step is None:
            forget_runs(self.run_dir)
        self.file = open(self.path, "a", encoding="utf-8")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # the steps after the checkpoint a run resumes from (all, for a fresh run) are logged
                # again: readers drop the old events for them
                self.writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=(resume_step or 0) + 1)
            except ImportError:
                log.info("tensorboard is not installed; metrics go to %s only", self.path)
        self.loggers, self.config, self.resume = list(loggers), config, resume_step is not None
        self.trackers: list[Tracker] | None = None  # opened by the first record

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step, values = record.get("step", 0), scalars(record)
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
        for tracker in self.open_trackers():
            tracker.log(values, step)

    def open_trackers(self) -> list[Tracker]:
        if self.trackers is None:
            self.trackers = open_trackers(self.run_dir, self.loggers, self.resume)
            for tracker in self.trackers:
                if self.config is not None:
                    tracker.log_config(self.config)
        return self.trackers

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers or []:
            tracker.close()
        self.trackers = None


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a record that TensorBoard and the trackers get: all but ``step``, ``time`` and NaN."""
    return {key: value for key, value in record.items()
            if key not in ("step", "time") and isinstance(value, (int, float)) and value == value}


def read_metrics(run_dir: str | Path, events: bool = False) -> list[dict]:
    """The step records of a run's ``metrics.jsonl`` (none without one), as ``parse_metrics`` reads
    them; with ``events``, only the event records (those with an ``event`` key, e.g. loss spikes),
    which lack a step's fields."""
    path = Path(run_dir) / METRICS_FILE
    records = parse_metrics(path) if path.exists() else []
    return [r for r in records if ("event" in r) == events]


def parse_metrics(path: Path) -> list[dict]:
    """The JSON records of a metrics file, one a line. An unterminated last line that is not a
    record was torn by a run killed or out of disk mid-write: it is dropped with a warning. Any
    other line that is not a record is corruption: an InputError naming the file and line."""
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError of bytes cut mid-character
            if number == len(lines):  # after the last newline: the write never finished
                log.warning("%s:%d: dropped a torn last line (%d bytes; the run stopped mid-write)",
                            path, number, len(line))
                break
            raise InputError(f"{path}:{number}: not a JSON record ({exc}); the file is corrupt") from None
        if not isinstance(record, dict):
            raise InputError(f"{path}:{number}: not a JSON record (a {type(record).__name__}); the file is corrupt")
        records.append(record)
    return records


PERPLEXITIES = ("word_perplexity", "byte_perplexity")  # of rolling tasks: byte_perplexity = 2 ** bits_per_byte


def loss_curve_lines(stage_dir: Path, out: Path, unigram_entropy: float | None = None,
                     ylabel: str = "loss (nats/token)") -> list[str]:
    """The lifecycle report's lines for a stage's loss curve (plotted into ``out``, its y-axis
    ``ylabel``: what the stage's loss is per) and its loss-spike events; none without metrics.
    The plots are logged to the tracker runs the stage's training kept (``train.loggers``)."""
    curve = ["", f"![loss curve]({out.name})"] if plot_losses(stage_dir, out, unigram_entropy, ylabel) else []
    scored_plot = out.with_name(out.stem.removesuffix("-loss") + "-eval.png")
    scored = scored_lines(stage_dir, scored_plot)
    if curve:  # the plots also go to the run's trackers (train.loggers), at its last step
        plots = [out] + ([scored_plot] if any(scored_plot.name in line for line in scored) else [])
        log_figures(stage_dir, plots, read_metrics(stage_dir)[-1]["step"])
    return curve + scored + report_lines(read_metrics(stage_dir, events=True))


def scored_lines(stage_dir: Path, out: Path, max_columns: int = 6) -> list[str]:
    """The report's table of the in-loop task figures (``eval/<task>/<metric>``, from
    ``train.eval_tasks``; perplexities left out, as bits per byte carries them) at up to ``max_columns`` of the steps they were scored at (the first and
    the last among them), and their plot against step into ``out``; none when nothing was scored."""
    records = [r for r in read_metrics(stage_dir) if any(k.startswith("eval/") for k in r)]
    if not records:
        return []
    keys = sorted({k for r in records for k in r if k.startswith("eval/") and k.rsplit("/", 1)[1] not in PERPLEXITIES})
    picks = sorted({round(i * (len(records) - 1) / max(1, max_columns - 1)) for i in range(max_columns)})
    shown = [records[i] for i in picks]
    lines = ["", "| task | metric | " + " | ".join(f"step {r['step']}" for r in shown) + " |",
             "|---|---|" + "---:|" * len(shown)]
    for key in keys:
        task, metric = key.removeprefix("eval/").split("/", 1)
        cells = [f"{r[key]:.4f}" if key in r else "" for r in shown]
        lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    if plot_scored(records, keys, out) is not None:
        lines += ["", f"![tasks over steps]({out.name})"]
    return lines


def plot_scored(records: list[dict], keys: list[str], out: Path) -> Path | None:
    """One panel per task, its metrics against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({k.split("/")[1] for k in keys})
    cols = min(3, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for key in (k for k in keys if k.split("/")[1] == task):
            points = [(r["step"], r[key]) for r in records if key in r]
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=key.split("/", 2)[2])
        ax.set_title(task)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def is_domain_loss(key: str) -> bool:
    """A record key holding one mixture dataset's validation loss, ``val/<name>/loss``."""
    return key.startswith("val/") and key.endswith("/loss")


def plot_losses(stage_dir: Path, out: Path, unigram_entropy: float | None = None,
                ylabel: str = "loss (nats/token)") -> Path | None:
    """Training and validation loss against step, from the stage's metrics.jsonl."""
    records = read_metrics(stage_dir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss", linewidth=1)
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    for key in sorted({k for r in val for k in r if is_domain_loss(k)}):  # each dataset of a mixture
        domain = [r for r in val if key in r]
        ax.plot([r["step"] for r in domain], [r[key] for r in domain], ".--", linewidth=1,
                label=f"validation loss: {key.removeprefix('val/').removesuffix('/loss')}")
    if unigram_entropy:
        ax.axhline(unigram_entropy, color="gray", linestyle="--", linewidth=1, label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# --------------------------------------------------------------------------- peak FLOP/s

# Dense (no sparsity) tensor-core peaks in FLOP/s, from the vendors' data sheets.
GPU_PEAKS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "B200": {"bfloat16": 2250e12, "float16": 2250e12, "float32": 80e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "L40S": {"bfloat16": 362e12, "float16": 362e12, "float32": 91.6e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 30.3e12},
    "A10G": {"bfloat16": 70e12, "float16": 70e12, "float32": 31.2e12},
    "RTX 4090": {"bfloat16": 165e12, "float16": 165e12, "float32": 82.6e12},
}


def datasheet_peak(device: torch.device, dtype_name: str) -> float | None:
    """The data-sheet peak of a known GPU at ``dtype_name`` (e.g. ``bfloat16``), else None."""
    if device.type != "cuda":
        return None
    gpu = torch.cuda.get_device_name(device)
    return next((peaks.get(dtype_name) for key, peaks in GPU_PEAKS.items() if key in gpu), None)


def cache_dir() -> Path:
    return Path(os.environ.get("LMFORGE_CACHE", Path.home() / ".cache" / "lmforge"))


def peak_cache_path() -> Path:
    """``{machine key: {dtype name: FLOP/s}}``, written by `lmforge bench peak` and by the first
    stage on a machine that needs a peak it has no figure for (``peak_source``)."""
    return cache_dir() / "peak_flops.json"


def machine_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.processor() or platform.machine()}:{os.cpu_count()}cpus:{torch.get_num_threads()}threads:torch{torch.__version__}"


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 2048, seconds: float = 1.0) -> float:
    """Best observed FLOP/s of square matmuls of up to ``n``: the practical peak MFU is measured against.

    Both ``torch.mm`` and ``F.linear`` (what the model's layers call) are timed, since a CPU
    may route a dtype through different kernels for each (fp16 on AMD EPYC: ``linear`` is
    about 10x faster than ``mm``). The size starts small and doubles only while one product
    takes under a fortieth of ``seconds`` (the next, 8x the work, is timed four times), so the
    whole measurement stays within about twice ``seconds`` however slow the dtype is
    (emulated fp16 runs at ~1 GFLOP/s).
    """
    deadline = time.perf_counter() + seconds
    size, best = min(256, n), 0.0
    while True:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        elapsed = min(_time_product(torch.mm, a, b, device), _time_product(F.linear, a, b, device))
        best = max(best, 2 * size**3 / elapsed)
        if size >= n or elapsed > seconds / 40 or time.perf_counter() >= deadline:
            break
        size = min(2 * size, n)
    while time.perf_counter() < deadline:
        elapsed = min(_time_product(torch.mm, a, b, device), _time_product(F.linear, a, b, device))
        best = max(best, 2 * size**3 / elapsed)
    return best


def _time_product(product, a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    """Seconds of the faster of two runs of ``product(a, b)`` (the first also warms up)."""
    times = []
    for _ in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        product(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def cached_peak(device: torch.device, dtype_name: str) -> float | None:
    """The figure measured and cached for this machine at ``dtype_name`` (``store_peak``), else None."""
    path = peak_cache_path()
    cache = json.loads(path.read_text()) if path.exists() else {}
    return cache.get(machine_key(device), {}).get(dtype_name)


PEAK_ENV = "LMFORGE_PEAK_FLOPS"


def stated_peak(dtype_name: str) -> float | None:
    """The peak that ``LMFORGE_PEAK_FLOPS`` states for ``dtype_name``, else None.

    The variable reads ``float32=2e11,bfloat16=9e11``: a user who knows the hardware's
    figure (or a test suite, which must never time a dtype) sets it and nothing is measured.
    """
    text = os.environ.get(PEAK_ENV, "").strip()
    if not text:
        return None
    peaks = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            peaks[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{PEAK_ENV}={text!r}: expected dtype=FLOP/s pairs such as "
                             f"'float32=2e11,bfloat16=9e11'") from None
        if not math.isfinite(peaks[name.strip()]) or peaks[name.strip()] <= 0:
            raise ValueError(f"{PEAK_ENV}: {item.strip()!r} is not a positive FLOP/s figure")
    return peaks.get(dtype_name)


# How long `lmforge bench peak` and a stage's first measurement on a machine time each dtype:
# long enough that the best of many 2048^3 products is stable (a second gave readings 3x apart).
STABLE_SECONDS = 3.0
STABLE_SIZE = 2048


def peak_flops(device: torch.device, dtype: torch.dtype, measure_if_missing: bool = True) -> float | None:
    """Peak FLOP/s of ``device`` at ``dtype``, the denominator of MFU (``peak_source`` says where it came from)."""
    return peak_source(device, dtype, measure_if_missing)[0]


def peak_source(device: torch.device, dtype: torch.dtype, measure_if_missing: bool = True) -> tuple[float | None, str]:
    """Peak FLOP/s of ``device`` at ``dtype`` and where it came from.

    In order: the figure ``LMFORGE_PEAK_FLOPS`` states, the figure measured and cached for
    this machine (by `lmforge bench peak`, or by the first stage that needed it; for a GPU
    only when measured with ``measure=true``), a known GPU's data-sheet figure, else a
    measurement now, as long as `lmforge bench peak`'s and cached for every later stage and
    run (or None when ``measure_if_missing`` is false).
    """
    name = str(dtype).removeprefix("torch.")
    if (stated := stated_peak(name)) is not None:
        return stated, f"stated in {PEAK_ENV}"
    if (cached := cached_peak(device, name)) is not None:
        return cached, "cached peak"
    if (sheet := datasheet_peak(device, name)) is not None:
        return sheet, "data-sheet peak"
    if not measure_if_missing:
        return None, "no peak"
    log.info("no cached %s peak for this machine: measuring it once (~%.0f s) and caching it in %s "
             "(`lmforge bench peak` measures again, keeping the higher figure)", name, STABLE_SECONDS, peak_cache_path())
    value = measure_matmul_peak(device, dtype, n=STABLE_SIZE, seconds=STABLE_SECONDS)
    return store_peak(device, dtype, value), "peak measured now and cached"


def utilization(achieved_flops: float, peak: float | None) -> float | None:
    """MFU, ``achieved / peak``; None when the peak is unknown or below the rate achieved.

    A rate above the peak means the peak was measured too low (a busy machine, or a kernel
    the measurement did not take): no figure above 100% is ever reported.
    """
    if not peak or achieved_flops > peak:
        return None
    return achieved_flops / peak


def store_peak(device: torch.device, dtype: torch.dtype, value: float) -> float:
    """Cache a measured peak for this machine, keeping the higher of it and the figure already
    cached: a peak is the best rate the hardware reaches, and a rerun on a busier machine
    measures less, not a lower peak. Returns the figure kept. (Delete the cache file to start over.)"""
    path = peak_cache_path()
    cache = json.loads(path.read_text()) if path.exists() else {}
    peaks = cache.setdefault(machine_key(device), {})
    name = str(dtype).removeprefix("torch.")
    peaks[name] = max(value, peaks.get(name, 0.0))
    atomic_write_json(path, cache)
    return peaks[name]
