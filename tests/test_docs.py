"""The text a user reads is true: every recipe that a verb's `--help`, the README or docs/*.md
names exists in the repository."""

from __future__ import annotations

import re
import subprocess
import sys
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


# ---- docstrings and recipes say what and why, not when: no dates, commit hashes or "busy hour"

WHEN = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|busy hour", re.I)


def source_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file, or every comment of a YAML file."""
    import ast
    import io
    import tokenize

    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        return [(i, line.partition("#")[2]) for i, line in enumerate(text.splitlines(), 1) if "#" in line]
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def test_the_when_pattern_finds_dates_hashes_and_busy_hours():
    for text in ["measured 2026-11-29", "at commit 4d4edb7", "`c470854`", "on a busy hour"]:
        assert WHEN.search(text), text
    for text in ["Hoffmann et al. 2022", "2048 tokens", "defaced", "sha256 of the file", "0.1234567"]:
        assert not WHEN.search(text), text


@pytest.mark.parametrize("root", ["lmforge", "recipes"])
def test_docstrings_and_recipe_comments_carry_no_dates_or_commit_hashes(root):
    files = sorted((REPO / root).rglob("*.py")) + sorted((REPO / root).rglob("*.yaml"))
    found = [f"{path.relative_to(REPO)}:{line}: {m.group(0)!r}" for path in files
             for line, text in source_prose(path) for m in [WHEN.search(text)] if m]
    assert not found, "dates, commit hashes or timings of a session belong in benchmarks/results/ and the docs: " + "; ".join(found)


def test_the_readme_families_table_is_the_registrys():
    """The model families of the README and of docs/architectures.md are written from
    ``lmforge.model.families`` by scripts/families_table.py, never by hand."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "families_table.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    from lmforge.model.families import FAMILIES

    for page in ("README.md", "docs/architectures.md"):
        text = (REPO / page).read_text(encoding="utf-8")
        assert all(f"| `{name}` |" in text for name in FAMILIES), page


# ---- the README's demo results: written by scripts/write_docs.py from a complete run's report.md


def write_docs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "write_docs.py"), *args], capture_output=True,
                          text=True)


DEMO_REPORT = """# lmforge run report

| stage | verb | status | seconds | outputs |
|---|---|---|---|---|
| pretrain | pretrain | ran | 200.4 | `runs/demo/pretrain` |
| sft | sft | skipped | 90.0 | `runs/demo/sft` |

## report card

The same tasks on each stage's final model (9 s to score; `core`: accuracies centred on chance, averaged).

| task | metric | pretrain | sft |
|---|---|---:|---:|
| demo_choices | acc ↑ | 0.2533 | 0.6933 |
| **demo_suite** | **core** ↑ | **0.0022** | **0.3489** |

## pretrain (pretrain)

- 300 steps
"""


@pytest.fixture
def readme(tmp_path) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("write_docs", REPO / "scripts" / "write_docs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    START, END = script.START, script.END
    path = tmp_path / "README.md"
    path.write_text(f"# r\n\n{START}\nnot yet\n{END}\n\nafter\n", encoding="utf-8")
    return path


def test_the_readme_has_the_demo_results_block_and_check_passes_without_a_report(tmp_path):
    done = write_docs("--check", "--report", str(tmp_path / "absent" / "report.md"))
    assert done.returncode == 0, done.stderr
    assert "no report" in done.stderr


def test_the_demo_results_are_the_report_card_and_stage_times_of_the_report(readme, tmp_path):
    report = tmp_path / "report.md"
    report.write_text(DEMO_REPORT, encoding="utf-8")
    assert write_docs("--check", "--report", str(report), "--readme", str(readme)).returncode == 1  # not written yet
    done = write_docs("--report", str(report), "--readme", str(readme), "--machine", "a test machine")
    assert done.returncode == 0, done.stderr
    text = readme.read_text(encoding="utf-8")
    assert "`make demo` on a test machine, " in text and text.endswith("\n\nafter\n")
    assert "| **demo_suite** | **core** ↑ | **0.0022** | **0.3489** |" in text
    assert "pretrain 200 s, sft 90 s; 4 min 50 s in all" in text
    assert write_docs("--check", "--report", str(report), "--readme", str(readme)).returncode == 0
    report.write_text(DEMO_REPORT.replace("0.3489", "0.3500"), encoding="utf-8")
    assert write_docs("--check", "--report", str(report), "--readme", str(readme)).returncode == 1


def test_a_report_with_a_stage_stopped_early_is_refused(readme, tmp_path):
    report = tmp_path / "report.md"
    report.write_text(DEMO_REPORT.replace("| ran |", "| stopped early at step 216 of 300 |"), encoding="utf-8")
    done = write_docs("--report", str(report), "--readme", str(readme), "--machine", "m")
    assert done.returncode == 1 and "stopped early" in done.stderr
    assert "not yet" in readme.read_text(encoding="utf-8")
