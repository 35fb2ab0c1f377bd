"""The measured figures of the docs are their JSON's: every ``bench:`` block of benchmarks/README.md
and docs/ is what scripts/write_benchmark_docs.py writes from benchmarks/results/*.json, and the
guides carry no dated, hand-copied figures outside those blocks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import benchmark_docs_writer

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "write_benchmark_docs.py"
# the pages whose hand-copied figures became blocks or were deleted (issue 37)
CLEANED = ["benchmarks/README.md", "docs/demo.md", "docs/rl.md", "docs/alignment.md", "docs/fine-tuning.md",
           "docs/scaling.md", "docs/cai.md", "docs/serving.md", "docs/evaluation.md", "docs/distributed.md",
           "docs/reliability.md", "docs/architectures.md", "docs/ARCHITECTURE.md"]
# a date or a commit hash (as tests/test_docs.py's WHEN), a load average, a "busy" machine
WHEN = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|busy hour"
                  r"|\bload average\b|\b\d+ (?:busy|loaded|idle) cores\b", re.I)


@pytest.fixture(scope="module")
def script():
    return benchmark_docs_writer()


def test_the_repositorys_blocks_are_their_json():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr


def test_every_result_has_a_block_in_the_benchmarks_readme(script):
    names = script.block_names((REPO / "benchmarks" / "README.md").read_text(encoding="utf-8"))
    assert {p.stem for p in (REPO / "benchmarks" / "results").glob("*.json")} <= set(names)
    assert "summary" in names


@pytest.mark.parametrize("page", CLEANED)
def test_the_guides_carry_no_dates_hashes_or_loads_outside_the_blocks(page, script):
    text = script.BLOCK.sub("", (REPO / page).read_text(encoding="utf-8"))
    found = [f"{page}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in WHEN.finditer(text)]
    assert not found, "measured figures belong in benchmarks/results/*.json and their blocks: " + "; ".join(found)


PAGE = """# A page

Some prose.

<!-- bench:toy: written by scripts/write_benchmark_docs.py from benchmarks/results/toy.json -->
a stale table
<!-- /bench:toy -->

More prose.
"""


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result), encoding="utf-8")


def test_a_block_is_written_from_its_json_and_checked(tmp_path, script, capsys):
    results, index, page = tmp_path / "results", tmp_path / "index.md", tmp_path / "page.md"
    write_json(results / "toy.json", {"benchmark": "toy", "figure": "widgets per second", "widgets_per_s": 12.5})
    index.write_text("# index\n\n" + script.block("summary", "") + "\n", encoding="utf-8")
    page.write_text(PAGE, encoding="utf-8")
    args = ["--results", str(results), "--index", str(index), str(page)]
    assert script.main(["--check", *args]) == 1  # stale, and the index has no block for toy.json
    err = capsys.readouterr().err
    assert "page.md: block bench:toy is not its JSON's" in err and "index.md: no block for" in err

    assert script.main(args) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# A page\n\nSome prose.\n\n") and text.endswith("\n\nMore prose.\n")  # prose untouched
    assert "a stale table" not in text and "| `widgets_per_s` | 12.5 |" in text
    # what the JSON does not record is said, not invented
    assert "Machine: not recorded; date: not recorded; command: not recorded." in text
    assert "## toy" in index.read_text(encoding="utf-8")  # the index got a section for the new result
    assert script.main(["--check", *args]) == 0

    write_json(results / "toy.json", {"benchmark": "toy", "widgets_per_s": 13.0, "command": "python toy.py",
                                      "date": "2030-01-02T03:04:05+00:00", "machine": {"cpu": "Some CPU", "cpus": 4}})
    assert script.main(["--check", *args]) == 1
    assert script.main(args) == 0
    assert "Machine: Some CPU, 4 cores; date: 2030-01-02; command: `python toy.py`." \
        in page.read_text(encoding="utf-8")
    assert script.main(["--check", *args]) == 0


def test_a_block_naming_no_result_is_an_error(tmp_path, script, capsys):
    results, index = tmp_path / "results", tmp_path / "index.md"
    results.mkdir()
    index.write_text(script.block("summary", "") + "\n\n" + script.block("gone", "old") + "\n", encoding="utf-8")
    assert script.main(["--results", str(results), "--index", str(index)]) == 1
    assert "block bench:gone names no result" in capsys.readouterr().err
    assert "old" in index.read_text(encoding="utf-8")  # a page with an unknown block is left as it is


def test_every_committed_result_renders_with_its_machine_date_and_command(script):
    for path in sorted((REPO / "benchmarks" / "results").glob("*.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        body = "\n".join(script.render(path.stem, result).lines)
        assert body.count("\n|---") >= 1, path.name  # a table
        line = body.splitlines()[-1]
        assert line.startswith("Machine: ") and "; date: " in line and "; command: " in line, line
        assert ("`" + result["command"] + "`" in line) if result.get("command") else "command: not recorded" in line
