"""``benchmarks/rl_async.py`` at its smallest: the demo GRPO recipe on a tiny model, in-process and
with one rollout worker a step ahead: the JSON, the table and the figure."""

from __future__ import annotations

from lmforge.data.sft_demo import make_examples
from tests.conftest import write_jsonl
from tests.test_benchmarks import positive, read_json, run, tiny_checkpoint


def test_rl_async_runs_the_demo_grpo_recipe_in_process_and_with_a_worker_ahead(tmp_path, small_tokenizer_dir):
    sft = tiny_checkpoint(tmp_path / "sft", small_tokenizer_dir, seed=0)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", make_examples(16, seed=5))
    out, plot = tmp_path / "rl_async.json", tmp_path / "rl_async.png"
    stdout = run("rl_async.py", "--checkpoint", sft, "--steps", "3", "--settings", "sync", "w1-k1",
                 "--runs", tmp_path / "runs", "--out", out, "--plot", plot, "--set", f"data.train=[{prompts}]",
                 "data.val=[]", "grpo.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4",
                 "train.micro_batch_size=4", env={"OMP_NUM_THREADS": "1"})
    result = read_json(out)
    sync, ahead = result["settings"]
    assert (sync["setting"], sync["workers"], ahead["setting"], ahead["workers"]) == ("sync", 0, "w1-k1", 1)
    assert sync["steps"] == ahead["steps"] == 3 and len(ahead["curve"]) == 3
    assert positive(sync["tokens_per_s"], ahead["tokens_per_s"], sync["step_s"], ahead["train_s"])
    assert sync["off_policy_steps_max"] == 0 and ahead["off_policy_steps_max"] <= 1
    assert "| sync | 0 | 0 |" in stdout and "| w1-k1 | 1 | 1 |" in stdout and plot.stat().st_size
