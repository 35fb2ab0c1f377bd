"""A rank of a launched job does not outlive its launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited orphan that nobody reaped is a zombie: not running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_for(condition, limit_s: float = 120.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_worker_exits_when_the_launcher_that_started_it_is_killed(tmp_path):
    pid_file = tmp_path / "worker.pid"
    worker = ("import os, time\n"
              "from lmforge.distributed.mesh import exit_when_parent_dies\n"
              "exit_when_parent_dies(poll_s=0.05)\n"
              f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
              "time.sleep(600)\n")  # a worker that would train on for a long time
    launcher = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {worker!r}])\ntime.sleep(600)\n"
    agent = subprocess.Popen([sys.executable, "-c", launcher], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert wait_for(lambda: pid_file.is_file() and pid_file.read_text()), "the worker did not start"
        worker_pid = int(pid_file.read_text())
        assert alive(worker_pid)
        agent.kill()
        agent.wait()
        assert wait_for(lambda: not alive(worker_pid)), "the worker outlived its launcher"
    finally:
        agent.kill()
        if pid_file.is_file() and pid_file.read_text() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), 9)
