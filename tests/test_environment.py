"""The project's environment is quiet and tidy: importing transformers, peft and the command
line prints nothing on stderr, and caches and temporary files go under the repository's .cache/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

from tests.conftest import CACHE_DIR, REPO


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_importing_transformers_peft_and_the_command_line_prints_nothing_on_stderr():
    # peft imports transformers' quantizers, which import torchao wherever it is installed; loading
    # an exported model does the same. torchao is a test-only reference kept in .venv/reference.
    done = run_python("import transformers, peft; import lmforge.cli.main; "
                      "import transformers.quantizers.auto; print('torchao' in __import__('sys').modules)")
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    assert done.stderr == "", (
        f"stderr: {done.stderr[:500]}\nIf torchao is in site-packages, move it to .venv/reference: "
        ".venv/bin/pip uninstall -y torchao && .venv/bin/pip install --no-deps --target .venv/reference "
        "-c constraints.txt torchao")


def test_every_verbs_help_prints_nothing_on_stderr():
    done = subprocess.run([sys.executable, "-m", "lmforge", "--help"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "verbs:" in done.stdout and done.stderr == ""
    every_verb = ("from lmforge.cli.main import build_verb_parser\nfrom lmforge.stages import VERBS\n"
                  "for verb in VERBS:\n    assert 'recipe keys' in build_verb_parser(verb)[0].format_help()\n")
    done = run_python(every_verb)
    assert done.returncode == 0 and done.stderr == "", done.stderr[:500]


def test_temporary_files_and_caches_go_under_the_repository_cache_dir(tmp_path):
    assert tmp_path.resolve().is_relative_to(CACHE_DIR.resolve())  # pytest's own tmp_path folders
    where = run_python(
        "import tempfile; from torch._inductor.runtime.cache_dir_utils import cache_dir; "
        "from ray._common.utils import get_default_system_temp_dir; "
        "print(tempfile.gettempdir()); print(cache_dir()); print(get_default_system_temp_dir()); "
        "print(tempfile.mkdtemp(prefix='torchelastic_'))"  # how torchrun makes its log folder
    )
    assert where.returncode == 0, where.stderr
    temp, inductor, ray, elastic = where.stdout.split()
    assert temp == str(CACHE_DIR / "tmp") and ray == temp and elastic.startswith(temp + os.sep)
    assert inductor == str(CACHE_DIR / "torchinductor")
    os.rmdir(elastic)
    assert tempfile.gettempdir() == temp


def test_the_makefile_sets_the_same_places_for_make_test_and_make_demo():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^CACHE := \$\(CURDIR\)/\.cache$", makefile, re.M)
    assert re.search(r"^export TMPDIR := \$\(CACHE\)/tmp$", makefile, re.M)
    assert re.search(r"^export TORCHINDUCTOR_CACHE_DIR := \$\(CACHE\)/torchinductor$", makefile, re.M)
    assert ".cache/" in (REPO / ".gitignore").read_text().splitlines()
