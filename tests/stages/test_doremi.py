"""`lmforge doremi`: the proxy's run, its weights file, exact resume and bad input."""

import json
from pathlib import Path

import pytest
import yaml

from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError
from lmforge.data.documents import DocumentsConfig
from lmforge.stages.doremi import DoReMiRecipe, run_doremi
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def domains(tmp_path_factory, small_tokenizer_dir, corpus_texts) -> dict[str, Path]:
    """Two prepared datasets, the corpus's first 40 documents and its last 20."""
    from tests.conftest import write_jsonl

    root = tmp_path_factory.mktemp("doremi_domains")
    out = {}
    for name, texts in (("early", corpus_texts[:40]), ("late", corpus_texts[40:])):
        docs = write_jsonl(root / f"{name}.jsonl", [{"id": f"{name}{i}", "text": t} for i, t in enumerate(texts)])
        run_prepare(PrepareRecipe(run_dir=str(root / name), tokenizer=str(small_tokenizer_dir),
                                  data=DocumentsConfig(paths=[str(docs)]), val_fraction=0.1))
        out[name] = root / name
    return out


def doremi_recipe(run_dir: Path, domains: dict, tokenizer: Path, reference: Path, **overrides) -> DoReMiRecipe:
    base = {
        "run_dir": str(run_dir), "tokenizer": str(tokenizer), "reference": str(reference),
        "data.datasets": "[" + ", ".join(f"{{path: {p}, name: {n}}}" for n, p in domains.items()) + "]",
        "data.seq_len": 32, "train.max_steps": 6, "train.lr": 3e-3, "train.warmup_steps": 1,
        "train.micro_batch_size": 4, "train.precision": "fp32", "train.eval_every": 3, "train.eval_batches": 1,
        "train.checkpoint_every": 3, "train.tensorboard": False, "train.device": "cpu",
    }
    base.update(overrides)
    return load_config(DoReMiRecipe, None, [f"{k}={v}" for k, v in base.items()])


def test_the_proxy_run_writes_domain_weights_that_a_pretrain_mixture_reads(domains, small_tokenizer_dir,
                                                                          base_checkpoint, tmp_path):
    summary = run_doremi(doremi_recipe(tmp_path / "proxy", domains, small_tokenizer_dir, base_checkpoint))
    written = json.loads((tmp_path / "proxy" / "domain_weights.json").read_text())
    weights = written["weights"]
    assert set(weights) == {"early", "late"} and sum(weights.values()) == pytest.approx(1.0, abs=1e-12)
    assert written["updates"] == 6 and written["step_size"] == 1.0 and written["smoothing"] == 1e-3
    assert summary["domain_weights"] == weights
    records = [r for r in read_metrics(tmp_path / "proxy") if "doremi/weight/early" in r]
    assert len(records) == 6 and "val/early/loss" in records[-1]
    # the logged weights are α after each step; the output is their mean
    mean = sum(r["doremi/weight/early"] for r in records) / 6
    assert weights["early"] == pytest.approx(mean, abs=1e-6)

    datasets = "[" + ", ".join(f"{{path: {p}, name: {n}}}" for n, p in domains.items()) + "]"
    main = load_config(PretrainRecipe, None, [
        f"run_dir={tmp_path / 'main'}", f"tokenizer={small_tokenizer_dir}", f"data.datasets={datasets}",
        f"data.weights_from={tmp_path / 'proxy' / 'domain_weights.json'}", "data.seq_len=32",
        "model.vocab_size=512", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_hidden=32",
        "model.max_seq_len=32", "train.max_steps=1", "train.warmup_steps=0", "train.micro_batch_size=2",
        "train.precision=fp32", "train.tensorboard=false", "train.device=cpu", "train.eval_batches=1"])
    run_pretrain(main)
    recorded = yaml.safe_load((tmp_path / "main" / "config.yaml").read_text())
    assert {d["name"]: d["weight"] for d in recorded["data"]["datasets"]} == pytest.approx(weights, abs=1e-12)


def test_resume_mid_proxy_run_gives_the_weights_of_an_uninterrupted_one(domains, small_tokenizer_dir,
                                                                       base_checkpoint, tmp_path):
    run_doremi(doremi_recipe(tmp_path / "full", domains, small_tokenizer_dir, base_checkpoint))
    run_doremi(doremi_recipe(tmp_path / "half", domains, small_tokenizer_dir, base_checkpoint,
                             **{"train.stop_at_step": 3}))
    state = json.loads((tmp_path / "half" / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["objective"]["updates"] == 3 and len(state["objective"]["weights"]) == 2
    resumed = run_doremi(doremi_recipe(tmp_path / "half", domains, small_tokenizer_dir, base_checkpoint))
    assert resumed["start_step"] == 3
    full, half = (json.loads((tmp_path / r / "domain_weights.json").read_text()) for r in ("full", "half"))
    assert half["weights"] == full["weights"] and half["final"] == full["final"]  # bit-identical
    assert [r["loss"] for r in read_metrics(tmp_path / "half")] == [r["loss"] for r in read_metrics(tmp_path / "full")]


def test_bad_input_is_refused_before_any_work(domains, small_tokenizer_dir, base_checkpoint, tmp_path):
    one = {"early": domains["early"]}
    with pytest.raises(InputError, match="data.datasets: DoReMi weighs the domains of a mixture, but 1 dataset"):
        run_doremi(doremi_recipe(tmp_path / "a", one, small_tokenizer_dir, base_checkpoint))
    with pytest.raises(ConfigError, match="train.compile"):
        run_doremi(doremi_recipe(tmp_path / "b", domains, small_tokenizer_dir, base_checkpoint,
                                 **{"train.compile": True}))
    with pytest.raises(InputError, match="data.seq_len 200 exceeds"):
        run_doremi(doremi_recipe(tmp_path / "c", domains, small_tokenizer_dir, base_checkpoint,
                                 **{"data.seq_len": 200}))
    with pytest.raises(InputError, match="reference: .* vocabulary of 512, model.vocab_size is 1024"):
        run_doremi(doremi_recipe(tmp_path / "d", domains, small_tokenizer_dir, base_checkpoint,
                                 **{"model": "{vocab_size: 1024, d_model: 32, n_layers: 1, n_heads: 2}"}))
    assert not any((tmp_path / r).exists() for r in "abcd")  # nothing written
