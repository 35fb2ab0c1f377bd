"""The callable judge: a function that raises is an error naming the function and the item, in
the API and from `lmforge cai`; `judge.function` is a plugin, imported when the stage starts,
never while the recipe is read or printed."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from lmforge.feedback.judges import CallableJudge, Chat, Comparison, JudgeConfig, JudgeError
from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")

CONSTITUTION = str(REPO / "data" / "constitutions" / "demo_tasks.yaml")
RAISES = "tests.feedback.rules:raises"


def test_a_judge_function_that_raises_names_the_function_and_the_item():
    judge = CallableJudge(JudgeConfig(function=RAISES))
    with pytest.raises(JudgeError) as err:
        judge.compare([Comparison("p.jsonl:3 samples 0,1 (x, y)", "2+2?", "4", "five", "Which is right?")])
    assert str(err.value) == f"p.jsonl:3 samples 0,1 (x, y): the judge function {RAISES} raised " \
                             "RuntimeError('the rule broke')"
    with pytest.raises(JudgeError, match=rf"^p.jsonl:4 critique: the judge function {RAISES} raised RuntimeError"):
        judge.generate([Chat("p.jsonl:4 critique", [{"role": "user", "content": "hi"}])])


def cai_command(tmp_path, judge_checkpoint, prompts, *overrides) -> list[str]:
    return ["cai", "label", f"run_dir={tmp_path / 'cai'}", f"checkpoint={judge_checkpoint}", f"data.prompts=[{prompts}]",
            f"constitution={CONSTITUTION}", "rollout.n=3", "rollout.max_new_tokens=6", "device=cpu", *overrides]


def test_lmforge_cai_reports_a_judge_function_that_raises_as_one_error_line(tmp_path, judge_checkpoint, prompts,
                                                                            capsys):
    from lmforge.cli.main import main

    code = main(cai_command(tmp_path, judge_checkpoint, prompts, f"judge.function={RAISES}"))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith(f"lmforge cai: error: {prompts}:1 samples 0,1 (x, y): the judge function {RAISES} "
                                "raised RuntimeError('the rule broke')"), errors[0]


def test_judge_function_is_marked_as_a_plugin():
    (function,) = [f for f in dataclasses.fields(JudgeConfig) if f.name == "function"]
    assert function.metadata["plugin"] is True and function.default is None


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    """A module ``lmforge_test_plugin`` that leaves a file when imported, then fails."""
    (tmp_path / "lmforge_test_plugin.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('IMPORTED').touch()\nraise RuntimeError('plugin import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "IMPORTED"
    sys.modules.pop("lmforge_test_plugin", None)


def test_print_config_shows_the_judge_function_without_importing_it(plugin, tmp_path, capsys):
    from lmforge.cli.main import main

    code = main(["cai", "label", "judge.function=lmforge_test_plugin:judge", "--print-config"])
    out = capsys.readouterr().out
    assert code == 0 and "function: lmforge_test_plugin:judge" in out
    assert not plugin.exists() and "lmforge_test_plugin" not in sys.modules


def test_a_plugin_that_fails_to_import_is_one_error_line_when_the_stage_starts(plugin, tmp_path, judge_checkpoint,
                                                                               prompts, capsys):
    from lmforge.cli.main import main

    code = main(cai_command(tmp_path, judge_checkpoint, prompts, "judge.function=lmforge_test_plugin:judge"))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert errors[0] == ("lmforge cai: error: judge.function = 'lmforge_test_plugin:judge': cannot import "
                         "'lmforge_test_plugin': RuntimeError('plugin import') (is it in the working directory or on "
                         "PYTHONPATH?)")
    assert plugin.exists()  # imported: the stage started



@pytest.mark.parametrize("given, named", [
    ({"checkpoint": "ckpt", "function": "m:f"}, "got judge.checkpoint, judge.function "),
    ({"base_url": "http://127.0.0.1:9/v1", "model": "m", "function": "m:f"}, "got judge.base_url, judge.function "),
    ({}, "got none "),
])
def test_a_judge_of_two_kinds_or_none_is_refused_naming_the_keys_as_the_recipe_spells_them(given, named):
    from lmforge.core.config import ConfigError

    with pytest.raises(ConfigError, match="exactly one of judge.checkpoint") as err:
        JudgeConfig(**given).kind()
    assert named in str(err.value) and "judge.callable" not in str(err.value) and "judge.endpoint" not in str(err.value)
