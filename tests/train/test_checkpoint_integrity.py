"""A run never saves or resumes from non-finite weights, never loses its history quietly, and
cleans up what a killed run left: non-finite steps are skipped and counted, a checkpoint is
checked before it is written, resume falls back past a poisoned one, and a run whose
checkpoints are all invalid stops and asks."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.checkpoints.files import write_checksums
from lmforge.checkpoints.load import latest_valid_checkpoint, load_model
from lmforge.core.io import InputError
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.metrics import read_metrics


def poison_gradients_at(monkeypatch, steps: set[int]) -> None:
    """Make the gradient of the given (1-based) optimizer steps NaN while the loss stays finite."""
    real, calls = torch.nn.utils.clip_grad_norm_, []

    def clip(params, *args, **kwargs):
        params = list(params)
        calls.append(None)
        if len(calls) in steps:
            params[0].grad.fill_(float("nan"))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)


def weights(ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def test_a_step_with_a_nan_gradient_norm_is_skipped_and_counted(make_recipe, tmp_path, monkeypatch):
    poison_gradients_at(monkeypatch, {2})
    summary = run_pretrain(make_recipe(**{"train.max_steps": 4, "train.checkpoint_every": 1,
                                          "train.keep_checkpoints": 4}))
    ckpts = tmp_path / "run" / "checkpoints"
    before, skipped, after = (weights(ckpts / f"step_0000000{i}") for i in (1, 2, 3))
    assert all(torch.equal(before[k], skipped[k]) for k in before)  # the NaN step changed nothing
    assert all(torch.isfinite(v).all() for v in after.values())
    assert not all(torch.equal(skipped[k], after[k]) for k in skipped)  # later steps train on
    assert summary["step"] == 4 and summary["nonfinite_steps"] == 1
    assert [r["nonfinite_steps"] for r in read_metrics(tmp_path / "run")] == [0, 1, 1, 1]


def test_consecutive_nonfinite_steps_stop_the_run_with_finite_checkpoints_only(make_recipe, tmp_path, monkeypatch):
    poison_gradients_at(monkeypatch, set(range(2, 100)))
    with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient norm for 3 steps in a row.*resume from the last checkpoint"):
        run_pretrain(make_recipe(**{"train.max_steps": 20, "train.checkpoint_every": 1, "train.keep_checkpoints": 20}))
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert ckpts and all(torch.isfinite(v).all() for c in ckpts for v in weights(c).values())


def test_a_checkpoint_is_never_written_from_nonfinite_weights(make_recipe, tmp_path, monkeypatch):
    from lmforge.train.step import StepRunner

    real, calls = StepRunner.run_step, []

    def poisoning_step(runner, *args, **kwargs):
        result = real(runner, *args, **kwargs)
        calls.append(None)
        if len(calls) == 2:  # an update that overflows the weights although its gradient was finite
            with torch.no_grad():
                next(runner.model.parameters()).fill_(float("inf"))
        return result

    monkeypatch.setattr(StepRunner, "run_step", poisoning_step)
    with pytest.raises(FloatingPointError, match=r"step 2: .*non-finite.*not written"):
        run_pretrain(make_recipe(**{"train.max_steps": 4, "train.checkpoint_every": 1, "train.keep_checkpoints": 4}))
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")] == ["step_00000001"]



@pytest.mark.parametrize("how", ["nonfinite steps", "nonfinite weights"])
def test_a_diverged_run_is_one_error_line_with_exit_status_1_on_the_command_line(
        how, tmp_path, monkeypatch, capsys, shards_dir, small_tokenizer_dir):
    """Not a traceback: the message says the step and what to change. Exit status 1, not 2: the
    recipe was valid; the run failed."""
    from lmforge.cli.main import main
    from lmforge.train.step import StepRunner
    from tests.train.conftest import tiny_pretrain_overrides

    if how == "nonfinite steps":
        poison_gradients_at(monkeypatch, set(range(2, 100)))
        message = r"non-finite loss or gradient norm for 3 steps in a row, each skipped \(step 4: .*warmup_steps"
    else:
        real = StepRunner.run_step

        def overflowing_step(runner, *args, **kwargs):
            result = real(runner, *args, **kwargs)
            with torch.no_grad():
                next(runner.model.parameters()).fill_(float("inf"))
            return result

        monkeypatch.setattr(StepRunner, "run_step", overflowing_step)
        message = r"step 1: the weights hold non-finite values \(.*\); checkpoint .*step_00000001 not written"
    overrides = tiny_pretrain_overrides(tmp_path / "run", shards_dir, small_tokenizer_dir, **{
        "train.max_steps": 6, "train.checkpoint_every": 1})
    assert main(["pretrain", *overrides]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if "error" in line]
    assert re.fullmatch(rf"lmforge pretrain: error: {message}.*", line)


def poison_checkpoint(ckpt) -> None:
    """What the guard-less loop wrote: every tensor NaN, with checksums that verify."""
    state = weights(ckpt)
    save_file({k: torch.full_like(v, float("nan")) for k, v in state.items()}, str(ckpt / "model.safetensors"),
              metadata={"format": "pt"})
    (ckpt / "checksums.json").unlink()
    write_checksums(ckpt)


def test_resume_falls_back_past_a_checkpoint_with_nonfinite_weights_and_sets_it_aside(make_recipe, tmp_path, caplog):
    run_pretrain(make_recipe())
    run = tmp_path / "run"
    poison_checkpoint(run / "checkpoints" / "step_00000008")
    assert latest_valid_checkpoint(run).name == "step_00000004"
    with pytest.raises(InputError, match="step_00000008.*non-finite"):
        load_model(run / "checkpoints" / "step_00000008")  # generate / export of it directly
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        summary = run_pretrain(make_recipe())
    assert summary["start_step"] == 4 and summary["step"] == 8
    assert any("step_00000008" in r.getMessage() and "non-finite" in r.getMessage() for r in caplog.records)
    [aside] = run.glob("checkpoints.superseded-*")
    assert [p.name for p in aside.iterdir()] == ["step_00000008"]
    assert all(torch.isfinite(v).all() for v in weights(run / "checkpoints" / "step_00000008").values())


def test_a_run_whose_checkpoints_are_all_invalid_stops_and_asks_instead_of_starting_over(make_recipe, tmp_path):
    run_pretrain(make_recipe())
    run = tmp_path / "run"
    history = (run / "metrics.jsonl").read_text()
    for ckpt in (run / "checkpoints").glob("step_*"):
        (ckpt / "checksums.json").write_text("{")
    with pytest.raises(InputError, match=r"no valid checkpoint .*train\.resume=never"):
        run_pretrain(make_recipe(**{"train.max_steps": 12}))
    assert (run / "metrics.jsonl").read_text() == history
    summary = run_pretrain(make_recipe(**{"train.max_steps": 2, "train.resume": "never"}))  # starting over still works
    assert summary["start_step"] == 0


def test_temporary_directories_of_a_killed_run_are_removed_at_the_next_start(make_recipe, tmp_path, caplog):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    leftovers = [ckpts / ".step_00000004.abcd_123.tmp", ckpts / ".step_00000008.x1y2z3w4.tmp",
                 ckpts.parent / ".final.q9r8s7t6.tmp"]
    for path in leftovers:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half")
    keep = ckpts / "notes.tmp"  # not one of lmforge's temporary names
    keep.write_text("mine")
    with caplog.at_level(logging.INFO, logger="lmforge"):
        run_pretrain(make_recipe(**{"train.max_steps": 2}))
    assert not any(p.exists() for p in leftovers) and keep.exists()
    assert any("removed 3 temporary" in r.getMessage() for r in caplog.records)
