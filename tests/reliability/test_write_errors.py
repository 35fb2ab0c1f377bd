"""A full disk or a folder without write permission: the one-line error, exit 2, and what was
written before left as it was."""

from __future__ import annotations

import errno
import json
import os

import pytest

from lmforge.checkpoints.files import verify_checksums
from lmforge.checkpoints.load import checkpoint_dirs
from lmforge.cli.main import main
from lmforge.core.io import is_temporary
from tests.conftest import write_jsonl
from tests.train.conftest import tiny_pretrain_overrides


def failing_write(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))  # as write() raises it: no file name

    return fail


def temporaries(root) -> list:
    return [p for p in root.rglob("*") if is_temporary(p)]


def one_line_error(capsys, verb: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"lmforge {verb}: error: ") and "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT])
def test_prepare_on_a_full_or_read_only_disk_is_a_one_line_error_and_keeps_the_previous_output(
        tmp_path, small_tokenizer_dir, corpus_texts, capsys, monkeypatch, code):
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(corpus_texts)])
    argv = ["prepare", f"data.paths=[{docs}]", f"tokenizer={small_tokenizer_dir}", f"run_dir={tmp_path}/data"]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()}
    monkeypatch.setattr("lmforge.data.shards.np.save", failing_write(code))
    assert main(argv) == 2
    assert os.strerror(code) in one_line_error(capsys, "prepare")
    assert {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()} == before
    assert temporaries(tmp_path) == []


def test_a_read_only_run_directory_is_a_one_line_error(tmp_path, small_tokenizer_dir, corpus_jsonl, capsys,
                                                       monkeypatch):
    # tests run as root, whom chmod does not stop, so the refusal is the one mkstemp would raise
    def refuse(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    monkeypatch.setattr("tempfile.mkdtemp", refuse)
    argv = ["prepare", f"data.paths=[{corpus_jsonl}]", f"tokenizer={small_tokenizer_dir}", f"run_dir={tmp_path}/out"]
    assert main(argv) == 2
    line = one_line_error(capsys, "prepare")
    assert "Permission denied" in line and str(tmp_path) in line  # names the folder it could not write in
    assert not (tmp_path / "out").exists()


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint_intact(tmp_path, small_tokenizer_dir,
                                                                             corpus_texts, capsys, monkeypatch):
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(corpus_texts)])
    assert main(["prepare", f"data.paths=[{docs}]", f"tokenizer={small_tokenizer_dir}",
                 f"run_dir={tmp_path}/data", "val_fraction=0.1"]) == 0
    run = tmp_path / "run"
    argv = ["pretrain", *tiny_pretrain_overrides(run, tmp_path / "data", small_tokenizer_dir)]
    assert main([*argv, "train.max_steps=4"]) == 0
    [ckpt] = checkpoint_dirs(run)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    monkeypatch.setattr("lmforge.train.checkpoint.torch.save", failing_write(errno.ENOSPC))
    assert main([*argv, "train.max_steps=8"]) == 2
    assert "No space left on device" in one_line_error(capsys, "pretrain")
    assert checkpoint_dirs(run) == [ckpt] and {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    verify_checksums(ckpt)
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 4
    assert temporaries(run) == []
