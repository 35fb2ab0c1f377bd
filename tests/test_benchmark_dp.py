"""``benchmarks/dp.py`` at its smallest: a tiny model's SFT on demo tasks with DP-SGD at ε = 1 and
without (ε = ∞), two steps each: the JSON's rows and the table the docs render from it."""

from __future__ import annotations

import math

from lmforge.data.sft_demo import write_demo
from tests.conftest import benchmark_docs_writer
from tests.test_benchmarks import positive, read_json, run, tiny_checkpoint


def test_dp_trains_the_demo_sft_at_each_epsilon_and_records_utility_and_privacy(tmp_path, small_tokenizer_dir):
    base = tiny_checkpoint(tmp_path / "base", small_tokenizer_dir, seed=0)
    write_demo(tmp_path / "sft", 40, seed=0, val_fraction=0.2)
    out = tmp_path / "dp.json"
    stdout = run("dp.py", "--base", base, "--steps", 2, "--batch", 4, "--max-length", 128, "--delta", 1e-3,
                 "--examples", 2, "--epsilons", "1", "inf", "--runs", tmp_path / "runs", "--out", out,
                 "--set", f"data.train=[{tmp_path / 'sft' / 'train.jsonl'}]", f"data.val=[{tmp_path / 'sft' / 'val.jsonl'}]",
                 "train.precision=fp32", "train.eval_batches=1", "train.tensorboard=false", "score.max_new_tokens=4",
                 env={"OMP_NUM_THREADS": "1"})
    result = read_json(out)
    private, plain = result["rows"]
    assert private["epsilon"] == 1 and plain["epsilon"] is None and plain["noise_multiplier"] is None
    assert private["noise_multiplier"] > 0 and 1 - 0.01 <= private["epsilon_spent"] <= 1  # σ for the budget, spent
    assert math.isclose(private["sample_rate"], 4 / private["train_examples"])
    for r in (private, plain):
        assert r["steps"] == 2 and r["examples_scored"] == 2 and 0 <= r["exact_match_after"] <= 1
        assert positive(r["val_loss_before"], r["val_loss_after"], r["tokens_per_s"])
    assert "ε=1" in stdout and "ε=inf" in stdout

    table = "\n".join(benchmark_docs_writer().render("dp", result).lines)
    assert "| 1 | " in table and "| ∞ | - |" in table
