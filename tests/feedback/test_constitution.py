"""Constitutions: the shipped ones load; a bad one is refused naming the file and the principle;
a malformed one is one line naming file:line:col; an alias bomb is refused before it expands."""

from __future__ import annotations

import re

import pytest

from lmforge.core.io import InputError
from lmforge.feedback.constitution import load_constitution
from tests.conftest import REPO


@pytest.mark.parametrize("name", ["helpful_harmless", "demo_tasks"])
def test_the_shipped_constitutions_load_with_all_three_texts(name):
    c = load_constitution(REPO / "data" / "constitutions" / f"{name}.yaml")
    assert c.name == name and len(c.principles) >= 3 and len({p.name for p in c.principles}) == len(c.principles)
    for p in c.principles:
        assert p.critique and p.revision and p.comparison.endswith("?")


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


GOOD = "  - {name: ok, critique: c, revision: r, comparison: q}\n"


@pytest.mark.parametrize("text, message", [
    ("name: x\nprinciples: []\n", "no principles"),
    ("name: x\n", "no principles"),
    ("", "is a mapping"),
    ("name: x\nprinciples:\n" + GOOD + "  - {name: terse, critique: c, comparison: q}\n",
     "principle 1 ('terse'): missing its 'revision' request"),
    ("name: x\nprinciples:\n  - {critique: c, revision: r, comparison: q}\n", "principle 0: missing its 'name'"),
    ("name: x\nprinciples:\n  - {name: e, critique: '  ', revision: r, comparison: q}\n",
     "principle 0 ('e'): 'critique' must be a non-empty string"),
    ("name: x\nprinciples:\n" + GOOD + "  - {name: z, critique: c, revision: r, comparison: q, weight: 2}\n",
     "principle 1 ('z'): unknown key(s) ['weight']"),
    ("name: x\nrules: []\nprinciples:\n" + GOOD, "unknown key(s) ['rules']"),
    ("name: x\nprinciples:\n" + GOOD + GOOD, "principle 1 ('ok') has the same name as principle 0"),
    ("name: x\nprinciples: [1, 2]\n", "principle 0 must be a mapping"),
    ("principles: [\n", ":2:1: expected the node content"),
])
def test_a_bad_constitution_is_refused_naming_the_file_and_principle(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(InputError) as err:
        load_constitution(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_a_missing_constitution_names_its_path(tmp_path):
    with pytest.raises(InputError, match="constitution not found: .*nope.yaml"):
        load_constitution(tmp_path / "nope.yaml")


def test_a_malformed_constitution_is_one_line_naming_the_file_line_and_column(tmp_path):
    path = write(tmp_path, "name: x\nprinciples:\n  - name: a\n   critique: c\n")  # line 4 indented one too far
    with pytest.raises(InputError) as err:
        load_constitution(path)
    message = str(err.value)
    assert message == f"{path}:4:4: expected <block end>, but found '<block mapping start>' " \
                      "(while parsing a block collection)"
    assert "\n" not in message and "<unicode string>" not in message


def test_a_constitution_of_nested_aliases_is_refused_before_it_expands(tmp_path):
    """Nine nested aliases: a 1 KB file that is 9**9 (387 million) strings once anything walks it."""
    levels = ["  - &l0 [" + ", ".join(["lol"] * 9) + "]"]
    levels += [f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = write(tmp_path, "name: bomb\ndescription:\n" + "\n".join(levels) + "\nprinciples:\n" + GOOD)
    assert path.stat().st_size < 1024
    with pytest.raises(InputError, match=rf"^{re.escape(str(path))}:\d+:\d+: aliases expand this document past"):
        load_constitution(path)
