"""Validation of every dataset of a mixture: ``val/<name>/loss`` per dataset, ``val_loss`` their
weighted mean, and the single-dataset metrics unchanged."""

import json
import logging

import pytest
import torch

from lmforge.checkpoints.load import load_model
from lmforge.core.io import InputError
from lmforge.data.documents import DocumentsConfig
from lmforge.data.loader import DatasetSource
from lmforge.data.shards import read_manifest
from lmforge.objectives.clm import CausalLMObjective
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from lmforge.stages.pretrain import (
    domain_lines,
    report,
    run_pretrain,
    unigram_baseline,
    unigram_entropy,
    validation_loader,
)
from lmforge.train.evaluate import Evaluator, ValidationSet, combine_domains, evaluate
from lmforge.train.metrics import read_metrics
from lmforge.train.step_log import format_step
from tests.conftest import write_jsonl


def prepared(root, tok_dir, texts, name, **kw):
    docs = write_jsonl(root / f"{name}.jsonl", [{"id": f"{name}{i}", "text": t} for i, t in enumerate(texts)])
    run_prepare(PrepareRecipe(run_dir=str(root / name), tokenizer=str(tok_dir), data=DocumentsConfig(paths=[str(docs)]),
                              **kw))
    return root / name


@pytest.fixture(scope="module")
def upper_dir(tmp_path_factory, small_tokenizer_dir, corpus_texts):
    """A second domain: the corpus in capitals (other tokens, another loss), its last fifth held out."""
    return prepared(tmp_path_factory.mktemp("upper"), small_tokenizer_dir, [t.upper() for t in corpus_texts[:30]],
                    "upper", split="source_tail", val_fraction=0.2)


def test_domains_are_named_and_val_loss_is_their_mixture_weighted_mean():
    web, code = ValidationSet("web", iter, 3.0), ValidationSet("code", iter, 1.0)
    out = combine_domains([(web, {"val_loss": 2.0, "val_bpb": 1.0}), (code, {"val_loss": 4.0}), (code, {})])
    assert out == {"val_loss": (3 * 2.0 + 4.0) / 4, "val_bpb": 1.0, "val/web/loss": 2.0, "val/web/bpb": 1.0,
                   "val/code/loss": 4.0}


def test_the_evaluator_runs_each_set_over_eval_batches_and_one_set_keeps_todays_names():
    calls = []

    def run(batches, max_batches):
        rows = list(batches)
        calls.append((rows, max_batches))
        return {"val_loss": float(sum(rows))}

    sets = [ValidationSet("a", lambda: iter([1, 2]), 1.0), ValidationSet("b", lambda: iter([5]), 1.0)]
    assert Evaluator(sets, 2, 7, run)() == {"val_loss": 4.0, "val/a/loss": 3.0, "val/b/loss": 5.0}
    assert calls == [([1, 2], 7), ([5], 7)]  # the same eval_batches for every dataset
    assert Evaluator(lambda: iter([1, 2]), 2, 7, run)() == {"val_loss": 3.0}
    assert not Evaluator([], 2, 7, run).due(2, final=True)  # no set: no validation


def test_a_mixture_logs_each_datasets_validation_loss_to_metrics_tensorboard_and_summary(make_recipe, shards_dir,
                                                                                          upper_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = make_recipe(**{"data.datasets": f"[{{path: {shards_dir}, weight: 3}}, {{path: {upper_dir}, name: caps}}]",
                            "train.tensorboard": True})
    summary = run_pretrain(recipe)
    name = shards_dir.name  # a dataset without a name is named by its directory
    val = [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    assert [r["step"] for r in val] == [4, 8]
    for r in val:
        assert r["val_loss"] == pytest.approx((3 * r[f"val/{name}/loss"] + r["val/caps/loss"]) / 4, rel=1e-12)
        assert r["val_bpb"] == pytest.approx((3 * r[f"val/{name}/bpb"] + r["val/caps/bpb"]) / 4, rel=1e-12)
    assert r[f"val/{name}/loss"] != pytest.approx(r["val/caps/loss"], rel=1e-3)
    # each figure is that dataset's own validation loss: the final model evaluated on it alone
    model, _ = load_model(tmp_path / "run")
    for path, key in ((shards_dir, f"val/{name}/loss"), (upper_dir, "val/caps/loss")):
        loader = validation_loader(recipe.data, read_manifest(path), recipe.train.micro_batch_size,
                                   dataset=next(d for d in recipe.data.datasets if d.path == str(path)))
        alone = evaluate(model, CausalLMObjective(), loader, torch.device("cpu"), "fp32", recipe.train.eval_batches)
        assert r[key] == pytest.approx(alone["val_loss"], rel=1e-5)
    assert format_step(r, 8).endswith(f"({name} {r[f'val/{name}/loss']:.4f}, caps {r['val/caps/loss']:.4f})")
    stored = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stored["val/caps/loss"] == summary["val/caps/loss"] == val[-1]["val/caps/loss"]
    assert any(line.startswith("- validation loss of caps:") for line in report(summary, tmp_path, tmp_path / "p.png"))
    own = {name: unigram_entropy(shards_dir, 512), "caps": unigram_entropy(upper_dir, 512)}
    assert summary["unigram_entropies"] == stored["unigram_entropies"] == own
    assert summary["unigram_entropy"] == pytest.approx((3 * own[name] + own["caps"]) / 4, rel=1e-12)  # as val_loss
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert {f"val/{name}/loss", "val/caps/loss", "val_loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("val/caps/loss")] == [4, 8]


def test_a_mixtures_val_loss_is_compared_with_its_datasets_unigram_entropies_weighted_as_val_loss_weights_them(
        shards_dir, upper_dir, tmp_path):
    web, caps = DatasetSource(str(shards_dir), weight=3.0, name="web"), DatasetSource(str(upper_dir), name="caps")
    own = {"web": unigram_entropy(shards_dir, 512), "caps": unigram_entropy(upper_dir, 512)}
    assert own["web"] != pytest.approx(own["caps"], rel=1e-3)  # the first dataset's alone would be another figure
    summary = {"val_loss": 3.0, "val/web/loss": 2.5, "val/caps/loss": 4.5}
    baseline = unigram_baseline([web, caps], 512, summary)
    assert baseline == {"unigram_entropy": pytest.approx((3 * own["web"] + own["caps"]) / 4, rel=1e-12),
                        "unigram_entropies": own}
    # a dataset left out of val_loss (no validation split) is left out of its entropy too
    assert unigram_baseline([web, caps], 512, {"val_loss": 2.5, "val/web/loss": 2.5})["unigram_entropy"] == own["web"]
    assert unigram_baseline([caps], 512, {"val_loss": 4.5}) == {"unigram_entropy": own["caps"]}  # one dataset: as ever
    lines = domain_lines({**summary, **baseline})
    assert lines == [f"validation loss of web: 2.5000 nats/token vs its unigram entropy {own['web']:.4f}",
                     f"validation loss of caps: 4.5000 nats/token vs its unigram entropy {own['caps']:.4f}"]
    line = report({**summary, **baseline}, tmp_path, tmp_path / "p.png")[1]
    assert f"unigram entropy of the data {baseline['unigram_entropy']:.4f} (the datasets' own, weighted as val_loss" in line


def test_one_dataset_keeps_todays_metric_names(make_recipe, tmp_path):
    summary = run_pretrain(make_recipe(**{"train.max_steps": 4}))
    keys = {k for r in read_metrics(tmp_path / "run") for k in r} | set(summary)
    assert "val_loss" in keys and "val_bpb" in keys and not any(k.startswith("val/") for k in keys)


def test_a_mixture_dataset_without_a_validation_split_is_left_out_with_a_warning(make_recipe, shards_dir, tmp_path,
                                                                               small_tokenizer_dir, corpus_texts, caplog):
    from lmforge.core.run import log

    no_val = prepared(tmp_path, small_tokenizer_dir, corpus_texts[:10], "no_val", val_fraction=0.0)
    log.addHandler(caplog.handler)  # the lmforge logger does not propagate to the root logger
    try:
        with caplog.at_level(logging.WARNING, logger="lmforge"):
            summary = run_pretrain(make_recipe(**{"train.max_steps": 4,
                                                  "data.datasets": f"[{{path: {shards_dir}}}, {{path: {no_val}}}]"}))
    finally:
        log.removeHandler(caplog.handler)
    assert summary["val_loss"] == summary[f"val/{shards_dir.name}/loss"] and "val/no_val/loss" not in summary
    assert any("no_val" in r.getMessage() and "left out of val_loss" in r.getMessage() for r in caplog.records)


def test_two_datasets_of_one_name_are_an_error_before_training(make_recipe, shards_dir, tmp_path):
    with pytest.raises(InputError, match=r"both named 'shards'.*give one a `name:`"):
        run_pretrain(make_recipe(**{"data.datasets": f"[{{path: {shards_dir}}}, {{path: {shards_dir}}}]"}))
    assert not (tmp_path / "run").exists()
    run_pretrain(make_recipe(**{"train.max_steps": 2, "train.eval_every": 0,
                                "data.datasets": f"[{{path: {shards_dir}}}, {{path: {shards_dir}, name: again}}]"}))


def test_the_evaluator_runs_the_stage_scorer_on_its_steps_even_without_validation_batches():
    from lmforge.train.evaluate import Evaluator

    calls = []
    evaluator = Evaluator(None, 3, None, run=lambda batches, n: {"val_loss": 1.0},
                          score=lambda: calls.append(1) or {"eval/t/acc": 0.5})
    assert [d for d in range(1, 8) if evaluator.due(d, final=d == 7)] == [3, 6, 7]
    assert evaluator() == {"eval/t/acc": 0.5} and calls == [1]
    both = Evaluator(lambda: iter([]), 3, None, run=lambda batches, n: {"val_loss": 1.0}, score=lambda: {"eval/t/acc": 0.5})
    assert both() == {"val_loss": 1.0, "eval/t/acc": 0.5}
    assert not Evaluator(None, 3, None, run=lambda b, n: {}).due(3, final=True)  # nothing to evaluate
