"""Every name a user gives that becomes a file or folder name (or a key split on '/') goes through
``core.untrusted.path_name``: this walks each such key with names that would escape.

The keys: a lifecycle's stage and round names (each a run directory and ``<name>-loss.png``),
a sweep's model names and the grid points named from them (run directories), an eval task's
``task`` and a suite's ``group`` (results keys ``eval/<task>/<metric>``, split on '/').
Constitution, principle and judge names become no path (``tests/feedback/test_cai.py`` checks
that nothing is written outside run_dir with such names)."""

from pathlib import Path

import pytest

from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError
from lmforge.eval.suite import load_suite
from lmforge.eval.tasks import load_task
from lmforge.stages.lifecycle import LifecycleRecipe
from lmforge.stages.sweep import SweepRecipe, model_sizes
from tests.eval.conftest import MC_YAML, write_tasks

ESCAPES = ["../../../ESCAPED", "/tmp/ESCAPED", "a/b", "a\\b", "..", "."]


def lifecycle_stage(inputs: Path, name: str) -> None:
    load_config(LifecycleRecipe, None, [f"stages=[{{name: {name!r}, verb: tokenizer}}]"])


def lifecycle_round(inputs: Path, name: str) -> None:
    load_config(LifecycleRecipe, None, [f"rounds={{count: 1, stages: [{{name: {name!r}, verb: tokenizer}}]}}"])


def sweep_model(inputs: Path, name: str) -> None:
    model_sizes(load_config(SweepRecipe, None, [f"models=[{{name: {name!r}, d_model: 32}}]"]), {})


def eval_task(inputs: Path, name: str) -> None:
    path = inputs / "task.yaml"
    path.write_text(MC_YAML.replace("task: tiny_mc", f"task: {name!r}"))
    load_task(path)


def eval_group(inputs: Path, name: str) -> None:
    path = inputs / "suite.yaml"
    path.write_text(f"group: {name!r}\ntask: [tiny_mc.yaml]\n")
    load_suite(path)


KEYS = {
    r"stages\[0\]\.name": lifecycle_stage,
    r"rounds\.stages\[0\]\.name": lifecycle_round,
    r"sweep models\[0\]\.name": sweep_model,
    r"task\.yaml:1: task": eval_task,
    r"suite\.yaml:1: group": eval_group,
}


# a round's stage runs as <name>_r<round>: '.._r1' is a plain name
CASES = [(key, name) for key in sorted(KEYS) for name in ESCAPES if not (key.startswith("rounds") and name in (".", ".."))]


@pytest.mark.parametrize("key, name", CASES)
def test_every_name_that_becomes_a_path_refuses_what_would_escape(key, name, tmp_path, monkeypatch, corpus_texts):
    inputs = tmp_path / "inputs"
    write_tasks(inputs, corpus_texts)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises((ConfigError, InputError), match=rf"{key} = .*(path separator|relative path, not a name)"):
        KEYS[key](inputs, name)
    assert not any(work.iterdir()) and not Path("/tmp/ESCAPED").exists()
