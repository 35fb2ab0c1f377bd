"""Run directories and console output shared by every stage."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lmforge.core.config import dump_config, save_config
from lmforge.core.io import InputError, atomic_directory, atomic_write_json, check_output_dir, read_json

log = logging.getLogger("lmforge")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each message, not the stream
    that was current when logging was set up (which a test runner or a caller may have
    replaced and closed since)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: int = logging.INFO) -> None:
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def format_count(n: float) -> str:
    """A count as a person reads it, to three significant figures: 950, 35.2K, 9.31M, 1.24B
    (parameters, tokens); ``distributed.memory.format_bytes`` is the same for bytes."""
    value, unit = float(n), ""
    for bigger in ("K", "M", "B", "T"):
        if abs(float(f"{value:.3g}")) < 1000:  # 999,950 is 1M, not 1e+03K
            break
        value, unit = value / 1000, bigger
    return f"{value:.3g}{unit}"


# --------------------------------------------------------------------------- run directories

LOCK_FILE = ".lmforge-lock"  # flock'ed while a run writes into the directory; removed only with the
# empty directory its own lock made
HOLDER_FILE = ".lmforge-lock.json"  # who holds the lock: pid, host, start time, command
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"


class RunDirBusy(InputError):
    """Another process is writing into the run directory."""


class RunDiverged(FloatingPointError):
    """A training run stopped because its numbers went non-finite: too many NaN/inf steps in a row
    (``train.max_nonfinite_steps``), or weights that would have been checkpointed non-finite. The
    message says the step and what to change; the command prints it as one line (exit status 1:
    the run failed, the recipe was not wrong)."""


class RunStopped(RuntimeError):
    """A run stopped by a failure of its own machinery, not of the recipe (a rollout worker that died):
    the command prints its message as one line, exit status 1, as ``RunDiverged``."""


_held: dict[str, int] = {}  # real path of a run directory -> descriptor of its locked LOCK_FILE
_created: set[str] = set()  # run directories the lock made: removed on release if the run wrote nothing


def acquire_run_dir(run_dir: str | Path) -> bool:
    """Create ``run_dir`` and lock it for this process, or raise RunDirBusy naming the process
    that holds it. The lock is an OS advisory lock (``flock``) on ``LOCK_FILE``: the system drops
    it when its process ends, however it ends, so a killed run leaves no stale lock. True when
    this call took the lock, False when this process held it already."""
    run_dir = Path(run_dir)
    key = os.path.realpath(run_dir)
    if key in _held:
        return False
    check_output_dir(run_dir, "run_dir")
    if not run_dir.exists():
        _created.add(key)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirBusy(f"{run_dir} is in use by another run ({_holder(run_dir)}); wait for it to finish, "
                         f"or stop it, or choose another run_dir") from None
    _held[key] = fd
    try:
        atomic_write_json(run_dir / HOLDER_FILE, {
            "pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join(sys.argv) or sys.executable,
        })
    except BaseException:
        release_run_dir(run_dir)
        raise
    return True


def release_run_dir(run_dir: str | Path) -> None:
    """Unlock a run directory this process locked (nothing if it holds no lock on it)."""
    key = os.path.realpath(run_dir)
    fd = _held.pop(key, None)
    if fd is not None:
        Path(run_dir, HOLDER_FILE).unlink(missing_ok=True)
        if key in _created and {p.name for p in Path(run_dir).iterdir()} == {LOCK_FILE}:
            # a command that failed before writing anything leaves no run directory behind
            Path(run_dir, LOCK_FILE).unlink()
            Path(run_dir).rmdir()
        os.close(fd)  # closing the only descriptor of the open file releases the flock
    _created.discard(key)


@contextmanager
def run_dir_lock(run_dir: str | Path, enabled: bool = True) -> Iterator[Path]:
    """Hold ``run_dir``'s lock for the block (``acquire_run_dir``); a lock this process already
    held stays held after it. ``enabled=False`` (ranks other than 0 of a torchrun job, which
    write into the directory rank 0 holds) takes no lock."""
    took = enabled and acquire_run_dir(run_dir)
    try:
        yield Path(run_dir)
    finally:
        if took:
            release_run_dir(run_dir)


@contextmanager
def atomic_run_dir(run_dir: str | Path) -> Iterator[Path]:
    """``atomic_directory`` for a run directory this process holds locked: a temporary sibling to
    fill, which replaces ``run_dir`` only if the block succeeds. The lock file and holder
    information go into the new folder as hard links of the same files before the swap, so the
    directory is locked throughout (a new lock file would be a second, free lock)."""
    run_dir = Path(run_dir)
    with atomic_directory(run_dir) as tmp:
        yield tmp
        for name in (LOCK_FILE, HOLDER_FILE):
            if (run_dir / name).is_file():
                try:
                    os.link(run_dir / name, tmp / name)
                except OSError:  # a filesystem without hard links: the same file, moved
                    os.replace(run_dir / name, tmp / name)


def clear_run_dir(run_dir: str | Path) -> None:
    """Remove everything in ``run_dir`` but its lock file and holder information, which the run
    holding the lock keeps (a new lock file would be a second, free lock for another run to take)."""
    for path in Path(run_dir).iterdir():
        if path.name in (LOCK_FILE, HOLDER_FILE):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _holder(run_dir: Path) -> str:
    try:
        h = json.loads((run_dir / HOLDER_FILE).read_text())
        return f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
    except (OSError, ValueError, KeyError, TypeError):  # being written, or written by another version
        return f"see {run_dir / HOLDER_FILE}"


def start_run(cfg: Any, run_dir: str | Path) -> Path:
    """Lock the run directory for this process (until the enclosing ``run_dir_lock`` ends, or the
    process does) and write the resolved config into it if it has none. An existing run's
    config is replaced only by ``record_config``, once the run has really moved on (the loop
    calls it at each checkpoint), so a command that fails first leaves the run as it was."""
    run_dir = Path(run_dir)
    acquire_run_dir(run_dir)
    if not (run_dir / CONFIG_FILE).exists():
        save_config(cfg, run_dir)
    return run_dir


def record_config(cfg: Any, run_dir: str | Path) -> None:
    """Write ``cfg`` as the run's config (atomically), unless it is already the one written, or None."""
    path = Path(run_dir) / CONFIG_FILE
    if cfg is not None and (not path.exists() or path.read_text() != dump_config(cfg)):
        save_config(cfg, run_dir)


def completed_summary(run_dir: str | Path, summary: dict) -> dict | None:
    """The ``summary.json`` a completed run wrote, when the loop's ``summary`` says this rerun
    found the run already complete: the stage returns it rather than overwrite it with a
    summary of no training. None otherwise, and when there is none (the run stopped between
    its last checkpoint and its summary: the stage finishes it as usual)."""
    if not summary.get("already_complete"):
        return None
    try:
        stored = read_json(Path(run_dir) / SUMMARY_FILE)
    except (OSError, InputError):
        return None
    return stored if isinstance(stored, dict) else None


def progress_bar(total: float | None, desc: str, unit: str = "it", **kwargs: Any) -> tqdm:
    """A console progress bar with rate and ETA; silent when stderr is not a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=None, leave=False, **kwargs)
