"""Pre-training with multi-token prediction (model.mtp) on the one loop: each depth's loss in metrics.jsonl,
learnt, saved and resumed with the checkpoint, drafting from the trained checkpoint, and the keys refused
before anything is written. (A compiled step with an MTP module: tests/train/test_step_moe.py.)"""

from __future__ import annotations

import pytest
import torch
import transformers

from lmforge.checkpoints.load import load_model
from lmforge.cli.main import main
from lmforge.inference.engine import GenerationConfig, generate
from lmforge.stages.pretrain import run_pretrain
from lmforge.train.metrics import read_metrics
from tests.train.conftest import tiny_pretrain_overrides

MTP = {"model.mtp.depth": 2, "model.mtp.loss_weight": 0.3}


def test_pretraining_logs_each_depth_and_resumes_exactly(make_recipe, tmp_path, capsys):
    run_pretrain(make_recipe(tmp_path / "full", **MTP, **{"train.max_steps": 8}))
    records = [r for r in read_metrics(tmp_path / "full") if "loss" in r]
    assert len(records) == 8 and all({"mtp/depth1", "mtp/depth2"} <= r.keys() for r in records)
    assert records[-1]["mtp/depth1"] < records[0]["mtp/depth1"]  # the modules learn
    # stopped at step 4 and resumed: the same losses, the MTP modules' weights and moments in the checkpoint
    run_pretrain(make_recipe(tmp_path / "half", **MTP, **{"train.max_steps": 8, "train.stop_at_step": 4}))
    run_pretrain(make_recipe(tmp_path / "half", **MTP, **{"train.max_steps": 8, "train.resume": "auto"}))
    resumed = [r for r in read_metrics(tmp_path / "half") if "loss" in r]
    assert [(r["loss"], r["mtp/depth1"], r["mtp/depth2"]) for r in resumed] == \
        [(r["loss"], r["mtp/depth1"], r["mtp/depth2"]) for r in records]
    # the checkpoint keeps the modules, and the engine drafts with them: the greedy tokens
    model, _ = load_model(tmp_path / "full")
    assert model.cfg.mtp.depth == 2 and len(model.mtp) == 2
    prompts = [[1, 40, 41, 42], [1, 7]]
    config = GenerationConfig(max_new_tokens=12, temperature=0, stop_token_ids=[])
    assert [g.tokens for g in generate(model, prompts, config, draft_tokens=2)] == \
        [g.tokens for g in generate(model, prompts, config)]
    # and `lmforge generate`'s draft_tokens: the same completions; more drafts than modules, one line, exit 2
    ckpt = f"checkpoint={tmp_path / 'full'}"
    capsys.readouterr()
    assert main(["generate", ckpt, "temperature=0", "max_new_tokens=8", "--prompt", "To be"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", ckpt, "temperature=0", "max_new_tokens=8", "draft_tokens=2", "--prompt", "To be"]) == 0
    assert capsys.readouterr().out == plain
    assert main(["generate", ckpt, "temperature=0", "draft_tokens=3", "--prompt", "To be"]) == 2
    err = capsys.readouterr().err.strip()
    assert "draft_tokens = 3 needs a model with at least 3 multi-token prediction modules" in err
    assert len(err.splitlines()) == 1
    # export leaves the modules out (LlamaForCausalLM has none): transformers computes the main model's logits
    assert main(["export", str(tmp_path / "full"), str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor(prompts[:1])
    with torch.no_grad():
        assert (theirs(ids).logits - model(ids)).abs().max() < 1e-5


@pytest.mark.parametrize("overrides, says", [
    ({"model.mtp.depth": 32}, "model.mtp.depth = 32 leaves no tokens to predict in a window of data.seq_len = 32"),
    ({"model.mtp.depth": 1, "objective": "mlm"}, "trains with objective=clm only"),
    ({"model.mtp.depth": -1}, "model.mtp.depth"),
])
def test_bad_mtp_keys_are_one_line_and_write_nothing(overrides, says, tmp_path, shards_dir, small_tokenizer_dir, capsys):
    run_dir = tmp_path / "run"
    assert main(["pretrain", *tiny_pretrain_overrides(run_dir, shards_dir, small_tokenizer_dir, **overrides)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not run_dir.exists()
