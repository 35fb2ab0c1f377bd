"""Run directories and console output shared by every stage."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lmforge.core.config import save_config

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


def start_run(cfg: Any, run_dir: str | Path) -> Path:
    """Create the run directory and write the resolved config into it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir)
    return run_dir


def progress_bar(total: float | None, desc: str, unit: str = "it", **kwargs: Any) -> tqdm:
    """A console progress bar with rate and ETA; silent when stderr is not a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=None, leave=False, **kwargs)
