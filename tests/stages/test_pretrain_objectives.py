"""``lmforge pretrain objective=mlm|span|prefix_lm`` on a tiny model, its resume, its bad input,
and ``lmforge eval``'s masked-token accuracy and span-reconstruction loss of what it trains."""

import json
from pathlib import Path

import pytest

from lmforge.cli.main import main
from lmforge.data.documents import DocumentsConfig
from lmforge.data.tokenizer import TokenizerConfig, train_tokenizer
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.train.metrics import read_metrics
from tests.conftest import write_jsonl

DEMO = "recipes/demo/pretrain.yaml"


@pytest.fixture(scope="module")
def encoder_data(tmp_path_factory, corpus_texts) -> tuple[Path, Path]:
    """A tokenizer with a mask token and 20 sentinels, and the demo prose prepared with it."""
    root = tmp_path_factory.mktemp("encoder")
    cfg = TokenizerConfig(vocab_size=512, mask_token="[MASK]", sentinel_tokens=20)
    train_tokenizer(corpus_texts, cfg).save(root / "tokenizer")
    docs = write_jsonl(root / "docs.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(corpus_texts)])
    run_prepare(PrepareRecipe(run_dir=str(root / "data"), tokenizer=str(root / "tokenizer"),
                              data=DocumentsConfig(paths=[str(docs)]), val_fraction=0.1))
    return root / "tokenizer", root / "data"


def tiny(run_dir: Path, tokenizer: Path, data: Path, **overrides) -> list[str]:
    """The demo recipe's overrides for a tiny fp32 model: 2 layers of width 32, 8 windows of 32 tokens a step."""
    keys = {"run_dir": run_dir, "tokenizer": tokenizer, "data.datasets": f"[{{path: {data}}}]", "data.seq_len": 32,
            "model.vocab_size": 512, "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4,
            "model.ffn_hidden": 64, "model.max_seq_len": 64, "train.max_steps": 12, "train.lr": 3e-3,
            "train.warmup_steps": 2, "train.micro_batch_size": 4, "train.batch_tokens": 256, "train.precision": "fp32",
            "train.compile": False, "train.device": "cpu", "train.eval_every": 6, "train.eval_batches": 2,
            "train.checkpoint_every": 6, "train.tensorboard": False, **overrides}
    return [DEMO, *(f"{k}={v}" for k, v in keys.items())]


@pytest.fixture(scope="module")
def trained(encoder_data, tmp_path_factory) -> dict[str, Path]:
    """A tiny model trained 12 steps with each objective by ``lmforge pretrain recipes/demo/pretrain.yaml objective=...``."""
    runs = {}
    for objective in ("mlm", "span", "prefix_lm"):
        runs[objective] = tmp_path_factory.mktemp("runs") / objective
        assert main(["pretrain", *tiny(runs[objective], *encoder_data, objective=objective)]) == 0
    return runs


def losses(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r.get("val_loss"), r.get("accuracy")) for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.parametrize("objective", ["mlm", "span", "prefix_lm"])
def test_the_demo_recipe_trains_each_objective_to_a_loss_below_its_first_step(objective, trained):
    rows = read_metrics(trained[objective])
    loss = [r["loss"] for r in rows if "loss" in r]
    assert len(loss) == 12 and loss[-1] < loss[0] - 0.1
    summary = json.loads((trained[objective] / "summary.json").read_text())
    assert summary["val_loss"] < loss[0] and 0 <= summary["val_accuracy"] <= 1
    assert all(0 < r["targets"] < r["tokens"] for r in rows if "targets" in r)  # the loss falls on some positions


def test_the_default_objective_is_the_causal_lm():
    from lmforge.core.config import load_config
    from lmforge.stages.pretrain import PretrainRecipe

    assert load_config(PretrainRecipe, DEMO).objective == "clm"


@pytest.mark.parametrize("objective", ["mlm", "span"])
def test_stopping_and_resuming_gives_the_losses_of_an_uninterrupted_run(objective, encoder_data, trained, tmp_path):
    half = tiny(tmp_path / "half", *encoder_data, objective=objective, **{"train.stop_at_step": 6})
    assert main(["pretrain", *half]) == 0
    assert len(losses(tmp_path / "half")) == 6
    assert main(["pretrain", *tiny(tmp_path / "half", *encoder_data, objective=objective)]) == 0
    assert losses(tmp_path / "half") == losses(trained[objective])  # bit-identical: the same masks, step by step


def test_a_compiled_forward_keeps_the_losses_of_the_eager_one(encoder_data, trained, tmp_path):
    run_dir = tmp_path / "compiled"
    assert main(["pretrain", *tiny(run_dir, *encoder_data, objective="span", **{"train.compile": True})]) == 0
    eager, compiled = losses(trained["span"]), losses(run_dir)
    assert [r[0] for r in compiled] == [r[0] for r in eager]
    assert all(abs(c[1] - e[1]) < 1e-4 for c, e in zip(compiled, eager))


def test_mlm_with_a_tokenizer_without_a_mask_token_is_one_line_naming_the_key_and_writes_nothing(
        encoder_data, small_tokenizer_dir, tmp_path, capsys):
    root = tmp_path / "plain"
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": "d0", "text": "To be, or not to be. " * 200}])
    run_prepare(PrepareRecipe(run_dir=str(root), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(docs)]), val_fraction=0.0))
    run_dir = tmp_path / "run"
    capsys.readouterr()  # prepare's log
    assert main(["pretrain", *tiny(run_dir, small_tokenizer_dir, root, objective="mlm")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "objective=mlm" in err and "tokenizer.mask_token" in err
    assert not run_dir.exists()


@pytest.mark.parametrize("density", ["0", "1", "1.5"])
def test_span_noise_density_outside_0_1_is_one_line_naming_the_key_and_writes_nothing(
        density, encoder_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["pretrain", *tiny(run_dir, *encoder_data, objective="span", **{"span.noise_density": density})]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "span.noise_density" in err
    assert not run_dir.exists()


def test_span_with_fewer_sentinels_than_spans_names_the_tokenizer_key(encoder_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = tiny(run_dir, *encoder_data, objective="span",
                **{"data.seq_len": 256, "model.max_seq_len": 256, "span.mean_span_length": 1.0})
    assert main(["pretrain", *args]) == 2  # 30 spans of one token in a window of 256, and 20 sentinels
    err = capsys.readouterr().err.strip()
    assert "tokenizer.sentinel_tokens" in err and len(err.splitlines()) == 1
    assert not run_dir.exists()


def test_a_model_with_causal_masks_of_its_own_is_refused_for_a_bidirectional_objective(encoder_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["pretrain", *tiny(run_dir, *encoder_data, objective="prefix_lm", **{"model.sliding_window": 16})]) == 2
    assert "model.sliding_window" in capsys.readouterr().err and not run_dir.exists()


def test_a_masked_lm_refuses_the_causal_tasks_of_train_eval_tasks(encoder_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = tiny(run_dir, *encoder_data, objective="mlm", **{"train.eval_tasks": "[demo_choices]"})
    assert main(["pretrain", *args]) == 2
    assert "train.eval_tasks" in capsys.readouterr().err and not run_dir.exists()


@pytest.mark.parametrize("objective,metrics", [("mlm", {"masked_accuracy", "masked_loss"}),
                                               ("span", {"span_accuracy", "span_loss"})])
def test_eval_reports_masked_token_accuracy_and_span_reconstruction_loss(objective, metrics, encoder_data, trained,
                                                                          tmp_path):
    data, out, again = encoder_data[1], tmp_path / "eval", tmp_path / "again"
    assert main(["eval", str(trained[objective]), "--tasks", str(data), "--out", str(out), "device=cpu"]) == 0
    results = {r["metric"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert set(results) == metrics
    prefix = "masked" if objective == "mlm" else "span"
    accuracy, loss = results[f"{prefix}_accuracy"], results[f"{prefix}_loss"]
    assert 0 <= accuracy["value"] <= 1 and accuracy["higher_is_better"] and not loss["higher_is_better"]
    assert 0 < loss["value"] < 7 and loss["n"] == accuracy["n"] > 20 and loss["stderr"] > 0
    summary = json.loads((trained[objective] / "summary.json").read_text())
    assert abs(loss["value"] - summary["val_loss"]) < 0.5  # the validation split, masked afresh: near the run's figure
    assert main(["eval", str(trained[objective]), "--tasks", str(data), "--out", str(again), "device=cpu"]) == 0
    assert json.loads((again / "results.json").read_text()) == json.loads((out / "results.json").read_text())


def test_eval_refuses_a_causal_task_for_a_masked_lm(trained, capsys):
    assert main(["eval", str(trained["mlm"]), "--tasks", "data/eval/demo_choices.yaml", "device=cpu"]) == 2
    assert "objective=mlm" in capsys.readouterr().err


def test_eval_scores_a_prefix_lm_as_a_causal_model(trained, corpus_texts, tmp_path):
    out, text = tmp_path / "eval", write_jsonl(tmp_path / "text.jsonl", [{"text": t[:400]} for t in corpus_texts[:4]])
    assert main(["eval", str(trained["prefix_lm"]), "--tasks", str(text), "--out", str(out), "device=cpu"]) == 0
    assert "bits_per_byte" in {r["metric"] for r in json.loads((out / "results.json").read_text())["results"]}


def test_modernbert_normalises_its_embeddings_and_transforms_its_head_where_lmforge_does_not():
    """What the pretrain guide says keeps every lmforge family from exporting to ModernBertForMaskedLM."""
    import torch
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    from lmforge.model.config import ModelConfig
    from lmforge.model.transformer import Transformer

    bert = ModernBertForMaskedLM(ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=3, num_attention_heads=4,
                                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                                  sep_token_id=2))
    assert isinstance(bert.model.embeddings.norm, torch.nn.LayerNorm)  # before the first block
    assert isinstance(bert.model.layers[0].attn_norm, torch.nn.Identity)  # and the first block has no pre-norm
    assert isinstance(bert.head.dense, torch.nn.Linear) and isinstance(bert.head.norm, torch.nn.LayerNorm)
    assert bert.decoder.bias is not None
    ours = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, ffn_hidden=64, max_seq_len=32))
    names = {n for n, _ in ours.named_parameters()}
    assert not any(n.startswith("embed.") and "norm" in n for n in names)  # the residual stream starts at the raw embedding
    assert any(n.startswith("layers.0.attn_norm") for n in names) and not any("lm_head.bias" in n for n in names)
