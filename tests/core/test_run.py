import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

import pytest

from lmforge.core.run import (
    HOLDER_FILE,
    LOCK_FILE,
    RunDirBusy,
    acquire_run_dir,
    completed_summary,
    format_count,
    record_config,
    release_run_dir,
    run_dir_lock,
    start_run,
)


@pytest.mark.parametrize("n, text", [(0, "0"), (950, "950"), (1000, "1K"), (35_184, "35.2K"), (999_950, "1M"),
                                     (9_314_304, "9.31M"), (124_439_808, "124M"), (1_240_000_000, "1.24B"),
                                     (405.8e9, "406B"), (3.2e12, "3.2T")])
def test_a_count_reads_as_a_person_would_say_it(n, text):
    assert format_count(n) == text


@dataclass
class Recipe:
    run_dir: str = "runs/x"
    lr: float = 1e-3


def hold_in_subprocess(run_dir) -> subprocess.Popen:
    """A process holding ``run_dir``'s lock until its stdin closes (or it is killed)."""
    code = ("import sys; from lmforge.core.run import run_dir_lock\n"
            f"with run_dir_lock({str(run_dir)!r}):\n    print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, "pretrain", "recipe.yaml"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_locked_run_dir_refuses_a_second_run_naming_pid_host_start_and_command(tmp_path):
    holder = hold_in_subprocess(tmp_path / "run")
    try:
        with pytest.raises(RunDirBusy) as err:
            start_run(Recipe(), tmp_path / "run")
        message = str(err.value)
        assert f"pid {holder.pid} on {socket.gethostname()}, started 20" in message
        assert "-c pretrain recipe.yaml" in message and str(tmp_path / "run") in message
    finally:
        holder.communicate("")
    assert not (tmp_path / "run" / HOLDER_FILE).exists()  # the holder cleaned up after itself


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = hold_in_subprocess(tmp_path / "run")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    assert (tmp_path / "run" / HOLDER_FILE).exists()  # stale holder information, but no lock
    with run_dir_lock(tmp_path / "run"):
        holder_info = json.loads((tmp_path / "run" / HOLDER_FILE).read_text())
        assert holder_info["pid"] == os.getpid()


def test_the_lock_conflicts_with_another_open_file_in_the_same_process_until_the_block_ends(tmp_path):
    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir):
        (run_dir / "metrics.jsonl").write_text("")  # the run wrote something: its directory stays
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: free
    finally:
        os.close(fd)


def test_a_command_that_fails_before_writing_anything_leaves_no_run_directory(tmp_path):
    with pytest.raises(ValueError), run_dir_lock(tmp_path / "new" / "run"):
        raise ValueError("a bad recipe value found before any work")
    assert not (tmp_path / "new" / "run").exists()
    (tmp_path / "kept").mkdir()
    with run_dir_lock(tmp_path / "kept"):
        pass
    assert (tmp_path / "kept").is_dir()  # a directory the user made stays


def test_a_process_that_holds_the_lock_may_start_runs_inside_it_and_keeps_it_after_them(tmp_path):
    with run_dir_lock(tmp_path / "run"):
        assert start_run(Recipe(), tmp_path / "run") == tmp_path / "run"
        with run_dir_lock(tmp_path / "run"):  # nested: a no-op
            pass
        assert acquire_run_dir(tmp_path / "run") is False  # still held
    assert acquire_run_dir(tmp_path / "run") is True
    release_run_dir(tmp_path / "run")


def test_start_run_keeps_an_existing_runs_config_until_record_config(tmp_path):
    with run_dir_lock(tmp_path / "run"):
        start_run(Recipe(lr=1e-3), tmp_path / "run")
        first = (tmp_path / "run" / "config.yaml").read_text()
        start_run(Recipe(lr=5.0), tmp_path / "run")
        assert (tmp_path / "run" / "config.yaml").read_text() == first
        record_config(Recipe(lr=5.0), tmp_path / "run")
        assert "lr: 5.0" in (tmp_path / "run" / "config.yaml").read_text()


def test_completed_summary_is_the_stored_one_only_for_a_run_found_complete(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"step": 8, "val_loss": 2.5}))
    assert completed_summary(tmp_path, {"step": 8, "final_loss": 2.4}) is None  # it trained: write anew
    assert completed_summary(tmp_path, {"step": 8, "already_complete": True}) == {"step": 8, "val_loss": 2.5}
    assert completed_summary(tmp_path / "none", {"step": 8, "already_complete": True}) is None


def test_a_run_dir_replaced_whole_stays_locked_through_the_swap(tmp_path):
    from lmforge.core.run import atomic_run_dir

    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir):
        (run_dir / "old.txt").write_text("old")
        with atomic_run_dir(run_dir) as tmp:
            (tmp / "new.txt").write_text("new")
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE, HOLDER_FILE, "new.txt"]
        assert json.loads((run_dir / HOLDER_FILE).read_text())["pid"] == os.getpid()
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # the same locked file, not a new free one
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE, "new.txt"]
