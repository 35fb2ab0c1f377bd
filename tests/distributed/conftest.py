"""Launching ``torchrun`` jobs of tiny recipes (gloo, one thread per rank) and reading their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.core.config import load_config, save_config
from lmforge.stages.pretrain import PretrainRecipe
from tests.train.conftest import make_recipe, shards_dir, tiny_pretrain_overrides  # noqa: F401  (fixtures of tests/train)

REPO = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, jobs: list[dict], spec_dir: Path, timeout: float = 300) -> None:
    """Run ``jobs`` (see worker.py) in one ``torchrun --nproc_per_node=nproc`` launch; fail with its output."""
    for i, job in enumerate(jobs):
        if "recipe" in job and not isinstance(job["recipe"], (str, Path)):
            job["recipe"] = str(save_config(job["recipe"], spec_dir, f"job{i}.yaml"))
    spec = spec_dir / f"spec_{nproc}.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "tests.distributed.worker", str(spec)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-12000:]}")


def assert_adamw_weights_match(got: dict, expected: dict, reference_run: Path) -> None:
    """Weights after AdamW agree with the reference run's to 2% of the largest total update.

    AdamW divides each gradient element by its own running RMS, so where an element's terms
    nearly cancel, its float32 rounding (one GEMM over every row in one process, two ranks'
    partial sums reduced under torchrun) is large relative to the element, and so is the
    difference of its update: no fixed ``atol`` bounds it on every CPU's kernels (AMD EPYC
    moved one LoRA B element by 3.8e-5 after 4 steps at lr 3e-3). What is bounded is each
    step's update, by about ``lr`` per element (|m̂/√v̂| ≲ 1 for β1² < β2), so the sum of
    the reference's learning rates bounds the whole run's. A wiring bug (a rank's rows lost,
    an unsynchronised gradient) changes update directions, i.e. differences of that size;
    the losses and gradient norms, compared at rel 1e-5, are the sharp check.
    """
    from lmforge.train.metrics import read_metrics

    atol = 0.02 * sum(r["lr"] for r in read_metrics(reference_run) if "lr" in r)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.allclose(got[key], value, rtol=0, atol=atol), (key, float((got[key] - value).abs().max()), atol)


@pytest.fixture(scope="module")
def recipe_for(shards_dir, small_tokenizer_dir):  # noqa: F811
    """``make_recipe`` of tests/train for module-scoped runs: a tiny fp32 recipe, dotted overrides.

    2 layers, width 32, 4 heads (2 KV heads), vocabulary 512; 8 windows of 32 tokens per step."""

    def make(run_dir: Path, **overrides) -> PretrainRecipe:
        return load_config(PretrainRecipe, None, tiny_pretrain_overrides(
            run_dir, shards_dir, small_tokenizer_dir, **{"train.max_steps": 4, **overrides}))

    return make
