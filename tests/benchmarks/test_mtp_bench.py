"""benchmarks/mtp.py's decoding measurement on a tiny model with MTP modules (every drafting row the greedy
tokens, the acceptance counted from the engine's own figures), and its table rendered into the docs."""

from __future__ import annotations

import sys

import pytest
import torch

from lmforge.model import families
from tests.conftest import REPO, benchmark_docs_writer, load_script

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = REPO / "benchmarks" / "mtp.py"
sys.path.append(str(SCRIPT.parent))  # its `from record import ...`, as when it runs as a script
bench = load_script(SCRIPT, "mtp_bench")


def test_drafting_rows_keep_the_greedy_tokens_and_count_the_accepted_drafts():
    torch.manual_seed(0)
    model = families.build(families.model_config(dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=64,
                                                      mtp=dict(depth=2)))).eval()
    prompts = [[1, 5, 9], [2, 3, 4, 5]]
    rows = bench.measure_drafting(model, prompts, new_tokens=6, repeats=1, draft_lengths=[1, 2])
    assert [r["draft_tokens"] for r in rows] == [0, 1, 2]
    assert all(r["identical_to_greedy"] for r in rows) and rows[0]["speedup"] == 1.0 and rows[0]["acceptance"] is None
    for r in rows[1:]:
        assert 0 < r["drafts_proposed"] and 0 <= r["drafts_accepted"] <= r["drafts_proposed"]
        assert r["acceptance"] == round(r["drafts_accepted"] / r["drafts_proposed"], 4) and r["tokens_per_s"] > 0
    run = {"name": "plain", "depth": 0, "steps": 2, "val_loss": 4.1, "tokens_per_s": 100.0, "params": 10, "tokens": 64,
           "final_depth_losses": {}, "seconds": 1.0, "load_average": [1.0, 1.0]}
    result = {"benchmark": "mtp", "recipe": "recipes/mtp/pretrain.yaml", "steps": 2, "runs": [run, {**run, "name": "mtp",
              "depth": 2, "final_depth_losses": {"mtp/depth1": 4.2, "mtp/depth2": 4.3}}], "drafting": rows,
              "decoding": {"prompts": 2, "prompt_len": 3, "new_tokens": 6, "repeats": 1, "batch": 1},
              "summary": {"val_loss_mtp_minus_plain": 0.0, "best_speedup": rows[1]["speedup"]}}
    lines = "\n".join(benchmark_docs_writer().render_mtp(result).lines)
    assert "| mtp | 2 |" in lines and "depth1 4.2" in lines and "| none |" in lines and "| 2 |" in lines
