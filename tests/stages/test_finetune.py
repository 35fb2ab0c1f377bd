"""The fine-tuning skeleton (``stages/finetune.py``): every stage honours the training options that
``prepare_model`` applies, with the losses of the run without them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

import lmforge.stages.finetune as finetune
from lmforge.core.config import load_config
from lmforge.data.preference_demo import make_pairs, unpair, write_jsonl
from lmforge.data.sft_demo import make_examples, write_demo
from lmforge.stages import dpo, kto, reward, sft
from lmforge.train.metrics import read_metrics

COMMON = ["train.max_steps=2", "train.warmup_steps=0", "train.lr=1e-3", "train.micro_batch_size=4",
          "train.precision=fp32", "train.eval_every=0", "train.eval_batches=1", "train.tensorboard=false",
          "train.device=cpu"]
STAGES = {"sft": sft, "reward": reward, "dpo": dpo, "kto": kto}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("finetune_data")
    write_demo(path / "sft", 40, seed=0, val_fraction=0.2)
    pairs = make_pairs(make_examples(20, seed=3))
    write_jsonl(path / "train.jsonl", pairs[:16])
    write_jsonl(path / "val.jsonl", pairs[16:])
    write_jsonl(path / "kto_train.jsonl", unpair(pairs[:16]))
    return path


def stage_recipe(stage: str, run_dir, base, data, *overrides):
    files = {"sft": ("sft/train.jsonl", "sft/val.jsonl"), "kto": ("kto_train.jsonl", None)}.get(
        stage, ("train.jsonl", "val.jsonl"))
    keys = [f"run_dir={run_dir}", f"checkpoint={base}", f"data.train=[{data / files[0]}]",
            f"data.max_length={128 if stage == 'sft' else 96}"]
    if files[1]:
        keys.append(f"data.val=[{data / files[1]}]")
    return load_config(STAGES[stage].RECIPE, None, [*keys, *COMMON, *overrides])


def trained_module(monkeypatch) -> list[dict]:
    """What the module the skeleton hands to the loop is as each run starts: its blocks' types and
    its trainable parameters (after training, ``final/`` is saved from the plain blocks)."""
    seen, train = [], finetune.train

    def recording_train(**kwargs):
        model = kwargs["model"]
        seen.append({"blocks": [type(block) for block in model.layers],
                     "wrapped": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
                     "trainable": {name for name, p in model.named_parameters() if p.requires_grad}})
        return train(**kwargs)

    monkeypatch.setattr(finetune, "train", recording_train)
    return seen


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "kto"])
def test_activation_checkpointing_wraps_every_block_and_keeps_the_losses(tmp_path, base_checkpoint, data, monkeypatch,
                                                                         stage):
    seen = trained_module(monkeypatch)
    for ac in ("false", "true"):
        STAGES[stage].run(stage_recipe(stage, tmp_path / ac, base_checkpoint, data,
                                       f"train.activation_checkpointing={ac}"))
    plain, checkpointed = seen
    assert checkpointed["blocks"] == [CheckpointWrapper] * 2 and checkpointed["wrapped"] == 2
    assert plain["wrapped"] == 0
    losses = [[r[key] for r in read_metrics(tmp_path / ac) for key in ("loss", "grad_norm")] for ac in ("false", "true")]
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6)


def test_lora_under_activation_checkpointing_trains_the_adapters_only(tmp_path, base_checkpoint, data, monkeypatch):
    seen = trained_module(monkeypatch)
    sft.run(stage_recipe("sft", tmp_path / "run", base_checkpoint, data, "lora={r: 4, alpha: 8}",
                         "train.activation_checkpointing=true"))
    (model,) = seen
    assert model["trainable"] and all("lora_" in name for name in model["trainable"])
    assert model["blocks"] == [CheckpointWrapper] * 2
    adapter = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert adapter and not any("checkpoint" in key for key in adapter)  # PEFT's names, as without checkpointing


def test_compile_compiles_the_training_forward_and_keeps_the_losses(tmp_path, base_checkpoint, data):
    """In one process ``train.compile`` is the loop's: the forward and the loss as one graph
    (``prepare_model`` leaves the module as is; under torchrun it compiles each block, see
    tests/distributed). Compiling even the tiny model takes tens of seconds on a CPU, so this runs
    for one stage, DPO (the policy's ``[chosen; rejected]`` forward and the loss); the skeleton hands
    every stage's ``train.compile`` to the same loop, and activation checkpointing, which the
    skeleton applies itself, is checked in all four above."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled_before = counters["stats"]["unique_graphs"]
    for opt in ("false", "true"):
        dpo.run(stage_recipe("dpo", tmp_path / opt, base_checkpoint, data, f"train.compile={opt}"))
        if opt == "false":
            assert counters["stats"]["unique_graphs"] == compiled_before
    assert counters["stats"]["unique_graphs"] > compiled_before
    losses = [[r["loss"] for r in read_metrics(tmp_path / opt)] for opt in ("false", "true")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("stage, old, new, value", [
    ("dpo", "beta", "objective.beta", 0.5), ("dpo", "loss", "objective.loss", "ipo"),
    ("kto", "desirable_weight", "objective.desirable_weight", 1.25), ("sft", "data.assistant_only",
                                                                      "objective.assistant_only", False),
    ("dpo", "eval.max_examples", "score.max_examples", 7), ("sft", "eval.exact_match", "score.name", True)])
def test_an_old_recipe_key_still_works_for_one_release_and_warns_with_the_new_key(stage, old, new, value):
    import logging

    from lmforge.core.run import log

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)  # the lmforge logger does not propagate to the root logger
    try:
        recipe = load_config(STAGES[stage].RECIPE, None, [f"{old}={value}"])
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in records] == [f"overrides: '{old}' is deprecated: use '{new}'"]
    section, key = new.split(".")
    expected = {True: "exact_match"}.get(value, value) if new == "score.name" else value
    assert getattr(getattr(recipe, section), key) == expected


def test_the_demo_recipes_score_exact_match_and_nest_their_objective():
    """The demo keeps its before/after exact match by naming the scorer; the stages score nothing by default."""
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    for stage, path in [("sft", "demo/sft.yaml"), ("dpo", "demo/dpo.yaml"), ("kto", "demo/kto.yaml"),
                        ("sft", "distributed/cpu_fsdp_sft.yaml"), ("dpo", "distributed/cpu_fsdp_dpo.yaml")]:
        recipe = load_config(STAGES[stage].RECIPE, recipes / path)
        assert recipe.score.name == "exact_match", path
        assert load_config(STAGES[stage].RECIPE).score.name == "none"
    assert load_config(dpo.RECIPE, recipes / "demo/dpo.yaml").objective.beta == 0.1
    assert load_config(reward.RECIPE, recipes / "demo/reward.yaml").objective.center_coef == 0.01
