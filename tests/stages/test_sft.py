import json

import pytest
import torch

from lmforge.checkpoints.load import load_model
from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError
from lmforge.data.rows import RowLoader
from lmforge.data.sft_demo import write_demo
from lmforge.stages.sft import SFTRecipe, run_sft
from lmforge.train.metrics import read_metrics


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_data")
    write_demo(path, 120, seed=0, val_fraction=0.1)
    return path


def recipe(tmp_path, base, data, *overrides):
    return load_config(SFTRecipe, None, [
        f"run_dir={tmp_path / 'run'}", f"checkpoint={base}",
        f"data.train=[{data / 'train.jsonl'}]", f"data.val=[{data / 'val.jsonl'}]", "data.max_length=128",
        "train.max_steps=6", "train.warmup_steps=1", "train.lr=3e-3", "train.micro_batch_size=4", "train.precision=fp32",
        "train.eval_every=3", "train.eval_batches=2", "train.tensorboard=false", "train.device=cpu",
        "score.name=exact_match", "score.max_examples=8", "score.max_new_tokens=8", *overrides])


def test_full_fine_tuning_trains_assistant_tokens_and_writes_a_loadable_model(tmp_path, base_checkpoint, sft_data):
    summary = run_sft(recipe(tmp_path, base_checkpoint, sft_data))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert losses[-1] < losses[0]
    n_val = len((sft_data / "val.jsonl").read_text().splitlines())
    assert summary["before"]["exact_match"]["examples"] == min(8, n_val) and "exact_match" in summary["after"]["exact_match"]
    from lmforge.stages.sft import report  # the lifecycle report's line, from the named scorer's figures

    lines = "\n".join(report(summary, tmp_path / "run", tmp_path / "plot.png"))
    assert f"- exact match on {min(8, n_val)} validation tasks: **" in lines
    assert "- full fine-tuning, so no adapter: the same stage with `lora.r=16 lora.alpha=32` writes" in lines
    assert f"`lmforge sft recipes/demo/sft.yaml lora.r=16 lora.alpha=32 train.lr=3e-3 run_dir={tmp_path / 'run'}-lora`" in lines
    model, where = load_model(tmp_path / "run")  # resolves to run/final
    assert where.name == "final" and model.cfg.d_model == 32
    config = json.loads((where / "tokenizer_config.json").read_text())
    assert "chat_template" in config  # HF's apply_chat_template gives our ids (tests/data/test_chat.py)


def test_lora_fine_tuning_saves_a_peft_adapter_and_a_merged_model(tmp_path, base_checkpoint, sft_data):
    summary = run_sft(recipe(tmp_path, base_checkpoint, sft_data, "lora={r: 4, alpha: 8}"))
    assert summary["lora"] is True
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    base, _ = load_model(base_checkpoint)
    tuned, _ = load_model(tmp_path / "run")
    changed = [n for n, p in tuned.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert changed and all(".attn." in n or ".mlp." in n for n in changed)  # only adapted linears moved


def test_lora_with_muon_orthogonalises_the_adapters_and_trains(tmp_path, base_checkpoint, sft_data):
    run_sft(recipe(tmp_path, base_checkpoint, sft_data, "lora={r: 4, alpha: 8}", "train.optimizer=muon",
                   "train.muon.lr=0.02"))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert losses[-1] < losses[0]
    state = torch.load(next((tmp_path / "run" / "checkpoints").glob("step_*")) / "optimizer.pt", weights_only=True)
    kinds = [g["kind"] for g in state["param_groups"]]
    assert kinds == ["muon"]  # LoRA trains only the adapters' A and B, all of them matrices in the blocks
    assert all("momentum_buffer" in s for s in state["state"].values())


def test_muon_with_adapters_on_no_block_matrix_is_refused_before_any_work(tmp_path, base_checkpoint, sft_data):
    with pytest.raises(ConfigError, match=r"train.optimizer = muon: the model has no trainable 2-D matrix"):
        run_sft(recipe(tmp_path, base_checkpoint, sft_data, "lora={r: 4, alpha: 8, target_modules: [lm_head]}",
                       "train.optimizer=muon"))
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bad_examples_name_file_and_line_or_are_counted(tmp_path, base_checkpoint, sft_data):
    bad = tmp_path / "bad.jsonl"
    good = (sft_data / "train.jsonl").read_text().splitlines()[:20]
    bad.write_text("\n".join(good[:3] + ['{"messages": [{"role": "user", "content": "no answer"}]}'] + good[3:]) + "\n")
    with pytest.raises(InputError, match=r"bad\.jsonl:4"):
        run_sft(recipe(tmp_path, base_checkpoint, sft_data, f"data.train=[{bad}]"))
    summary = run_sft(recipe(tmp_path, base_checkpoint, sft_data, f"data.train=[{bad}]", "data.on_bad=skip"))
    assert summary["skipped"]["total"] == 1 and summary["train_examples"] == 20


def test_row_loader_resumes_exactly():
    rows = {"input_ids": torch.arange(50).view(25, 2)}
    full = RowLoader(rows, 3, seed=1)
    expected = [next(full)["input_ids"] for _ in range(20)]
    first = RowLoader(rows, 3, seed=1)
    got = [next(first)["input_ids"] for _ in range(7)]
    resumed = RowLoader(rows, 3, seed=1)
    resumed.load_state_dict(first.state_dict())
    got += [next(resumed)["input_ids"] for _ in range(13)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    ranks = [RowLoader(rows, 2, seed=1, rank=r, world_size=2) for r in range(2)]
    whole = RowLoader(rows, 4, seed=1)
    for _ in range(5):
        both = torch.cat([next(r)["input_ids"] for r in ranks])
        assert torch.equal(both, next(whole)["input_ids"])


def test_export_merge_lora_writes_the_fine_tuned_weights(tmp_path, base_checkpoint, sft_data):
    import transformers

    from lmforge.stages.export import ExportRecipe, run_export

    run_sft(recipe(tmp_path, base_checkpoint, sft_data, "lora={r: 4, alpha: 8}", "train.max_steps=3"))
    run_export(ExportRecipe(checkpoint=str(base_checkpoint), run_dir=str(tmp_path / "hf"),
                            merge_lora=str(tmp_path / "run" / "adapter")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tuned, _ = load_model(tmp_path / "run")  # the run's own merged model
    x = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, tuned(x), atol=1e-5)


def test_a_lora_adapter_names_a_base_that_peft_loads_and_matches_the_merged_model(tmp_path, base_checkpoint, sft_data):
    import transformers
    from peft import AutoPeftModelForCausalLM

    from lmforge.stages.sft import report

    summary = run_sft(recipe(tmp_path, base_checkpoint, sft_data, "lora={r: 4, alpha: 8}", "train.max_steps=3"))
    adapter = tmp_path / "run" / "adapter"
    assert (f"- LoRA adapter (PEFT format) in `{adapter}`, its base as a Hugging Face folder in `{tmp_path / 'run' / 'base-hf'}`"
            in "\n".join(report(summary, tmp_path / "run", tmp_path / "plot.png")))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "run" / "base-hf").resolve())
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(adapter)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(config["base_model_name_or_path"])
    ids = hf_tok.apply_chat_template([{"role": "user", "content": "12 + 30 ="}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    tuned, _ = load_model(tmp_path / "run")  # final/: the adapter merged into the weights
    with torch.no_grad():
        unmerged, merged = peft_model(ids).logits, tuned(ids)
    # fp32 throughout: W x + s B(A x) against (W + s BA) x differ only by rounding (~1e-7 relative)
    assert torch.allclose(unmerged, merged, atol=1e-5) and not torch.allclose(merged, load_model(base_checkpoint)[0](ids))


@pytest.mark.parametrize("lora", ["quantize_base: true, nf4_block_size: 64, nf4_scaler_block_size: 8",
                                  "quantize_base: int2, group_size: 16, init: loftq"], ids=["nf4", "int2-loftq"])
def test_qlora_fine_tuning_keeps_the_base_quantised_and_exports_it_dequantised(tmp_path, base_checkpoint, sft_data, lora):
    from lmforge.peft.adapters import load_adapter
    from lmforge.peft.lora import apply_lora

    sft = recipe(tmp_path, base_checkpoint, sft_data, f"lora={{r: 4, alpha: 8, {lora}}}", "train.max_steps=10",
                 "train.lr=2e-2")
    summary = run_sft(sft)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert summary["lora"] is True and losses[-1] < losses[0]
    tuned, _ = load_model(tmp_path / "run")  # merged: dequant(W) + s·BA, a plain model in the training dtype
    assert all(type(m).__name__ != "QuantizedLinear" for m in tuned.modules())
    assert {p.dtype for p in tuned.parameters()} == {torch.float32}
    # the adapter over the same quantised base (quantising, and LoftQ's init, are deterministic) computes what the
    # merged model does: fp32, W x + s B(A x) against (W + s BA) x, rounding only
    qlora, _ = load_model(base_checkpoint)
    apply_lora(qlora, sft.lora)
    load_adapter(qlora, tmp_path / "run" / "adapter")
    plain, _ = load_model(base_checkpoint)  # and over the full-precision base, as peft loads it over base-hf/
    load_adapter(plain, tmp_path / "run" / "adapter")
    x = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        merged = tuned(x)
        torch.testing.assert_close(qlora(x), merged, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(plain(x), merged, atol=1e-3)  # the quantisation error of W, which the base keeps


@pytest.mark.parametrize(("override", "message"), [
    ("lora={r: 4, quantize_base: int5}", r"'lora\.quantize_base' must be bool or one of 'nf4', 'int4', 'int3', 'int2', got 'int5'"),
    ("lora={r: 4, quantize_base: int3, group_size: 24}",
     r"lora: QLoRA cannot quantise target 'layers\.0\.attn\.wq' to int3: group_size=24 does not divide .* 32.*lora\.group_size"),
    ("lora={r: 4, init: loftq}", r"lora\.init=loftq .* set lora\.quantize_base"),
], ids=["bit-width", "group-size", "loftq-without-quantisation"])
def test_a_quantised_base_the_quantiser_cannot_make_is_one_line_naming_the_key_exit_2_nothing_written(
        tmp_path, base_checkpoint, sft_data, capsys, override, message):
    import re

    from lmforge.cli.main import main
    from tests.conftest import REPO

    args = [f"run_dir={tmp_path / 'run'}", f"checkpoint={base_checkpoint}", f"data.train=[{sft_data / 'train.jsonl'}]",
            "data.max_length=128", "train.device=cpu", override]
    assert main(["sft", str(REPO / "recipes/demo/sft.yaml"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["data.train", "data.val", "score.tasks"])
def test_a_missing_data_path_names_its_key_before_the_model_loads(tmp_path, base_checkpoint, sft_data, monkeypatch, key):
    import lmforge.stages.finetune as finetune

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load before the data paths are checked")

    monkeypatch.setattr(finetune, "load_base", no_load)
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(InputError, match=rf"sft {key} path '{missing}' matches no file"):
        run_sft(recipe(tmp_path, base_checkpoint, sft_data, f"{key}=[{missing}]"))
    assert not (tmp_path / "run").exists()  # nor is the run directory made


@pytest.mark.parametrize("overrides", [["parallel.tp=2"], ["parallel.pp=2"], ["lora={r: 4, quantize_base: true}"]])
def test_sft_under_torchrun_refuses_tensor_pipeline_and_qlora_layouts_before_any_work(tmp_path, base_checkpoint, sft_data,
                                                                                      monkeypatch, overrides):
    from lmforge.core.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"(?s)sft under torchrun .*(parallel\.tp=1 and parallel\.pp=1|quantize_base=false)"):
        run_sft(recipe(tmp_path, base_checkpoint, sft_data, *overrides))
    assert not (tmp_path / "run").exists()


def test_a_micro_batch_the_machine_cannot_hold_is_refused_before_the_model_loads(tmp_path, base_checkpoint, sft_data,
                                                                                 monkeypatch):
    import lmforge.stages.finetune as finetune
    from lmforge.core.config import ConfigError

    monkeypatch.setattr(finetune, "load_base", lambda *a, **k: pytest.fail("the base must not load"))
    with pytest.raises(ConfigError, match=r"^train\.micro_batch_size = 100000000 x data\.max_length = 128 needs at "
                                          r"least [\d.]+ [KMGT]?B per device .* more than the [\d.]+ [KMGT]?B of RAM"):
        run_sft(recipe(tmp_path, base_checkpoint, sft_data, "train.micro_batch_size=100000000"))
    assert not (tmp_path / "run").exists()


def test_rerunning_a_completed_run_keeps_its_summary(tmp_path, base_checkpoint, sft_data):
    run_sft(recipe(tmp_path, base_checkpoint, sft_data))
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    again = run_sft(recipe(tmp_path, base_checkpoint, sft_data))
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == saved
    for key in ("val_loss", "final_loss", "checkpoint", "tokens_per_s", "after", "final_checkpoint"):
        assert key in saved and again[key] == saved[key]


def test_eval_tasks_are_scored_every_eval_every_steps_into_metrics_and_the_report(tmp_path, base_checkpoint, sft_data,
                                                                                  corpus_texts):
    from lmforge.stages.sft import report
    from tests.eval.conftest import write_tasks

    files = write_tasks(tmp_path / "tasks", corpus_texts)
    summary = run_sft(recipe(tmp_path, base_checkpoint, sft_data, "score.name=none",
                             f"train.eval_tasks=[{files['tiny_mc']}, {files['tiny_rolling']}]"))
    scored = [r for r in read_metrics(tmp_path / "run") if "eval/tiny_mc/acc" in r]
    assert [r["step"] for r in scored] == [3, 6] and all("eval/tiny_rolling/bits_per_byte" in r for r in scored)
    assert summary["eval/tiny_mc/acc"] == scored[-1]["eval/tiny_mc/acc"]
    lines = report(summary, tmp_path / "run", tmp_path / "sft-loss.png")
    assert "| task | metric | step 3 | step 6 |" in lines and "![tasks over steps](sft-eval.png)" in lines
    assert any(line.startswith("| tiny_rolling | bits_per_byte | ") for line in lines)
    assert (tmp_path / "sft-eval.png").is_file()
    with pytest.raises(InputError, match="nope.yaml"):  # read before training
        run_sft(recipe(tmp_path / "bad", base_checkpoint, sft_data, f"train.eval_tasks=[{tmp_path / 'nope.yaml'}]"))
