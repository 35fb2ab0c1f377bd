"""A mixture's per-dataset validation losses under torchrun (FSDP and a pipeline, gloo, CPU)
against one process's: each rank evaluates its rows of every dataset, the sums cross the ranks."""

import pytest

from lmforge.stages.pretrain import run_pretrain
from lmforge.train.metrics import read_metrics
from tests.distributed.conftest import torchrun
from tests.train.test_evaluate import prepared

LAYOUTS = {"fsdp": {"parallel.dp_shard": 2}, "pp": {"parallel.pp": 2, "parallel.pp_microbatches": 2}}


def test_two_ranks_report_each_datasets_validation_loss_as_one_process_does(tmp_path, recipe_for, shards_dir,
                                                                            small_tokenizer_dir, corpus_texts):
    upper = prepared(tmp_path, small_tokenizer_dir, [t.upper() for t in corpus_texts[:30]], "upper",
                     split="source_tail", val_fraction=0.2)
    mixture = {"data.datasets": f"[{{path: {shards_dir}, weight: 3}}, {{path: {upper}}}]"}
    run_pretrain(recipe_for(tmp_path / "reference", **mixture))
    torchrun(2, [{"kind": "pretrain", "recipe": recipe_for(tmp_path / name, **mixture, **overrides)}
                 for name, overrides in LAYOUTS.items()], tmp_path)
    keys = ("val_loss", "val_bpb", f"val/{shards_dir.name}/loss", "val/upper/loss", "val/upper/bpb")
    expected = [{k: r[k] for k in keys} for r in read_metrics(tmp_path / "reference") if "val_loss" in r]
    assert len(expected) == 1
    for name in LAYOUTS:
        got = [{k: r[k] for k in keys} for r in read_metrics(tmp_path / name) if "val_loss" in r]
        assert len(got) == 1 and got[0] == pytest.approx(expected[0], rel=1e-5), name
