"""SFT of a base with multi-token prediction modules (model.mtp): the modules train on the assistant tokens
(each depth's loss in metrics.jsonl), and the keys that would leave them untrained are refused first."""

from __future__ import annotations

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.stages.sft import run_sft
from lmforge.train.metrics import read_metrics
from tests.stages.test_sft import recipe, sft_data  # noqa: F401 - the fixture


@pytest.fixture(scope="module")
def mtp_base(tmp_path_factory, small_tokenizer_dir):
    path = tmp_path_factory.mktemp("mtp_base")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                    max_seq_len=128, mtp=dict(depth=2)))
    write_model_files(path, model, small_tokenizer_dir)
    write_checksums(path)
    return path


def test_sft_trains_the_mtp_modules_on_the_assistant_tokens(tmp_path, mtp_base, sft_data):  # noqa: F811
    run_sft(recipe(tmp_path, mtp_base, sft_data, "train.max_steps=4", "score.max_examples=2"))
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert records and all({"mtp/depth1", "mtp/depth2"} <= r.keys() for r in records)
    assert records[-1]["mtp/depth1"] < records[0]["mtp/depth1"]


@pytest.mark.parametrize("extra, says", [
    (["data.max_length=2"], "model.mtp.depth = 2 leaves no tokens to predict in a window of data.max_length = 2"),
    (["dp.epsilon=8", "data.packing=false"], "dp: the base"),
])
def test_keys_that_leave_the_modules_untrained_are_refused_first(tmp_path, mtp_base, sft_data, extra, says,  # noqa: F811
                                                                 capsys):
    overrides = [f"run_dir={tmp_path / 'run'}", f"checkpoint={mtp_base}", f"data.train=[{sft_data / 'train.jsonl'}]",
                 "data.max_length=128", "train.max_steps=2", "train.warmup_steps=1", *extra]
    assert main(["sft", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_lora_sft_of_an_mtp_base_exports_the_main_models_adapters_that_peft_loads(tmp_path, mtp_base, sft_data):  # noqa: F811
    from peft import AutoPeftModelForCausalLM

    run_sft(recipe(tmp_path, mtp_base, sft_data, "train.max_steps=3", "score.max_examples=2", "lora={r: 4, alpha: 8}"))
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert all("mtp/depth2" in r for r in records)  # the modules' adapters train too (kept in the merged model)
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "run" / "adapter")).eval()
    tuned, _ = load_model(tmp_path / "run")  # final/: the adapters merged, the MTP modules' included
    assert tuned.cfg.mtp.depth == 2
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():  # fp32: W x + s B(A x) against (W + s BA) x differ by rounding only
        assert torch.allclose(peft_model(ids).logits, tuned(ids), atol=1e-5)
