"""benchmarks/curriculum.py end to end at its smallest size: the shuffled loader, sequence-length
warm-up and both quality orders on the same tokens, its JSON and figure, and the table
scripts/write_benchmark_docs.py renders from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lmforge.data.sft_demo import write_demo
from tests.conftest import REPO, benchmark_docs_writer


def test_curriculum_trains_each_loader_on_the_same_tokens_and_scores_the_documents(tmp_path, corpus_jsonl,
                                                                                  small_tokenizer_dir):
    write_demo(tmp_path / "chat", 40, seed=0, val_fraction=0.1)
    out = tmp_path / "curriculum.json"
    tiny = ["model.vocab_size=512", "model.max_seq_len=128", "data.seq_len=64", "model.d_model=32", "model.n_layers=2",
            "model.n_heads=2", "model.ffn_hidden=64", "train.micro_batch_size=2", "train.batch_tokens=128"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "curriculum.py"), "--quick",
                           "--runs", str(tmp_path / "runs"), "--out", str(out), "--plot", str(tmp_path / "c.png"),
                           "--tokenizer", str(small_tokenizer_dir), "--documents", str(corpus_jsonl),
                           "--chat", str(tmp_path / "chat" / "train.jsonl"), "--set", *tiny],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "curriculum" and result["command"].startswith("python benchmarks/curriculum.py")
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["shuffled", "seq_len_warmup", "easy_to_hard", "hard_to_easy"]
    assert result["summary"]["same_tokens"] and {r["tokens"] for r in runs.values()} == {4 * 128}
    assert all(r["steps"] == 4 and set(r["val_by_dataset"]) == {"data", "chat"} for r in runs.values())
    assert [p["step"] for p in runs["shuffled"]["val_curve"]] == [2, 4]
    assert [p["data/seq_len"] for p in runs["seq_len_warmup"]["train_curve"]] == [32, 64, 64, 64]
    up, down = runs["easy_to_hard"]["train_curve"], runs["hard_to_easy"]["train_curve"]
    assert up[0]["data/score"] < down[0]["data/score"]  # the lowest perplexities first, then the highest
    assert len({r["val_loss"] for r in runs.values()}) == 4  # each loader changed what was trained on
    assert (tmp_path / "c.png").is_file()
    table = "\n".join(benchmark_docs_writer().render_curriculum(result).lines)
    assert "| shuffled |" in table and "| easy_to_hard |" in table and "minus shuffled" in table
