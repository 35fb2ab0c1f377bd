"""Shared fixtures: a small real corpus and a tokenizer trained on it once per session."""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

from lmforge.data.tokenizer import Tokenizer, TokenizerConfig, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / "data" / "pretrain" / "shakespeare.jsonl"

# Tests never time a dtype's matmul peak (emulated fp16 takes minutes on some CPUs): MFU divides
# by these fixed figures in this process and in every subprocess it starts (torchrun included).
os.environ["LMFORGE_PEAK_FLOPS"] = "float32=2e11,bfloat16=8e11,float16=8e11"


# Caches and temporary files stay under the repository's .cache/ (git-ignored), as the Makefile
# sets them, here for a bare `pytest` too: pytest's tmp_path folders, torch inductor's cache, Ray's
# session files, torchrun's logs, in this process and every subprocess it starts.
CACHE_DIR = REPO / ".cache"
os.environ["TMPDIR"] = str(CACHE_DIR / "tmp")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE_DIR / "torchinductor")
Path(os.environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)
tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container's cpuset narrows; the CPU
    quota of its cgroup where one is set), not the host's count that ``os.cpu_count`` reports."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def pytest_xdist_auto_num_workers(config) -> int:
    """``pytest -n auto``: one worker per usable core (xdist's own count is the host's physical
    cores, which a container limited to 2 of 64 would take for 64), and at most one per 3 GiB of
    memory (the largest process of a whole ``-n 2`` run here, a worker or a subprocess of one,
    held 2.0 GiB)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return usable_cores()
    return max(1, min(usable_cores(), memory // (3 << 30)))


def pytest_configure(config) -> None:
    """Under xdist, each worker gets ``cores // workers`` threads (at least one): torch's intra-op
    pool here, and OMP/MKL/inductor's compile threads in the environment of every subprocess it
    starts (the CLI, torchrun). Two workers of two threads each on two cores run several times
    slower than one thread each. Serial, the thread counts are left as they are."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2:
        return
    threads = max(1, usable_cores() // workers)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # a smaller count set by hand is kept
        threads = max(1, min(threads, int(os.environ["OMP_NUM_THREADS"])))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
        os.environ[name] = str(threads)
    import torch

    torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)  # before xdist's hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items) -> None:
    """Under ``--dist loadgroup`` a worker builds a module-scoped fixture for each module it runs a
    test of: the tests of a module that use one (a torchrun launch shared by the module's asserts,
    a docs build) join one ``xdist_group``, so the fixture is built once. Tests that use none stay
    spread one by one; an autouse module fixture (a check around the module) groups nothing."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds]
        if any(d.scope in ("module", "class", "package") and not getattr(d, "_autouse", False) for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


# Reference libraries kept out of site-packages (the Makefile installs them with pip --target):
# torchao, whose PyPI build's CUDA extensions fail to load on the CPU torch, with a warning each
# time, and which transformers and peft import whenever it is installed.
REFERENCE_DIR = Path(sys.prefix) / "reference"


def import_reference(name: str) -> ModuleType:
    """Import ``name`` from the test-only references in ``.venv/reference`` (or from site-packages,
    where an older environment has it). Only this import sees that folder, so transformers and
    peft elsewhere in the session still find no torchao to import."""
    added = REFERENCE_DIR.is_dir() and str(REFERENCE_DIR) not in sys.path
    if added:
        sys.path.insert(0, str(REFERENCE_DIR))
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"{name} (a test-only reference, installed by `make test` into {REFERENCE_DIR}) is missing: {exc}",
                    allow_module_level=True)
    finally:
        if added:
            sys.path.remove(str(REFERENCE_DIR))


def load_script(path: Path, name: str) -> ModuleType:
    """A script of the repository (``scripts/``, ``benchmarks/``) as a module, registered under
    ``name`` before it runs (a dataclass of it looks its module up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_docs_writer() -> ModuleType:
    """scripts/write_benchmark_docs.py, which writes the docs' tables of benchmarks/results/*.json."""
    return load_script(REPO / "scripts" / "write_benchmark_docs.py", "write_benchmark_docs")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    """About 60 short documents of real English prose from the bundled demo corpus."""
    texts = []
    with open(SHAKESPEARE, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            # cut long works into paragraph groups so there are many short documents
            paragraphs = [p for p in text.split("\n\n") if p.strip()]
            for i in range(0, min(len(paragraphs), 120), 12):
                texts.append("\n\n".join(paragraphs[i : i + 12]))
            if len(texts) >= 60:
                break
    return texts[:60]


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory, corpus_texts) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(corpus_texts, TokenizerConfig(vocab_size=512)).save(path)
    return path


@pytest.fixture(scope="session")
def small_tokenizer(small_tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(small_tokenizer_dir)


@pytest.fixture()
def corpus_jsonl(tmp_path, corpus_texts) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", [{"id": f"doc{i}", "text": t} for i, t in enumerate(corpus_texts)])


@pytest.fixture()
def one_thread():
    """Torch on one thread for a test of tiny ops: on a shared machine more threads only spin
    against other processes (tens of seconds instead of one). Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
