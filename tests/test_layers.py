"""The layers of docs/ARCHITECTURE.md hold: a module imports only from layers below it.

The contracts are import-linter's, configured in pyproject.toml ([tool.importlinter]); every
import counts, a function-level one too. A second test plants back-edges in a copy of the
package and checks that the same contracts then fail, naming them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import lmforge

ROOT = Path(lmforge.__file__).resolve().parents[1]  # the checkout whose lmforge the tests import
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(package_parent: Path, config: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``lmforge`` found in ``package_parent``, in a fresh interpreter
    (so that the package analysed is that one, not the one this process imported)."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([sys.executable, "-c", LINT, str(config), "--no-cache", "--no-logo"], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=120)


def test_every_import_of_lmforge_runs_down_the_layers():
    result = lint_imports(ROOT, ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_planted_back_edge_breaks_the_layers_contract(tmp_path):
    shutil.copytree(ROOT / "lmforge", tmp_path / "lmforge", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    io = tmp_path / "lmforge" / "core" / "io.py"  # core, the bottom layer, reaching up to stages in a function
    io.write_text(io.read_text() + "\n\ndef _planted():\n    from lmforge.stages import VERBS\n\n    return VERBS\n")
    reward = tmp_path / "lmforge" / "model" / "reward.py"  # model reading DCP shards itself
    reward.write_text(reward.read_text() + "\n\ndef _planted():\n    from lmforge.distributed.checkpoint import read_model_state\n"
                      "\n    return read_model_state\n")
    load = tmp_path / "lmforge" / "checkpoints" / "load.py"  # loading a model reaching up into the training room
    load.write_text(load.read_text() + "\n\ndef _planted():\n    from lmforge.train.checkpoint import ResumeState\n"
                    "\n    return ResumeState\n")
    result = lint_imports(tmp_path, tmp_path / "pyproject.toml")
    out = result.stdout
    assert result.returncode != 0, out
    assert "lmforge layers (docs/ARCHITECTURE.md) BROKEN" in out and "lmforge.core.io -> lmforge.stages" in out
    assert "lmforge.checkpoints.load -> lmforge.train.checkpoint" in out
    assert "lmforge.model.reward -> lmforge.distributed.checkpoint" in out
    assert "2 broken" in out
