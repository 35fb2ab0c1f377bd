"""A run's checkpoints stay one history: starting over or from an earlier checkpoint sets the
later ones aside instead of letting them outrank (or prune) the new run's; damaged or
mismatched checkpoints are refused with a message that names them."""

from __future__ import annotations

import logging

import pytest

from lmforge.checkpoints.files import verify_checksums
from lmforge.checkpoints.load import latest_valid_checkpoint, load_model
from lmforge.core.config import ConfigError
from lmforge.core.io import InputError
from lmforge.stages.pretrain import run_pretrain


def names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_corrupt_checksums_file_is_an_input_error_and_resume_skips_it(make_recipe, tmp_path):
    run_pretrain(make_recipe())
    newest = tmp_path / "run" / "checkpoints" / "step_00000008"
    (newest / "checksums.json").write_text('{"model.safe')  # cut short
    with pytest.raises(InputError, match="checksums.json: unreadable"):
        verify_checksums(newest)
    assert latest_valid_checkpoint(tmp_path / "run").name == "step_00000004"
    _, used = load_model(tmp_path / "run")  # what generate and export do with a run directory
    assert used.name == "step_00000004"
    summary = run_pretrain(make_recipe())
    assert summary["start_step"] == 4 and summary["step"] == 8


def test_starting_over_sets_the_old_runs_checkpoints_aside(make_recipe, tmp_path):
    run_pretrain(make_recipe(**{"train.max_steps": 6, "train.checkpoint_every": 2}))
    assert names(tmp_path / "run" / "checkpoints") == ["step_00000004", "step_00000006"]
    summary = run_pretrain(make_recipe(**{"train.max_steps": 2, "train.resume": "never", "train.keep_checkpoints": 2}))
    # the new run's own checkpoint survives pruning and is the one a later resume or export finds
    assert names(tmp_path / "run" / "checkpoints") == ["step_00000002"]
    assert summary["checkpoint"].endswith("step_00000002")
    assert latest_valid_checkpoint(tmp_path / "run").name == "step_00000002"
    [aside] = (tmp_path / "run").glob("checkpoints.superseded-*")
    assert names(aside) == ["step_00000004", "step_00000006"]  # kept, not deleted


def test_resuming_from_an_earlier_checkpoint_sets_the_later_ones_aside(make_recipe, tmp_path):
    run_pretrain(make_recipe(**{"train.max_steps": 8, "train.checkpoint_every": 2, "train.keep_checkpoints": 4}))
    earlier = tmp_path / "run" / "checkpoints" / "step_00000004"
    summary = run_pretrain(make_recipe(**{"train.max_steps": 6, "train.resume": str(earlier),
                                          "train.checkpoint_every": 2, "train.keep_checkpoints": 1}))
    assert summary["start_step"] == 4 and summary["checkpoint"].endswith("step_00000006")
    assert names(tmp_path / "run" / "checkpoints") == ["step_00000006"]
    [aside] = (tmp_path / "run").glob("checkpoints.superseded-*")
    assert names(aside) == ["step_00000006", "step_00000008"]


def test_keep_checkpoints_must_keep_at_least_one(make_recipe):
    with pytest.raises(ConfigError, match=r"'train\.keep_checkpoints' = 0: must be >= 1"):
        make_recipe(**{"train.keep_checkpoints": 0})


def test_resuming_into_a_different_model_names_the_checkpoint_and_the_way_out(make_recipe, tmp_path):
    run_pretrain(make_recipe(**{"train.max_steps": 4}))
    with pytest.raises(InputError, match=r"step_00000004: weights do not match the model config: .*\(the model has .*"
                                         r"train\.resume=never"):
        run_pretrain(make_recipe(**{"train.max_steps": 8, "model.d_model": 64}))


def test_resuming_with_changed_settings_warns_about_each(make_recipe, caplog):
    run_pretrain(make_recipe(**{"train.max_steps": 4}))
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        run_pretrain(make_recipe(**{"train.max_steps": 8, "train.micro_batch_size": 2}))
    changed = [r.getMessage() for r in caplog.records if "changed setting" in r.getMessage()]
    assert any("train.micro_batch_size was 4, now 2" in m for m in changed)
    assert any("train.max_steps was 4, now 8" in m for m in changed)
    assert not any("train.lr" in m for m in changed)


def test_a_resumed_auto_precision_run_keeps_the_precision_it_started_with(make_recipe, tmp_path, monkeypatch):
    import lmforge.train.loop as loop

    monkeypatch.setattr(loop, "resolve_precision", lambda precision, device: ("bf16", "auto"))
    first = run_pretrain(make_recipe(**{"train.max_steps": 4, "train.precision": "auto"}))
    assert first["precision"] == "bf16"
    monkeypatch.setattr(loop, "resolve_precision", lambda precision, device: ("fp32", "auto"))  # the machine now measures otherwise
    resumed = run_pretrain(make_recipe(**{"train.max_steps": 6, "train.precision": "auto"}))
    assert resumed["start_step"] == 4 and resumed["precision"] == "bf16"
    assert resumed["precision_reason"] == "auto: kept from the checkpoint resumed"
    fresh = run_pretrain(make_recipe(tmp_path / "fresh", **{"train.max_steps": 2, "train.precision": "auto"}))
    assert fresh["precision"] == "fp32"


def test_a_resumed_run_reads_its_trainer_state_once(make_recipe, monkeypatch):
    from pathlib import Path

    import lmforge.train.loop as loop

    monkeypatch.setattr(loop, "resolve_precision", lambda precision, device: ("fp32", "auto"))
    run_pretrain(make_recipe(**{"train.max_steps": 4, "train.precision": "auto"}))
    reads, read_text = [], Path.read_text

    def counting_read_text(path, *args, **kwargs):
        if path.name == "trainer_state.json":
            reads.append(path)
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting_read_text)
    resumed = run_pretrain(make_recipe(**{"train.max_steps": 6, "train.precision": "auto"}))
    assert resumed["start_step"] == 4 and [p.parent.name for p in reads] == ["step_00000004"]


def test_tensorboard_shows_each_step_once_after_a_resume_and_after_starting_over(make_recipe, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def loss_steps() -> list[int]:
        events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
        events.Reload()
        return [e.step for e in events.Scalars("loss")]

    run_pretrain(make_recipe(**{"train.max_steps": 6, "train.tensorboard": True, "train.stop_at_step": 4,
                                "train.checkpoint_every": 2}))
    (tmp_path / "run" / "checkpoints" / "step_00000004").rename(tmp_path / "step_4")  # resume from step 2
    run_pretrain(make_recipe(**{"train.max_steps": 6, "train.tensorboard": True, "train.checkpoint_every": 2}))
    assert loss_steps() == [1, 2, 3, 4, 5, 6]
    run_pretrain(make_recipe(**{"train.max_steps": 3, "train.tensorboard": True, "train.resume": "never"}))
    assert loss_steps() == [1, 2, 3]


def test_a_verified_checkpoint_is_hashed_once_until_a_file_changes(make_recipe, tmp_path, monkeypatch):
    import lmforge.checkpoints.files as checkpoint

    run_pretrain(make_recipe())
    newest = tmp_path / "run" / "checkpoints" / "step_00000008"
    hashed = []
    real = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda f: hashed.append(f.name) or real(f))
    monkeypatch.setattr(checkpoint, "_verified", {})
    verify_checksums(newest)
    files = len(hashed)
    assert files >= 4
    verify_checksums(newest)
    latest_valid_checkpoint(tmp_path / "run")  # resume, the precision choice and loading all ask
    assert len(hashed) == files
    import os

    weights = newest / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))  # one byte changed, size and mtime put back: verified anew, and refused
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(InputError, match="model.safetensors: checksum mismatch"):
        verify_checksums(newest)


def test_a_checkpoint_config_of_nested_aliases_is_not_expanded_on_resume(tmp_path, caplog):
    import time as _time

    from lmforge.core.config import load_config
    from lmforge.stages.pretrain import PretrainRecipe
    from lmforge.train.checkpointer import _log_recipe_changes
    from tests.core.test_untrusted import BOMB

    (tmp_path / "config.yaml").write_text(BOMB)  # a crafted checkpoint: compared with the recipe on resume
    start = _time.perf_counter()
    with caplog.at_level("WARNING", logger="lmforge"):
        _log_recipe_changes(tmp_path, load_config(PretrainRecipe, None, []))
    assert _time.perf_counter() - start < 5 and "resuming with a changed setting" not in caplog.text
