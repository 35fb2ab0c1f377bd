"""Kill -9 a stage at seeded points, resume it, and compare with an uninterrupted run.

``python -m tests.reliability.kill_driver SPEC.json`` imports lmforge and torch once, runs no
torch op itself, and forks a child per attempt: the child arms one kill point (a function of
the stage and the N-th call of it; the child SIGKILLs itself there) and runs the stage with
resume on. The parent waits; a killed child is followed by another attempt in the same run
directory, up to a drawn number of kills (1 to 4), then one with no kill point runs to the end
(a "cycle"); the finished run is set aside and a new cycle starts, until ``kills`` kills have
landed. An uninterrupted reference run, also in a forked
child, counts how often each kill point is reached, so every drawn N can land.

The spec (JSON): stage (pretrain, sft, prepare, curate), work (an empty folder), seed, kills,
and the stage's inputs (see ``STAGES``). The result, written to ``work/result.json``: kills by
kill point, cycles, and the problems found (children that failed, leftover temporaries,
outputs that differ from the reference's), each a line.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

# ------------------------------------------------------------------ kill points (in the child)

_COUNTS: Counter = Counter()
_ARMED: tuple[str, int] | None = None


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _tick(label: str) -> None:
    """Count a call of ``label``; SIGKILL this process at the armed one."""
    _COUNTS[label] += 1
    if _ARMED == (label, _COUNTS[label]):
        _die()


def _wrap(owner: Any, attr: str, label: str, when: str = "before") -> None:
    """Make ``owner.attr`` a kill point: ``label`` is reached before (or after) each call of it."""
    real = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        if when == "before":
            _tick(label)
        out = real(*args, **kwargs)
        if when == "after":
            _tick(label)
        return out

    setattr(owner, attr, wrapper)


def _torn_metrics_line(label: str) -> None:
    """Make ``MetricsLogger.log`` a kill point that writes half the record's line first."""
    from lmforge.train.metrics import MetricsLogger

    real = MetricsLogger.log

    def log(self, record: dict) -> None:
        if _ARMED is not None and _ARMED[0] == label and _COUNTS[label] + 1 == _ARMED[1]:
            line = json.dumps(record) + "\n"
            self.file.write(line[: len(line) // 2])
            self.file.flush()
        _tick(label)
        real(self, record)

    MetricsLogger.log = log


def _training_points() -> None:
    """Kill points of a training stage: mid-step, each file of a checkpoint, metrics, config."""
    import torch

    import lmforge.checkpoints.files as model_ckpt
    import lmforge.core.io as io
    import lmforge.train.checkpoint as train_ckpt
    import lmforge.train.checkpointer as checkpointer
    from lmforge.train.metrics import MetricsLogger
    from lmforge.train.step import StepRunner

    _wrap(torch.Tensor, "backward", "step:backward")
    _wrap(torch.optim.AdamW, "step", "step:optimizer")
    _wrap(StepRunner, "run_step", "step:after", "after")
    _wrap(model_ckpt, "save_file", "checkpoint:weights")
    _wrap(model_ckpt, "save_file", "checkpoint:after-weights", "after")
    _wrap(torch, "save", "checkpoint:torch-save")
    _wrap(train_ckpt, "atomic_write_json", "checkpoint:trainer-state")
    _wrap(train_ckpt, "save_config", "checkpoint:config")
    _wrap(train_ckpt, "write_checksums", "checkpoint:checksums")
    _wrap(train_ckpt, "write_checksums", "checkpoint:before-rename", "after")
    _wrap(io, "replace_directory", "checkpoint:renamed", "after")
    _wrap(train_ckpt, "prune_checkpoints", "checkpoint:pruned", "after")
    _wrap(checkpointer, "record_config", "run:config")
    _torn_metrics_line("metrics:torn-line")
    _wrap(MetricsLogger, "log", "metrics:after", "after")


def _prepare_points() -> None:
    """Kill points of prepare: tokenizing, each shard file, the manifest, the final rename."""
    import numpy as np

    import lmforge.core.io as io
    import lmforge.data.shards as shards
    import lmforge.stages.prepare as prepare
    from lmforge.data.tokenizer import Tokenizer

    _wrap(Tokenizer, "encode_batch", "prepare:encode")
    _wrap(np, "save", "prepare:shard-file")
    _wrap(shards.ShardWriter, "flush", "prepare:shard-written", "after")
    _wrap(prepare, "atomic_write_json", "prepare:manifest")
    _wrap(prepare, "save_config", "prepare:config")
    _wrap(io, "replace_directory", "prepare:rename")
    _wrap(io, "replace_directory", "prepare:renamed", "after")


def _curate_points() -> None:
    """Kill points of curate: mid-segment (a filter, a record), each file and marker of a task."""
    from lmforge.curate import filters, ids, pipeline, records, tasks

    _wrap(filters.GopherQualityFilter, "__call__", "curate:filter")
    _wrap(records.JsonlWriter, "write", "curate:record")
    _wrap(records.JsonlWriter, "commit", "curate:commit")
    for module in (pipeline, tasks, ids, records):  # each module that writes a file or marker of a task
        _wrap(module, "atomic_write_bytes", "curate:file")
        _wrap(module, "atomic_write_bytes", "curate:after-file", "after")
    for module in (tasks, ids):
        _wrap(module, "atomic_write_json", "curate:marker")
    _wrap(ids, "atomic_write_npy", "curate:index")
    _wrap(pipeline, "run_segment_shard", "curate:segment-task", "after")
    _wrap(pipeline, "finalize_shard", "curate:finalize-task", "after")


# ------------------------------------------------------------------ the stages


def _run_pretrain(spec: dict, run_dir: Path) -> None:
    from lmforge.core.config import load_config
    from lmforge.stages.pretrain import PretrainRecipe, run_pretrain

    run_pretrain(load_config(PretrainRecipe, None, [f"run_dir={run_dir}", "train.resume=auto", *spec["overrides"]]))


def _run_sft(spec: dict, run_dir: Path) -> None:
    from lmforge.core.config import load_config
    from lmforge.stages.sft import SFTRecipe, run_sft

    run_sft(load_config(SFTRecipe, None, [f"run_dir={run_dir}", "train.resume=auto", *spec["overrides"]]))


def _run_prepare(spec: dict, run_dir: Path) -> None:
    from lmforge.core.config import load_config
    from lmforge.stages.prepare import PrepareRecipe, run_prepare

    run_prepare(load_config(PrepareRecipe, None, [f"run_dir={run_dir}", *spec["overrides"]]))


def _run_curate(spec: dict, run_dir: Path) -> None:
    from lmforge.curate.pipeline import CurateConfig, run_curate
    from lmforge.curate.readers import InputsConfig

    cfg = spec["config"]
    run_curate(CurateConfig(run_dir=str(run_dir), inputs=InputsConfig(**cfg["inputs"]), steps=cfg["steps"],
                            workers=1, known_duplicates=cfg.get("known_duplicates")))


# metrics fields that depend on the machine's speed, not on the computation (and the time/<phase>_s split)
_TIMING = {"tokens_per_s", "step_s", "memory_bytes", "mfu", "time", "elapsed_s"}


def _training_differences(done: Path, reference: Path, final: Callable[[Path], Path]) -> list[str]:
    """How ``done`` differs from ``reference``: any metrics record (timings aside), or a final weight."""
    from safetensors.torch import load_file

    from lmforge.train.metrics import read_metrics

    def records(run: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in _TIMING and not k.startswith("time/")} for r in read_metrics(run)]

    problems = []
    got, want = records(done), records(reference)
    if got != want:
        bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        problems.append(f"{done.name}: metrics differ from the uninterrupted run's at record {bad}: "
                        f"{got[bad] if bad < len(got) else None} != {want[bad] if bad < len(want) else None}")
    got_w, want_w = load_file(str(final(done))), load_file(str(final(reference)))
    if got_w.keys() != want_w.keys() or any(not got_w[k].equal(want_w[k]) for k in want_w):
        problems.append(f"{done.name}: final weights differ from the uninterrupted run's")
    return problems


def _newest_checkpoint_weights(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step_*"))[-1] / "model.safetensors"


def _final_weights(run: Path) -> Path:
    return run / "final" / "model.safetensors"


def _file_differences(done: Path, reference: Path, skip: tuple[str, ...]) -> list[str]:
    """The files under ``done`` missing from, extra to or different from ``reference``'s (``skip`` aside)."""
    def files(root: Path) -> dict[str, bytes]:
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and not any(p.relative_to(root).as_posix().startswith(s) for s in skip)}

    got, want = files(done), files(reference)
    differ = sorted(set(got) ^ set(want)) + sorted(k for k in set(got) & set(want) if got[k] != want[k])
    return [f"{done.name}: {name} differs from the uninterrupted run's" for name in differ]


def _curate_differences(done: Path, reference: Path) -> list[str]:
    """The kept documents and rejects; stats and report hold timings and task counts."""
    return [line for d in ("output", "rejects") for line in _file_differences(done / d, reference / d, ())]


STAGES: dict[str, dict[str, Any]] = {
    "pretrain": {"run": _run_pretrain, "points": _training_points,
                 "compare": lambda d, r: _training_differences(d, r, _newest_checkpoint_weights)},
    "sft": {"run": _run_sft, "points": _training_points,
            "compare": lambda d, r: _training_differences(d, r, _final_weights)},
    "prepare": {"run": _run_prepare, "points": _prepare_points,
                "compare": lambda d, r: _file_differences(d, r, skip=("stats.json",))},
    "curate": {"run": _run_curate, "points": _curate_points, "compare": _curate_differences},
}


# ------------------------------------------------------------------ the parent


def _attempt(stage: dict, spec: dict, run_dir: Path, armed: tuple[str, int] | None, log_path: Path,
             counts_path: Path | None = None) -> str:
    """Run the stage once in a forked child; "killed", "finished", or "failed"."""
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import logging

            import torch

            torch.set_num_threads(1)
            logging.getLogger("lmforge").setLevel(logging.WARNING)
            global _ARMED
            _ARMED = armed
            stage["points"]()
            stage["run"](spec, run_dir)
            if counts_path is not None:
                counts_path.write_text(json.dumps(dict(_COUNTS)))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    return "finished" if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else "failed"


def _temporaries(root: Path) -> list[str]:
    from lmforge.core.io import is_temporary

    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if is_temporary(p) or p.name.endswith(".tmp"))


def drive(spec: dict) -> dict:
    """Kill, resume and compare until ``spec["kills"]`` kills have landed; the result (see the module)."""
    stage = STAGES[spec["stage"]]
    work = Path(spec["work"])
    area = work / "area"  # the run directory's parent, where atomic writes of it put their temporaries
    run_dir = area / "run"
    area.mkdir(parents=True)
    problems: list[str] = []
    counts_path = work / "counts.json"
    if _attempt(stage, spec, run_dir, None, work / "reference.log", counts_path) != "finished":
        return {"problems": [f"the uninterrupted run failed:\n{(work / 'reference.log').read_text()[-3000:]}"]}
    reference = work / "reference"
    run_dir.rename(reference)
    counts = {k: v for k, v in json.loads(counts_path.read_text()).items() if v > 0}
    points = sorted(counts)
    rng = random.Random(spec["seed"])
    categories = sorted({p.split(":")[0] for p in points})  # taken in turn: each kind of point is hit
    kills: Counter = Counter()
    done_runs = []
    cycle = draws = 0
    last = None
    while sum(kills.values()) < spec["kills"] and not problems:
        budget = rng.randint(1, 4)  # kills of this run; then it runs to the end (prepare always starts over)
        for attempt in range(budget + 1):
            armed = None
            if attempt < budget:
                category = categories[draws % len(categories)]
                draws += 1
                label = rng.choice([p for p in points if p.split(":")[0] == category])
                armed = (label, rng.randint(1, counts[label]))
            log_path = work / f"cycle-{cycle}-{attempt}.log"
            outcome = _attempt(stage, spec, run_dir, armed, log_path)
            if outcome == "killed":
                kills[label] += 1
                last = armed
                log_path.unlink()
                continue
            if outcome == "failed":
                problems.append(f"cycle {cycle}, attempt {attempt} (the last kill: {last}) failed:\n"
                                f"{log_path.read_text()[-3000:]}")
            else:
                log_path.unlink()
            break
        else:
            problems.append(f"cycle {cycle}: a run without a kill point was killed")
        problems += [f"cycle {cycle}: left behind {t}" for t in _temporaries(area)]
        done = work / f"done-{cycle}"
        if run_dir.exists():
            run_dir.rename(done)
            done_runs.append(done)
        shutil.rmtree(area)
        area.mkdir()
        cycle += 1
    # every child has run: torch may run here now
    for done in done_runs:
        problems += stage["compare"](done, reference)
    return {"stage": spec["stage"], "kills": sum(kills.values()), "kills_by_point": dict(sorted(kills.items())),
            "points": counts, "cycles": cycle, "compared": len(done_runs), "problems": problems}


PRELOAD = {"pretrain": ["lmforge.stages.pretrain"], "sft": ["lmforge.stages.sft"],
           "prepare": ["lmforge.stages.prepare"], "curate": ["lmforge.curate.pipeline"]}


def main(argv: list[str]) -> None:
    """Import the stage once (its children share it), then drive it; no torch op runs before the forks."""
    import importlib

    spec = json.loads(Path(argv[0]).read_text())
    for module in PRELOAD[spec["stage"]] + ["lmforge.core.io", "lmforge.train.metrics", "safetensors.torch"]:
        importlib.import_module(module)
    result = drive(spec)
    (Path(spec["work"]) / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
