"""benchmarks/moe.py end to end at its smallest size: the dense model and the MoE of equal active FLOPs
trained on the same tokens, the per-step expert loads with and without the aux-loss-free bias, its JSON
and figure, and the table scripts/write_benchmark_docs.py renders from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, benchmark_docs_writer


@pytest.fixture()
def small_shards(tmp_path, corpus_jsonl, small_tokenizer_dir) -> list[str]:
    from lmforge.data.documents import DocumentsConfig
    from lmforge.stages.prepare import PrepareRecipe, run_prepare

    shards = tmp_path / "shards"
    run_prepare(PrepareRecipe(run_dir=str(shards), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(corpus_jsonl)]), val_fraction=0.1))
    return [f"tokenizer={small_tokenizer_dir}", f"data.datasets=[{{path: {shards}}}]", "model.max_seq_len=64",
            "data.seq_len=32", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "train.micro_batch_size=2",
            "train.batch_tokens=64"]


def test_moe_trains_both_models_on_the_same_tokens_and_records_the_loads(tmp_path, small_shards):
    out = tmp_path / "moe.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "moe.py"), "--quick", "--runs", str(tmp_path / "runs"),
                           "--out", str(out), "--plot", str(tmp_path / "m.png"), "--set", *small_shards],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "moe" and result["command"].startswith("python benchmarks/moe.py")
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["dense", "moe", "moe_unbalanced"]
    assert len({r["tokens"] for r in runs.values()}) == 1 and all(r["steps"] == 4 for r in runs.values())
    # equal active FLOPs: the experts' matmuls are the dense SwiGLU's, the router's 8·d a layer more
    dense, moe = runs["dense"], runs["moe"]
    assert moe["active_matmul_params"] - dense["active_matmul_params"] == 2 * 8 * 32
    assert moe["params"] > dense["params"] and result["summary"]["flops_moe_over_dense"] == pytest.approx(1.0, abs=0.01)
    assert "load_max" not in dense["curve"][0]
    for name in ("moe", "moe_unbalanced"):
        assert all(1 / 8 <= p["load_max"] <= 1 and 0 <= p["load_min"] <= 1 / 8 for p in runs[name]["curve"])
    assert runs["moe"]["val_loss"] != runs["moe_unbalanced"]["val_loss"]  # the bias changed the routing
    assert (tmp_path / "m.png").is_file()
    table = "\n".join(benchmark_docs_writer().render_moe(result).lines)
    assert "| dense |" in table and "| MoE, aux-loss-free bias |" in table and "| MoE, no balancing |" in table
