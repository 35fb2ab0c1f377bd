"""What a pre-training run leaves in its run directory when it is stopped, rerun, run twice at
once, or started with a command that fails."""

import json

import pytest
import yaml

from lmforge.core.io import InputError
from lmforge.core.run import RunDirBusy, run_dir_lock
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.metrics import METRICS_FILE, read_metrics
from tests.core.test_run import hold_in_subprocess


def test_a_run_resumes_after_its_metrics_file_was_torn_mid_record(make_recipe, tmp_path):
    run_pretrain(make_recipe(**{"train.stop_at_step": 6}))  # checkpoint at step 4, stopped at 6
    metrics = tmp_path / "run" / METRICS_FILE
    with metrics.open("a") as f:
        f.write('{"step": 7, "loss": 4.1')  # killed mid-write
    summary = run_pretrain(make_recipe())
    assert summary["start_step"] == 6 and summary["step"] == 8
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, 9))


def test_rerunning_a_completed_run_keeps_its_summary(make_recipe, tmp_path):
    first = run_pretrain(make_recipe())
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    again = run_pretrain(make_recipe())
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == saved
    for key in ("val_loss", "final_loss", "checkpoint", "tokens_per_s", "mfu", "wall_s", "unigram_entropy"):
        assert key in saved and again[key] == saved[key] == pytest.approx(first[key])


def test_a_rerun_with_other_settings_leaves_a_completed_runs_config(make_recipe, tmp_path):
    run_pretrain(make_recipe())
    config = (tmp_path / "run" / "config.yaml").read_text()
    run_pretrain(make_recipe(**{"train.lr": 1e-2}))  # already complete: nothing is trained with it
    assert (tmp_path / "run" / "config.yaml").read_text() == config


def test_a_failed_command_leaves_an_existing_runs_config(make_recipe, tmp_path):
    run_pretrain(make_recipe())
    config = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(InputError, match="not found"):  # found only once the run has started
        run_pretrain(make_recipe(**{"train.max_steps": 12, "train.resume": str(tmp_path / "missing")}))
    assert (tmp_path / "run" / "config.yaml").read_text() == config


def test_a_run_that_fails_before_its_first_checkpoint_leaves_the_config(make_recipe, tmp_path, monkeypatch):
    run_pretrain(make_recipe())
    config = (tmp_path / "run" / "config.yaml").read_text()

    def diverged(*args, **kwargs):
        raise FloatingPointError("loss became nan")

    monkeypatch.setattr("lmforge.train.step.StepRunner.run_step", diverged)
    with pytest.raises(FloatingPointError):
        run_pretrain(make_recipe(**{"train.max_steps": 12, "train.lr": 10.0}))
    assert (tmp_path / "run" / "config.yaml").read_text() == config


def test_the_config_of_a_resumed_run_is_replaced_once_it_checkpoints(make_recipe, tmp_path):
    run_pretrain(make_recipe())
    run_pretrain(make_recipe(**{"train.max_steps": 12}))
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["max_steps"] == 12


def test_a_second_run_into_a_busy_run_dir_fails_at_once_naming_the_holder(make_recipe, tmp_path):
    holder = hold_in_subprocess(tmp_path / "run")
    try:
        with pytest.raises(RunDirBusy, match=rf"pid {holder.pid} on "):
            run_pretrain(make_recipe())
        assert not (tmp_path / "run" / METRICS_FILE).exists() and not (tmp_path / "run" / "config.yaml").exists()
    finally:
        holder.communicate("")
    with run_dir_lock(tmp_path / "run"):  # free again once the holder has finished
        pass
