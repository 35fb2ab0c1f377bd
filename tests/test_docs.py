"""The text a user reads is true: every recipe that a verb's `--help`, the README or docs/*.md
names exists in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmforge.cli.main import build_parser, build_verb_parser
from lmforge.stages import VERBS

REPO = Path(__file__).resolve().parents[1]
RECIPE_PATH = re.compile(r"recipes/[\w./-]+?\.ya?ml")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def named_recipes(text: str) -> set[str]:
    return set(RECIPE_PATH.findall(text))


def test_the_pattern_finds_recipe_paths_in_prose():
    text = "run `lmforge pretrain recipes/demo/pretrain.yaml` or recipes/distributed/gpu_fsdp_tp.yaml, then recipes/x.yml."
    assert named_recipes(text) == {"recipes/demo/pretrain.yaml", "recipes/distributed/gpu_fsdp_tp.yaml", "recipes/x.yml"}


@pytest.mark.parametrize("verb", VERBS, ids=lambda v: v.name)
def test_every_recipe_a_verbs_help_names_exists(verb):
    parser, _ = build_verb_parser(verb)
    missing = sorted(p for p in named_recipes(parser.format_help()) if not (REPO / p).is_file())
    assert not missing, f"`lmforge {verb.name} --help` names recipes that do not exist: {missing}"


def test_every_recipe_the_top_level_help_names_exists():
    missing = sorted(p for p in named_recipes(build_parser().format_help()) if not (REPO / p).is_file())
    assert not missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_recipe_the_readme_and_docs_name_exists(doc):
    named = named_recipes(doc.read_text(encoding="utf-8"))
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"{doc.relative_to(REPO)} names recipes that do not exist: {missing}"


def test_the_readme_names_recipes():
    assert len(named_recipes((REPO / "README.md").read_text(encoding="utf-8"))) >= 5  # the check above has work to do
