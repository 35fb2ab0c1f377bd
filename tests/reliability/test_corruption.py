"""Corruption of every file a run reads back, detected, named, and skipped or refused: each file
of a training checkpoint (truncated, or one byte flipped), token shards changed in place, and a
reused prepare stage whose shards changed under the same size and time."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from lmforge.checkpoints.files import write_checksums
from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.core.config import load_config
from lmforge.core.io import InputError
from lmforge.stages.lifecycle import LifecycleRecipe, run_lifecycle
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics
from tests.train.conftest import tiny_pretrain_overrides

CHECKPOINT_FILES = ["model.safetensors", "model.json", "optimizer.pt", "rng.pt", "trainer_state.json", "config.yaml",
                    "checksums.json", "tokenizer.json", "tokenizer_config.json"]
DAMAGES = ["truncated", "flipped"]
STEP_2, STEP_4 = "step_00000002", "step_00000004"


def tiny_overrides(run_dir: Path, shards: Path, tokenizer: Path, **overrides) -> list[str]:
    """tests/train's tiny recipe as dotted overrides: 6 steps, a checkpoint every 2."""
    return tiny_pretrain_overrides(run_dir, shards, tokenizer, **{
        "train.max_steps": 6, "train.batch_tokens": 128, "train.eval_every": 0, "train.eval_batches": 20,
        "train.checkpoint_every": 2, "train.keep_checkpoints": 2, **overrides})


def tiny_recipe(run_dir: Path, shards: Path, tokenizer: Path, **overrides) -> PretrainRecipe:
    return load_config(PretrainRecipe, None, tiny_overrides(run_dir, shards, tokenizer, **overrides))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shards_dir, small_tokenizer_dir):
    """An uninterrupted 6-step run, and the same run stopped at step 4 (checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("corruption")
    run_pretrain(tiny_recipe(root / "full", shards_dir, small_tokenizer_dir))
    stopped = run_pretrain(tiny_recipe(root / "stopped", shards_dir, small_tokenizer_dir, **{"train.stop_at_step": 4}))
    assert stopped["step"] == 4
    return root


def damage(path: Path, how: str) -> None:
    """Cut ``path`` in half, or flip one bit of its middle byte (of checksums.json: of a digest's)."""
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
        return
    at = len(raw) // 2
    if path.name == "checksums.json":
        at = raw.index(b'": "', at) + 10
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


def names_damage(message: str, ckpt: Path, name: str, how: str) -> bool:
    """Whether an error names the damaged file. A flipped digest inside checksums.json reads as
    the file it describes being changed: the checkpoint and a checksum mismatch are what is named."""
    if name == "checksums.json" and how == "flipped":
        return str(ckpt) in message and "checksum mismatch" in message
    return str(ckpt / name) in message


@pytest.fixture()
def damaged_run(runs, tmp_path, request):
    """A copy of the stopped run whose newest checkpoint has one file damaged."""
    name, how = request.param
    run = Path(shutil.copytree(runs / "stopped", tmp_path / "run"))
    damage(run / "checkpoints" / STEP_4 / name, how)
    return run, name, how


@pytest.mark.parametrize("damaged_run", [(n, h) for n in CHECKPOINT_FILES for h in DAMAGES], indirect=True,
                         ids=[f"{n}-{h}" for n in CHECKPOINT_FILES for h in DAMAGES])
def test_resume_skips_a_damaged_checkpoint_naming_the_file_and_continues_exactly_from_the_previous_one(
        damaged_run, runs, shards_dir, small_tokenizer_dir, lmforge_log):
    run, name, how = damaged_run
    summary = run_pretrain(tiny_recipe(run, shards_dir, small_tokenizer_dir, **{"train.resume": "auto"}))
    assert summary["start_step"] == 2 and summary["step"] == 6
    skipped = [r.getMessage() for r in lmforge_log.records if r.getMessage().startswith("skipping checkpoint")]
    assert len(skipped) == 1 and names_damage(skipped[0], run / "checkpoints" / STEP_4, name, how), skipped
    assert losses(run) == losses(runs / "full")  # bit-identical, step by step


@pytest.mark.parametrize("damaged_run", [(n, h) for n in CHECKPOINT_FILES for h in DAMAGES], indirect=True,
                         ids=[f"{n}-{h}" for n in CHECKPOINT_FILES for h in DAMAGES])
def test_loading_a_damaged_checkpoint_directly_is_a_one_line_error_naming_the_file(damaged_run, tmp_path, capsys):
    run, name, how = damaged_run
    ckpt = run / "checkpoints" / STEP_4
    with pytest.raises(InputError) as err:
        load_model(ckpt)
    assert names_damage(str(err.value), ckpt, name, how), err.value
    for argv in (["generate", f"checkpoint={ckpt}", "max_new_tokens=2"], ["export", str(ckpt), str(tmp_path / "hf")]):
        assert main(argv) == 2, argv
        err_lines = capsys.readouterr().err.strip().splitlines()
        assert "Traceback" not in "\n".join(err_lines)
        assert err_lines[-1].startswith(f"lmforge {argv[0]}: error: ") and names_damage(err_lines[-1], ckpt, name, how)
    assert not (tmp_path / "hf").exists()


def test_a_damaged_file_name_in_checksums_json_names_checksums_json(runs, tmp_path):
    ckpt = Path(shutil.copytree(runs / "stopped" / "checkpoints" / STEP_4, tmp_path / "ckpt"))
    checksums = ckpt / "checksums.json"
    checksums.write_text(checksums.read_text().replace('"rng.pt"', '"rog.pt"'))  # one flipped bit
    with pytest.raises(InputError, match=re.escape(str(checksums))):
        load_model(ckpt)


# A file damaged before its checksum was taken (or with checksums.json rewritten to match): the
# checksums pass, so what reads the file must still fail with an error naming it, not a traceback.
@pytest.mark.parametrize("name", ["optimizer.pt", "rng.pt", "trainer_state.json"])  # resume never reads model.json
def test_a_truncated_file_whose_checksum_matches_is_an_input_error_naming_it_on_resume(
        runs, tmp_path, shards_dir, small_tokenizer_dir, name):
    run = Path(shutil.copytree(runs / "stopped", tmp_path / "run"))
    ckpt = run / "checkpoints" / STEP_4
    damage(ckpt / name, "truncated")
    write_checksums(ckpt)
    with pytest.raises(InputError, match=re.escape(str(ckpt / name))):
        run_pretrain(tiny_recipe(run, shards_dir, small_tokenizer_dir, **{"train.resume": "auto"}))


def test_truncated_weights_under_a_matching_checksum_are_skipped_on_resume_naming_the_file(
        runs, tmp_path, shards_dir, small_tokenizer_dir, lmforge_log):
    """The scan for finite weights reads every tensor: a truncated file fails it as a bad checksum would."""
    run = Path(shutil.copytree(runs / "stopped", tmp_path / "run"))
    ckpt = run / "checkpoints" / STEP_4
    damage(ckpt / "model.safetensors", "truncated")
    write_checksums(ckpt)
    summary = run_pretrain(tiny_recipe(run, shards_dir, small_tokenizer_dir, **{"train.resume": "auto"}))
    assert summary["start_step"] == 2
    skipped = [r.getMessage() for r in lmforge_log.records if r.getMessage().startswith("skipping checkpoint")]
    assert len(skipped) == 1 and str(ckpt / "model.safetensors") in skipped[0], skipped
    assert losses(run) == losses(runs / "full")


def test_loading_a_checkpoint_whose_model_json_is_truncated_under_a_matching_checksum_names_it(runs, tmp_path):
    ckpt = Path(shutil.copytree(runs / "stopped" / "checkpoints" / STEP_4, tmp_path / "ckpt"))
    damage(ckpt / "model.json", "truncated")
    write_checksums(ckpt)
    with pytest.raises(InputError, match=re.escape(str(ckpt / "model.json"))):
        load_model(ckpt)


# --------------------------------------------------------------------------- token shards


@pytest.fixture()
def own_shards(shards_dir, tmp_path):
    return Path(shutil.copytree(shards_dir, tmp_path / "shards"))


def flip_keeping_stamps(path: Path) -> None:
    """Flip one byte of ``path`` and put its size and modification time back."""
    st = os.stat(path)
    damage(path, "flipped")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_resuming_pretraining_verifies_the_shards_and_names_one_changed_since(own_shards, tmp_path,
                                                                               small_tokenizer_dir):
    run = tmp_path / "run"
    run_pretrain(tiny_recipe(run, own_shards, small_tokenizer_dir, **{"train.stop_at_step": 2}))
    shard = own_shards / "train-00000.tokens.npy"
    damage(shard, "flipped")
    with pytest.raises(InputError, match=rf"^{re.escape(str(shard))}: sha256 [0-9a-f]{{64}} does not match [0-9a-f]{{64}}"):
        run_pretrain(tiny_recipe(run, own_shards, small_tokenizer_dir, **{"train.resume": "auto"}))


def test_a_fresh_run_verifies_the_shards_only_when_asked(own_shards, tmp_path, small_tokenizer_dir):
    damage(own_shards / "train-00000.tokens.npy", "flipped")
    assert run_pretrain(tiny_recipe(tmp_path / "a", own_shards, small_tokenizer_dir,
                                    **{"train.max_steps": 1, "train.warmup_steps": 0, "train.checkpoint_every": 0}))["step"] == 1
    with pytest.raises(InputError, match="train-00000.tokens.npy: sha256"):
        run_pretrain(tiny_recipe(tmp_path / "b", own_shards, small_tokenizer_dir,
                                 **{"train.max_steps": 1, "train.warmup_steps": 0, "data.verify_shards": "true"}))


def test_pretrain_on_a_damaged_manifest_is_a_one_line_error_naming_it(own_shards, tmp_path, small_tokenizer_dir,
                                                                      capsys):
    manifest = json.loads((own_shards / "manifest.json").read_text())
    manifest["splits"]["train"]["n_tokens"] = str(manifest["splits"]["train"]["n_tokens"])
    (own_shards / "manifest.json").write_text(json.dumps(manifest))
    assert main(["pretrain", *tiny_overrides(tmp_path / "run", own_shards, small_tokenizer_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"lmforge pretrain: error: {own_shards / 'manifest.json'}: splits.train.n_tokens is '")


def test_a_reused_prepare_stage_whose_shard_changed_under_the_same_size_and_time_runs_again(
        tmp_path, small_tokenizer_dir, corpus_jsonl, lmforge_log):
    prepare = tmp_path / "prepare.yaml"
    prepare.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "data"), "tokenizer": str(small_tokenizer_dir),
                                       "data": {"paths": [str(corpus_jsonl)]}, "val_fraction": 0.1}))
    life = tmp_path / "lifecycle.yaml"
    life.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "life"),
                                    "stages": [{"name": "prepare", "verb": "prepare", "recipe": str(prepare)}]}))
    run_lifecycle(load_config(LifecycleRecipe, life))
    shard = tmp_path / "data" / "train-00000.tokens.npy"
    original = shard.read_bytes()
    assert [r["status"] for r in run_lifecycle(load_config(LifecycleRecipe, life))] == ["skipped"]
    flip_keeping_stamps(shard)
    lmforge_log.clear()
    assert [r["status"] for r in run_lifecycle(load_config(LifecycleRecipe, life))] == ["ran"]
    assert any(str(shard) in r.getMessage() and "stale" in r.getMessage() for r in lmforge_log.records)
    assert shard.read_bytes() == original  # prepared again, byte-identical
