"""Every script in benchmarks/ runs end to end at its smallest size and writes sane JSON.

Each script runs as a subprocess from the repository root with the root on PYTHONPATH, as
`benchmarks/train_step_gpu.sh` runs them on machines where lmforge is not installed, and writes
only under tmp_path. No timing is asserted: the figures only have to be positive and finite.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.data.preference_demo import make_pairs, unpair
from lmforge.data.sft_demo import make_examples
from lmforge.model.config import ModelConfig
from lmforge.model.reward import RewardModel
from lmforge.model.transformer import Transformer
from tests.conftest import REPO, benchmark_docs_writer, load_script, write_jsonl
from tests.curate.warc_fixtures import PROSE, html_record, write_warc

BENCHMARKS = REPO / "benchmarks"
TINY_LLAMA = ["d_model=64", "n_layers=2", "n_heads=4", "n_kv_heads=1", "ffn_hidden=128", "vocab_size=512"]


@pytest.fixture(autouse=True, scope="module")
def results_untouched():
    """The committed figures in benchmarks/results/ are only ever written by a person running a benchmark."""
    def stamp() -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in (BENCHMARKS / "results").iterdir()}

    before = stamp()
    yield
    assert stamp() == before


def run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run benchmarks/<script> from the repository root; its stdout, after checking it exited 0."""
    command = ["bash" if script.endswith(".sh") else sys.executable, str(BENCHMARKS / script), *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def read_json(path: Path) -> dict:
    """A benchmark's results JSON, which says when, where and how it was measured (``benchmarks/record.py``)."""
    assert path.is_file(), f"{path} was not written"
    result = json.loads(path.read_text())
    assert result["date"] and result["commit"] and result["command"].startswith("python benchmarks/"), path
    assert result["machine"]["cpu"] and result["machine"]["summary"], path
    return result


def test_every_benchmark_records_its_run_through_record_py():
    """One machine/commit helper (record.py), not a copy per script that records less."""
    own = re.compile(r"^def (machine|cpu_name|commit|git_commit|now)\(", re.MULTILINE)
    copies = [p.name for p in BENCHMARKS.glob("*.py") if p.name != "record.py" and own.search(p.read_text())]
    assert not copies
    writers = [p for p in BENCHMARKS.glob("*.py") if p.name != "record.py"
               and ('"benchmark":' in p.read_text() or "header(" in p.read_text())]
    assert [p.name for p in writers if "from record import" not in p.read_text()] == []


def positive(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def check_train_step_json(result: dict, models: set[str], precisions: list[str]) -> None:
    assert result["benchmark"] == "train_step"
    assert {(r["precision"], r["model"]) for r in result["rows"]} == {(p, m) for p in precisions for m in models}
    for row in result["rows"]:
        assert positive(row["step_s"], row["tokens_per_s"]), row
        assert row["mfu"] is None or positive(row["mfu"])
    assert result["rounds_done"] == {p: result["config"]["rounds"] for p in precisions}
    assert positive(result["peak_memory_bytes"], result["config"]["params"], result["config"]["flops_per_token"])
    if "transformers" in models:
        assert set(result["ratio_lmforge_over_transformers"]) == set(precisions)
        assert positive(*result["ratio_lmforge_over_transformers"].values())
    assert {"platform", "torch", "device"} <= set(result["machine"])


def test_train_step_runs_each_precision_in_turn(tmp_path):
    out = tmp_path / "train_step.json"
    run("train_step.py", "--model", *TINY_LLAMA, "--batch", 2, "--seq", 16, "--rounds", 2, "--steps", 1,
        "--peer", "none", "--out", out)  # the peer runs in the GPU script's dry run below
    result = read_json(out)
    check_train_step_json(result, {"lmforge"}, ["bf16", "fp32"])
    assert result["config"]["model_overrides"] == TINY_LLAMA and result["config"]["compile"] is False


def test_gpu_script_dry_run_on_cpu_writes_both_presets_and_copies_them_to_out(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    stdout = run("train_step_gpu.sh", env={"DEVICE": "cpu", "EAGER": "1", "RESULTS": str(results), "OUT": str(out),
                                           "PY": sys.executable})
    assert "torch " + torch.__version__ in stdout
    gpt2 = read_json(results / "train_step_cpu_gpt2-124m.json")
    llama = read_json(results / "train_step_cpu_llama3-1b.json")
    check_train_step_json(gpt2, {"lmforge"}, ["bf16"])
    check_train_step_json(llama, {"lmforge", "transformers"}, ["bf16"])
    assert gpt2["config"]["preset"] == "gpt2-124m" and llama["config"]["preset"] == "llama3-1b"
    assert sorted(p.name for p in out.iterdir()) == [
        "train_step_cpu_gpt2-124m.json", "train_step_cpu_llama3-1b.json", "train_step_gpu_cpu.log"]
    assert read_json(out / "train_step_cpu_llama3-1b.json") == llama
    assert "== llama3-1b: exit 0" in (out / "train_step_gpu_cpu.log").read_text()


def test_generate_decodes_the_same_greedy_rows_as_transformers_in_fp32(tmp_path):
    out = tmp_path / "generate.json"
    run("generate.py", "--model", *TINY_LLAMA, "--batch-sizes", 2, "--samples", 3, "--dtypes", "float32", "--prompt-len", 4,
        "--new-tokens", 8, "--repeats", 1, "--out", out)
    result = read_json(out)
    assert [(r["batch"], r["dtype"]) for r in result["results"]] == [(2, "float32")]
    for r in result["results"]:
        assert r["identical_greedy_rows"] == f"{r['batch']}/{r['batch']}"
        assert positive(r["lmforge_tokens_per_s"], r["transformers_tokens_per_s"], r["ratio"], r["lmforge_first_call_s"])
    # n samples of one prompt against num_return_sequences, the same sampling settings both sides
    assert [(r["batch"], r["samples"], r["dtype"]) for r in result["sampled"]] == [(1, 3, "float32")]
    assert positive(result["sampled"][0]["ratio"]) and result["sampling"]["top_k"] == 0


def test_rollout_smoke_measures_lmforge_rollouts_and_transformers_sampling(tmp_path):
    out = tmp_path / "rollout.json"
    stdout = run("rollout.py", "--smoke", "--out", out)
    result = read_json(out)
    assert result["benchmark"] == "rollout" and result["shape"] == {"prompts": 2, "samples": 2, "new_tokens": 4,
                                                                    "prompt_len": 4}
    assert set(result["tokens_per_s"]) == {"lmforge_max_batch_4", "transformers"}
    assert positive(*result["tokens_per_s"].values(), *result["ratio"].values())
    assert set(result["load_average_1m"]) == {"before", "after"} and "load average" in stdout


def test_attention_times_both_routes_for_each_shape_and_dtype(tmp_path):
    out = tmp_path / "attention.json"
    run("attention.py", "--shapes", "2x4x2x16x8", "1x2x2x8x8", "--steps", 1, "--repeats", 1, "--out", out)
    result = read_json(out)
    assert [(r["shape"], r["dtype"]) for r in result["rows"]] == [
        ("2x4x2x16x8", "bf16"), ("2x4x2x16x8", "fp16"), ("1x2x2x8x8", "bf16"), ("1x2x2x8x8", "fp16")]
    for r in result["rows"]:
        assert positive(r["sdpa_ms"], r["attend_ms"], r["speedup"])
    assert isinstance(result["cpu_has_amx"], bool)


def test_prepare_reports_its_rate_and_the_tokenizers_peer(tmp_path, corpus_jsonl, small_tokenizer_dir):
    out = tmp_path / "prepare.json"
    run("prepare.py", "--data", corpus_jsonl, "--tokenizer", small_tokenizer_dir, "--repeats", 1, "--out", out)
    result = read_json(out)
    assert result["documents"] == 60
    assert positive(result["tokens"], result["lmforge_prepare_mb_per_s"], result["tokenizers_encode_batch_mb_per_s"],
                    result["tokenizers_encode_batch_fast_mb_per_s"], result["ratio"], result["ratio_vs_encode_batch_fast"])


def test_finetune_measures_full_and_qlora_over_nf4_and_int2(tmp_path):
    out = tmp_path / "finetune.json"
    run("finetune.py", "--model", "n_layers=1", "--batch", 1, "--seq", 16, "--precision", "fp32", "--steps", 1,
        "--rounds", 1, "--out", out, "--modes", "full", "qlora", "qlora-int2")
    rows = {r["mode"]: r for r in read_json(out)["rows"]}
    assert list(rows) == ["full", "qlora", "qlora-int2"]  # lora, qlora-int4 and -int3 run the same code
    for r in rows.values():
        assert positive(r["tokens_per_s"], r["peak_memory_bytes"], r["weights_and_buffers_bytes"], r["trainable_params"],
                        r["optimizer_state_bytes"], r["speed_vs_full"])
    assert rows["qlora-int2"]["trainable_params"] == rows["qlora"]["trainable_params"] < rows["full"]["trainable_params"]
    assert rows["qlora"]["weights_and_buffers_bytes"] < rows["full"]["weights_and_buffers_bytes"]
    assert rows["qlora-int2"]["weights_and_buffers_bytes"] < rows["qlora"]["weights_and_buffers_bytes"]


def test_finetune_lowbit_tunes_over_each_base_and_records_its_memory_and_losses(tmp_path, small_tokenizer_dir):
    from lmforge.data.sft_demo import write_demo

    base = tiny_checkpoint(tmp_path / "base", small_tokenizer_dir, seed=0)
    write_demo(tmp_path / "sft", 40, seed=0, val_fraction=0.2)
    out = tmp_path / "lowbit.json"
    run("finetune.py", "--lowbit", "--base", base, "--sft-steps", 2, "--group-size", 16, "--runs", tmp_path / "runs",
        "--out", out, "--set", f"data.train=[{tmp_path / 'sft' / 'train.jsonl'}]", f"data.val=[{tmp_path / 'sft' / 'val.jsonl'}]",
        "data.max_length=128", "train.warmup_steps=1", "train.micro_batch_size=4", "train.precision=fp32",
        "train.eval_batches=1", "train.tensorboard=false", "score.max_examples=4", "score.max_new_tokens=4",
        "lora.nf4_block_size=32", "lora.nf4_scaler_block_size=2",
        "--rows", "full precision", "nf4", "int3", "int2 + LoftQ")  # 4 of the 9 rows, each a couple of seconds
    result = read_json(out)
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["full precision", "nf4", "int3", "int2 + LoftQ"]
    for r in rows.values():
        assert positive(r["base_bytes"], r["val_loss_before"], r["val_loss_after"], r["tokens_per_s"]) and r["steps"] == 2
        assert 0 <= r["exact_match_after"] <= 1 and r["examples_scored"] == 4
    assert rows["full precision"]["bits_per_adapted_weight"] == 32  # fp32
    # codes of 2 and 3.2 (ten per int32) bits, plus an fp32 scale and zero per 16 weights (4 bits a weight);
    # (rows padded to ten); NF4: 4 bits, an int8 scale per 32 and an fp32 factor per 64, and a mean per layer
    bits = [rows[f]["bits_per_adapted_weight"] for f in ("int2 + LoftQ", "int3", "nf4")]
    assert bits == pytest.approx([2 + 4, 3.2 + 4, 4 + 8 / 32 + 32 / 64], rel=0.05)
    assert all(rows[f]["base_bytes"] < rows["full precision"]["base_bytes"] for f in ("nf4", "int3", "int2 + LoftQ"))


def tiny_checkpoint(path: Path, tokenizer_dir: Path, seed: int, reward_head: bool = False) -> Path:
    path.mkdir()
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, ffn_hidden=64, max_seq_len=256))
    write_model_files(path, model, tokenizer_dir)
    if reward_head:
        RewardModel(model).save_head(path)
    write_checksums(path)
    return path


def test_alignment_runs_each_method_through_the_cli_and_scores_them_alike(tmp_path, small_tokenizer_dir):
    sft = tiny_checkpoint(tmp_path / "sft", small_tokenizer_dir, seed=0)
    reward = tiny_checkpoint(tmp_path / "reward", small_tokenizer_dir, seed=1, reward_head=True)
    data = tmp_path / "preference"
    data.mkdir()
    pairs = make_pairs(make_examples(12, seed=3))
    for name, rows in {"train": pairs[:8], "val": pairs[8:], "kto_train": unpair(pairs[:8]),
                       "kto_val": unpair(pairs[8:])}.items():
        write_jsonl(data / f"{name}.jsonl", rows)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", make_examples(16, seed=5))
    tasks = write_jsonl(tmp_path / "tasks.jsonl", make_examples(4, seed=4))
    out = tmp_path / "alignment.json"
    methods = ["dpo", "ppo", "grpo"]  # rs: a random model answers nothing right, so it writes no SFT data
    stdout = run("alignment.py", "--checkpoint", sft, "--reward-model", reward, "--methods", *methods, "--quick",
                 "--data", data, "--prompts", prompts, "--tasks", tasks, "--out", tmp_path / "runs", "--json", out)
    result = read_json(out)
    assert [r["method"] for r in result["results"]] == methods
    assert result["start"]["kl_per_token"] == pytest.approx(0.0, abs=1e-6) and result["start"]["examples"] == 4
    for r in result["results"]:
        assert r["steps"] == 2 and r["examples"] == 4 and 0.0 <= r["exact_match"] <= 1.0, r
        assert r["commands"][0].startswith(f"lmforge {r['method']} recipes/demo/{r['method']}.yaml ")
        assert positive(r["wall_s"]) and r["kl_per_token"] > -1e-6 and math.isfinite(r["reward_mean"]), r
        assert (Path(r["run_dir"]) / "final").is_dir()
    assert all(f"| {m} |" in stdout for m in ["SFT (start)", *methods])


def test_rollout_correction_runs_the_demo_grpo_recipe_in_each_setting(tmp_path, small_tokenizer_dir):
    sft = tiny_checkpoint(tmp_path / "sft", small_tokenizer_dir, seed=0)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", make_examples(8, seed=5))
    out = tmp_path / "rollout_correction.json"
    stdout = run("rollout_correction.py", "--checkpoint", sft, "--steps", "3", "--settings", "token_truncate", "engine",
                 "--runs", tmp_path / "runs", "--out", out, "--set", f"data.train=[{prompts}]", "data.val=[]",
                 "grpo.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4", "train.micro_batch_size=4")
    result = read_json(out)
    corrected, engine = result["settings"]
    assert (corrected["setting"], engine["setting"]) == ("token_truncate", "engine") and corrected["steps"] == 3
    # step 3 samples a new batch (μ = 2): its recompute is in the mean over the steps after the first
    assert corrected["time"]["old_logprobs"] > 0 and engine["time"]["old_logprobs"] == 0  # skipped
    assert positive(corrected["mismatch"]["ratio_max"], engine["mismatch"]["ratio_max"], corrected["step_s"])
    assert 0 <= corrected["mismatch"]["corrected_share"] <= 1 and corrected["mismatch"]["kl"] >= 0
    assert "| token_truncate |" in stdout and "| engine |" in stdout


def test_curate_signatures_and_pipeline_on_a_small_crawl(tmp_path):
    warc = write_warc(tmp_path / "pages.warc.gz",
                      [html_record(f"https://example.org/{i}", f"Page {i}. " + PROSE["en"] * 3) for i in range(6)])
    paragraph = (PROSE["en"] * 20)[:3500]  # two make a piece of >= 7,000 characters
    pretrain = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "\n\n".join([paragraph] * 6)}])
    recipe = tmp_path / "curate.yaml"
    recipe.write_text(f"run_dir: {tmp_path / 'unused'}\ninputs:\n  paths: [{warc}]\nworkers: 1\n"
                      "steps:\n  - type: extract\n  - type: exact_dedup\n  - type: minhash\n")
    out = tmp_path / "curate.json"
    run("curate.py", "--warc", warc, "--pretrain", pretrain, "--recipe", recipe, "--repeats", 1, "--out", out)
    result = read_json(out)
    assert result["documents"] == 6 + 3  # the pages, and the document cut into three pieces
    assert positive(result["ratio"], *result["minhash"]["docs_per_s"].values())
    assert result["pipeline"]["input_documents"] == 6 and positive(result["pipeline"]["docs_per_s"])


def test_curate_read_reads_every_shard_of_each_input_kind(tmp_path):
    out = tmp_path / "curate_read.json"
    run("curate_read.py", "--records", 200, "--shards", 3, "--repeats", 1, "--workdir", tmp_path / "inputs",
        "--out", out)
    rows = read_json(out)["results"]
    assert [r["input"] for r in rows] == ["jsonl", "jsonl.gz", "warc", "warc.gz"]
    for r in rows:
        assert r["shards"] == 3 and r["records"] == (20 if r["input"].startswith("warc") else 200)
        assert positive(r["sharded_s"], r["one_piece_s"], r["ratio"])


def test_serve_answers_every_request_over_http_and_in_process(tmp_path):
    out = tmp_path / "serve.json"
    run("serve.py", "--model", *TINY_LLAMA, "--requests", 3, "--max-tokens", 4, "--repeats", 1, "--out", out)
    result = read_json(out)
    assert result["benchmark"] == "serve" and result["requests"] == 3 and result["max_tokens"] == 4
    for side in ("server", "engine_in_process"):
        r = result[side]
        assert r["generated_tokens"] == 12  # exactly max_tokens per request on both sides (ignore_eos)
        assert positive(r["requests_per_s"], r["tokens_per_s"], r["ttft_mean_ms"], r["ttft_p90_ms"], r["wall_s"])
    assert positive(result["http_overhead_ratio"]) and {"cpu", "torch"} <= set(result["machine"])


def test_copying_gain_is_none_at_init_and_large_once_a_model_learns_to_copy(tmp_path):
    # by path: opacus's wheel installs a top-level `benchmarks` package, which `import benchmarks` finds
    # before this folder (a namespace package)
    copying_nll = load_script(BENCHMARKS / "copying.py", "copying_bench").copying_nll

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=128, vocab_size=160, max_seq_len=64)
    model = Transformer(cfg)
    model.init_weights()
    first, second = copying_nll(model, cfg.vocab_size, length=12, rows=16, seed=1, low=32)
    assert abs(first - second) < 0.2 and abs(first - math.log(160)) < 0.5  # uniform guesses, both copies
    # 300 steps on sequences that repeat (Adam, lr 3e-3) grow induction heads in a 2-layer model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        half = torch.randint(32, 160, (32, 12))
        ids = torch.cat([half, half], 1)
        logp = torch.log_softmax(model(ids), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        opt.zero_grad()
        (-logp[:, 11:].mean()).backward()
        opt.step()
    model.eval()
    first, second = copying_nll(model, cfg.vocab_size, length=12, rows=16, seed=1, low=32)
    assert first - second > 2.0, (first, second)
    # the script, on a saved checkpoint of it
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_model_files(ckpt, model, None)
    write_checksums(ckpt)
    row = json.loads(run("copying.py", ckpt, "--length", 12, "--rows", 16, "--seed", 1, "--low", 32).splitlines()[-1])
    assert row["copying_gain"] == pytest.approx(first - second, abs=1e-3) and positive(row["first_copy_nll"], row["second_copy_nll"])


def rendered(result: dict) -> str:
    """The table scripts/write_benchmark_docs.py writes into the docs for ``result``."""
    return "\n".join(benchmark_docs_writer().render(result["benchmark"], result).lines)


@pytest.fixture()
def small_shards(tmp_path, corpus_jsonl, small_tokenizer_dir) -> list[str]:
    """``--set`` overrides that point a benchmark's pretrain recipe at shards of the test corpus, tiny shapes."""
    from lmforge.data.documents import DocumentsConfig
    from lmforge.stages.prepare import PrepareRecipe, run_prepare

    shards = tmp_path / "shards"
    run_prepare(PrepareRecipe(run_dir=str(shards), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(corpus_jsonl)]), val_fraction=0.1))
    return [f"tokenizer={small_tokenizer_dir}", f"data.datasets=[{{path: {shards}}}]", "model.vocab_size=512",
            "model.max_seq_len=64", "data.seq_len=32", "train.micro_batch_size=2", "train.batch_tokens=64"]


def test_optimizers_trains_each_optimizer_and_compares_at_equal_steps_and_time(tmp_path, small_shards):
    out = tmp_path / "optimizers.json"
    stdout = run("optimizers.py", "--quick", "--runs", tmp_path / "runs", "--out", out, "--plot", tmp_path / "o.png",
                 "--set", *small_shards, "train.max_steps=4", "train.eval_every=2")
    result = read_json(out)
    assert [r["optimizer"] for r in result["runs"]] == ["adamw", "muon", "lamb"]
    for r in result["runs"]:
        assert r["steps"] == 4 and [p["step"] for p in r["curve"]] == [2, 4], r
        assert positive(r["final_val_loss"], r["tokens_per_s"], r["curve"][-1]["train_s"])
    best = result["summary"]["best"]
    assert set(best) == {"adamw", "muon", "lamb"} and positive(result["summary"]["equal_time_s"])
    assert all(b["val_loss_at_equal_time"] >= b["final_val_loss"] - 1e-9 or b["train_s"] <= result["summary"]["equal_time_s"]
               for b in best.values())
    assert (tmp_path / "o.png").is_file() and "muon: best rate" in stdout
    table = rendered(result)
    assert "| muon |" in table and "| lamb |" in table and "at equal time" in table


def test_mup_sweeps_rates_per_width_under_sp_and_mup_and_names_the_best(tmp_path, small_shards):
    out = tmp_path / "mup.json"
    stdout = run("mup.py", "--quick", "--runs", tmp_path / "runs", "--out", out, "--plot", tmp_path / "m.png",
                 "--set", *small_shards)
    result = read_json(out)
    runs = {(r["param"], r["width"], r["lr"]): r for r in result["runs"]}
    assert set(runs) == {(p, w, lr) for p in ("sp", "mup") for w in (32, 64) for lr in (2e-3, 8e-3)}
    for lr in (2e-3, 8e-3):  # the base width is trained once: there µP is the standard model
        assert runs[("mup", 32, lr)]["val_loss"] == runs[("sp", 32, lr)]["val_loss"]
        assert runs[("mup", 64, lr)]["val_loss"] != runs[("sp", 64, lr)]["val_loss"]
    assert all(r["step"] == 4 and positive(r["val_loss"]) for r in result["runs"])
    best = result["summary"]["best_lr"]
    for param in ("sp", "mup"):
        for w in ("32", "64"):
            lr = best[param][w]
            assert runs[(param, int(w), lr)]["val_loss"] == min(runs[(param, int(w), x)]["val_loss"] for x in (2e-3, 8e-3))
    assert isinstance(result["summary"]["mup_transfers"], bool) and (tmp_path / "m.png").is_file() and "mup: best rate by width" in stdout
    table = rendered(result)
    assert "| µP | 64 |" in table and "| SP | 32 |" in table and "under µP" in table


def test_forgetting_continues_a_model_in_each_setting_and_measures_both_tasks(tmp_path, corpus_jsonl,
                                                                             small_tokenizer_dir):
    from lmforge.data.documents import DocumentsConfig
    from lmforge.stages.prepare import PrepareRecipe, run_prepare

    shards = tmp_path / "shards"  # the same corpus stands in for both tasks at this size
    run_prepare(PrepareRecipe(run_dir=str(shards), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(corpus_jsonl)]), val_fraction=0.2))
    out = tmp_path / "forgetting.json"
    stdout = run("forgetting.py", "--quick", "--tokenizer", small_tokenizer_dir, "--old", shards, "--new", shards,
                 "--runs", tmp_path / "runs", "--out", out, "--plot", tmp_path / "f.png")
    result = read_json(out)
    rows = {r["setting"]: r for r in result["rows"]}
    assert list(rows)[0] == "naive" and len(rows) == 11 and rows["naive"]["final_penalty"] is None
    assert all(positive(r["old_bpb"], r["new_bpb"]) for r in rows.values())
    assert all(r["final_penalty"] > 0 for name, r in rows.items() if name != "naive" and r["replay_share"] is None)
    assert [r["replay_share"] for r in rows.values() if r["replay_share"]] == [0.1, 0.25, 0.5]
    assert rows["replay share=0.5"]["old_bpb"] != rows["naive"]["old_bpb"]  # the replayed windows were trained on
    for r in rows.values():
        assert r["forgetting_bpb"] == pytest.approx(r["old_bpb"] - result["base_old_bpb"], abs=1e-12)
    assert (tmp_path / "f.png").is_file() and "wrote" in stdout
    table = rendered(result)
    assert "| naive |" in table and "| ewc λ=1000 |" in table and "forgetting" in table
    assert "| self-distill α=0.9 |" in table and "the pre-trained model, at τ = 2" in table and "on 16 validation windows" in table
