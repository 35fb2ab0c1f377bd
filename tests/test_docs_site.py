"""The docs site (mkdocs.yml) builds with --strict, offline: every page in the nav, no broken link; its
config reference shows each verb's recipe keys as `--help` does, and its API pages the docstrings."""

from __future__ import annotations

import html
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

for package in ("mkdocs", "material", "mkdocstrings"):
    pytest.importorskip(package, reason="the docs site needs the docs extra: pip install -e '.[docs]'")

from lmforge.cli.main import recipe_keys  # noqa: E402
from lmforge.objectives.preference import dpo_loss  # noqa: E402
from lmforge.stages import VERBS, VERBS_BY_NAME  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir",
                           str(site)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    result = mkdocs_build(REPO / "mkdocs.yml", site)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return site


def test_every_verb_with_a_recipe_has_a_reference_page(site):
    missing = [v.name for v in VERBS if hasattr(v.load(), "RECIPE")
               and not (site / "reference" / v.name / "index.html").is_file()]
    assert not missing


def test_a_reference_page_lists_a_key_with_its_type_and_default_from_the_recipe(site):
    row = next(r for r in recipe_keys(VERBS_BY_NAME["pretrain"].load().RECIPE) if r.key == "train.max_steps")
    page = (site / "reference" / "pretrain" / "index.html").read_text()
    shown = page.split('<tr id="train.max_steps">', 1)[1].split("</tr>", 1)[0]
    assert f"<td>{row.type}</td>" in shown
    assert f"<code>{html.escape(row.default.removeprefix('default '))}</code>" in shown


def test_the_curate_reference_page_lists_each_step_type_with_its_keys_and_their_help():
    """What ``curate --help`` lists below its recipe keys (the step types, train-classifier) is on
    its reference page too, each key's help from its field's metadata; written by the hook, no build."""
    import dataclasses
    import importlib.util

    from lmforge.core.config import field_help
    from lmforge.curate.extract import ExtractConfig
    from lmforge.curate.steps import STEP_TYPES

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = hooks.reference_page(VERBS_BY_NAME["curate"])
    assert all(f"\n### `{name}`\n" in page for name in [*STEP_TYPES, "train-classifier"])
    timeout = next(f for f in dataclasses.fields(ExtractConfig) if f.name == "timeout_s")
    row = page.split('<tr id="extract.timeout_s">', 1)[1].split("</tr>", 1)[0]
    assert "<code>5.0</code>" in row and html.escape(field_help(timeout)) in row
    assert '<tr id="train-classifier.hash_bits">' in page


def test_an_api_page_renders_a_functions_docstring(site):
    page = (site / "api" / "objectives" / "index.html").read_text()
    first_line = inspect.getdoc(dpo_loss).splitlines()[0]
    assert 'id="lmforge.objectives.preference.dpo_loss"' in page
    assert html.escape(first_line, quote=False) in page


@pytest.fixture(scope="module")
def one_page_build(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The site's config on a docs/ of one page, with a link out of docs/ that works and two that don't."""
    root = tmp_path_factory.mktemp("one_page")
    (root / "docs").mkdir()
    (root / "README.md").write_text("# readme\n")
    (root / "docs" / "index.md").write_text(
        "# t\n\n[the readme](../README.md) [inside](missing.md) [outside](../nowhere.md)\n")
    # hooks and watched paths are relative to the config file
    (root / "mkdocs.yml").write_text(f"INHERIT: {REPO / 'mkdocs.yml'}\ndocs_dir: docs\n"
                                     f"hooks: [{REPO / 'scripts' / 'mkdocs_hooks.py'}]\nwatch: []\nnav: [index.md]\n")
    return mkdocs_build(root / "mkdocs.yml", root / "site"), root / "site"


def test_a_link_out_of_docs_to_a_file_that_exists_shows_the_files_path(one_page_build):
    _, site = one_page_build
    assert "the readme (<code>README.md</code>)" in (site / "index.html").read_text()


def test_a_broken_link_in_or_out_of_docs_fails_the_strict_build(one_page_build):
    result, _ = one_page_build
    assert result.returncode != 0
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 2, result.stderr
    assert any("contains a link 'missing.md', but the target is not found" in w for w in warnings)
    assert any("links to '../nowhere.md', which does not exist in the repository" in w for w in warnings)
