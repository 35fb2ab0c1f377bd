"""The docs' commands run: every fenced block marked runnable in docs/**/*.md is executed, so a
tutorial cannot drift from the code.

The mark is an HTML comment on the line before the fence (invisible on the site and on GitHub):

    <!-- runnable -->
    ```bash
    lmforge import my-model runs/base
    ```

A ```` ```bash ```` block runs with ``bash -euo pipefail``, a ```` ```python ```` block with this
interpreter. A page's blocks run in order in one fresh temporary folder (a block sees the files the
ones before it wrote), with the virtual environment's ``bin/`` first on ``PATH`` so ``lmforge`` is
this checkout's, offline (``HF_HUB_OFFLINE``). Each block has ``BLOCK_TIMEOUT_S`` and each page
``PAGE_TIMEOUT_S`` in all; a failure names the page, the block's line and the tail of its output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARK = "<!-- runnable -->"
RUNNERS = {"bash": ["bash", "-euo", "pipefail"], "python": [sys.executable]}
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
BLOCK_TIMEOUT_S = 180
PAGE_TIMEOUT_S = 420
TAIL_CHARS = 4000


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str

    @property
    def where(self) -> str:
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{self.line}"


def runnable_blocks(page: Path, text: str | None = None) -> list[Block]:
    """The blocks of ``page`` whose fence follows the runnable mark, in order."""
    lines = (page.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        marked = i > 0 and lines[i - 1].strip() == MARK
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(1))
                    and not lines[j].strip().strip(fence.group(1)[0])), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: the fence opened here is never closed")
        if marked:
            if fence.group(2) not in RUNNERS:
                raise ValueError(f"{page}:{i + 1}: a runnable block must be bash or python, not {fence.group(2)!r}")
            blocks.append(Block(page, i + 1, fence.group(2), "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return blocks


def pages_with_runnable_blocks() -> list[Path]:
    return [p for p in sorted((REPO / "docs").rglob("*.md")) if MARK in p.read_text(encoding="utf-8")]


def run_page(blocks: list[Block], cwd: Path, page_timeout_s: float = PAGE_TIMEOUT_S,
             block_timeout_s: float = BLOCK_TIMEOUT_S) -> None:
    """Run ``blocks`` in order in ``cwd``; fail on the first that exits non-zero or runs too long."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    deadline = time.monotonic() + page_timeout_s
    for block in blocks:
        script = cwd / f".block_{block.line}.{'sh' if block.language == 'bash' else 'py'}"
        script.write_text(block.code, encoding="utf-8")
        timeout = min(block_timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            pytest.fail(f"{block.where}: not reached: the page's blocks ran past {page_timeout_s:.0f} s")
        start = time.monotonic()
        # its own session, so that a timeout kills what the block started in the background too
        proc = subprocess.Popen([*RUNNERS[block.language], str(script)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            output, _ = proc.communicate()
            pytest.fail(f"{block.where}: {block.language} block still running after {timeout:.0f} s; its output "
                        f"ends:\n{output[-TAIL_CHARS:]}")
        finally:
            try:
                os.killpg(proc.pid, 9)  # whatever the block left running
            except ProcessLookupError:
                pass
        if proc.returncode != 0:
            pytest.fail(f"{block.where}: {block.language} block exited {proc.returncode} after "
                        f"{time.monotonic() - start:.1f} s; its output ends:\n{output[-TAIL_CHARS:]}")


# --------------------------------------------------------------------------- the finder and runner


def test_only_blocks_after_the_mark_are_found_with_their_fence_line(tmp_path):
    text = "# t\n\n```bash\nnot run\n```\n\n<!-- runnable -->\n```bash\necho one\n```\n\n<!-- runnable -->\n````python\nprint('```')\n````\n"
    blocks = runnable_blocks(tmp_path / "page.md", text)
    assert [(b.line, b.language, b.code) for b in blocks] == [(8, "bash", "echo one\n"), (13, "python", "print('```')\n")]


def test_a_runnable_block_of_another_language_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"page.md:2: a runnable block must be bash or python, not 'yaml'"):
        runnable_blocks(tmp_path / "page.md", "<!-- runnable -->\n```yaml\na: 1\n```\n")


def test_blocks_share_one_folder_and_a_failure_names_the_line_and_the_output(tmp_path):
    page = tmp_path / "page.md"
    blocks = runnable_blocks(page, "<!-- runnable -->\n```bash\necho hi > f\n```\n"
                                   "<!-- runnable -->\n```python\nprint(open('f').read().strip() + ' there')\nraise SystemExit(3)\n```\n")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)page.md:6: python block exited 3 .*hi there"):
        run_page(blocks, tmp_path)


def test_a_block_that_runs_too_long_is_stopped_with_its_background_jobs(tmp_path):
    blocks = runnable_blocks(tmp_path / "page.md", "<!-- runnable -->\n```bash\n(sleep 60; touch late) &\necho started\nsleep 60\n```\n")
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"(?s)page.md:2: bash block still running after 1 s.*started"):
        run_page(blocks, tmp_path, block_timeout_s=1)
    assert time.monotonic() - start < 30


def test_the_docs_have_runnable_pages():
    assert any(p.name == "bring-your-own-model.md" for p in pages_with_runnable_blocks())


# --------------------------------------------------------------------------- the pages


@pytest.mark.parametrize("page", pages_with_runnable_blocks(), ids=lambda p: str(p.relative_to(REPO / "docs")))
def test_every_runnable_block_of_the_page_runs(page, tmp_path):
    run_page(runnable_blocks(page), tmp_path)
