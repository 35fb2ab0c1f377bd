"""core.io's directory replacement: the target is always the old directory or the new one."""

from __future__ import annotations

import sys

import pytest

from lmforge.core import io
from lmforge.core.io import atomic_directory, replace_directory, temporary_directory


def fill(directory, name: str, text: str):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)
    return directory


@pytest.mark.parametrize("can_exchange", [True, False])
def test_replace_directory_leaves_only_the_new_directory(tmp_path, monkeypatch, can_exchange):
    if not can_exchange:  # a system without renameat2: moved aside, then removed
        monkeypatch.setattr(io, "_exchange", lambda a, b: False)
    target = fill(tmp_path / "final", "old.txt", "old")
    replace_directory(fill(temporary_directory(target), "new.txt", "new"), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no temporary or .final.old left
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    replace_directory(fill(tmp_path / "fresh", "a.txt", "a"), tmp_path / "absent")  # nothing to replace
    assert (tmp_path / "absent" / "a.txt").read_text() == "a"


@pytest.mark.skipif(sys.platform != "linux", reason="renameat2 is Linux's")
def test_an_existing_directory_is_swapped_in_one_step_on_linux(tmp_path, monkeypatch):
    calls = []
    real = io._exchange
    monkeypatch.setattr(io, "_exchange", lambda a, b: calls.append(real(a, b)) or calls[-1])
    monkeypatch.setattr(io.Path, "rename", lambda *a: pytest.fail("moved aside instead of swapped"))
    target = fill(tmp_path / "adapter", "old.txt", "old")
    with atomic_directory(target) as tmp:
        fill(tmp, "new.txt", "new")
    assert calls == [True] and [p.name for p in target.iterdir()] == ["new.txt"]


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_file_or_link_at_the_target_is_refused_and_left_as_it_is(tmp_path, kind):
    target = tmp_path / "out"
    if kind == "file":
        target.write_text("the user's own file")
    else:
        target.symlink_to(fill(tmp_path / "elsewhere", "keep.txt", "keep"))
    with pytest.raises(io.InputError, match=r"out: exists and is not a folder"):
        with atomic_directory(target) as tmp:
            fill(tmp, "new.txt", "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *(["elsewhere"] if kind == "link" else [])])
    if kind == "file":
        assert target.read_text() == "the user's own file"
    else:
        assert target.is_symlink() and [p.name for p in target.iterdir()] == ["keep.txt"]
