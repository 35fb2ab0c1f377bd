"""`lmforge reward`, `dpo` and `kto` end to end on a tiny model: the loop, the reference, the results."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lmforge.checkpoints.load import load_model, load_reward_model
from lmforge.core.config import load_config
from lmforge.core.io import InputError
from lmforge.data.preference_demo import make_pairs, unpair, write_jsonl
from lmforge.data.sft_demo import make_examples
from lmforge.stages.dpo import DPORecipe, run_dpo
from lmforge.stages.kto import KTORecipe, run_kto
from lmforge.stages.reward import RewardRecipe, run_reward
from lmforge.train.metrics import read_metrics

COMMON = ["data.max_length=96", "train.max_steps=4", "train.warmup_steps=0", "train.lr=1e-3",
          "train.micro_batch_size=4", "train.precision=fp32", "train.eval_every=2", "train.eval_batches=null",
          "train.tensorboard=false", "train.device=cpu"]



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("preference")
    pairs = make_pairs(make_examples(30, seed=3))
    write_jsonl(path / "train.jsonl", pairs[:22])
    write_jsonl(path / "val.jsonl", pairs[22:])
    write_jsonl(path / "kto_train.jsonl", unpair(pairs[:22]))
    return path


def dpo_recipe(tmp_path, base, data, *overrides) -> DPORecipe:
    return load_config(DPORecipe, None, [
        f"run_dir={tmp_path / 'dpo'}", f"checkpoint={base}", f"data.train=[{data / 'train.jsonl'}]",
        f"data.val=[{data / 'val.jsonl'}]", "score.name=exact_match", "score.max_examples=4", "score.max_new_tokens=4", *COMMON, *overrides])


def test_dpo_starts_at_ln2_learns_the_preference_and_writes_a_model(tmp_path, base_checkpoint, data, monkeypatch):
    summary = run_dpo(dpo_recipe(tmp_path, base_checkpoint, data, "objective.beta=0.5"))
    records = read_metrics(tmp_path / "dpo")
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference at step 1
    assert records[0]["margin"] == pytest.approx(0.0, abs=1e-5)
    assert records[-1]["loss"] < records[0]["loss"]
    assert {"reward_chosen", "reward_rejected", "accuracy", "ties", "kl_k1", "grad_norm"} <= set(records[-1])
    assert "kl" not in records[-1]  # named for the estimate it is, which can be negative
    assert records[0]["ties"] == 1.0 and records[0]["accuracy"] == 0.0  # policy == reference: every margin 0
    before, after = summary["before"], summary["after"]
    assert before["val_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert after["val_margin"] > before["val_margin"] and after["logp_margin"] > before["logp_margin"]
    assert before["exact_match"]["examples"] == 4
    import matplotlib.axes

    from lmforge.stages.dpo import report  # the lifecycle report's line, from the named scorer's figures

    labels = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel", lambda ax, label, **kw: labels.append(label))
    lines = "\n".join(report(summary, tmp_path / "dpo", tmp_path / "plot.png"))
    assert "- exact match on 4 tasks: **" in lines
    assert before["val_ties"] == 1.0 and "preference accuracy n/a (every pair a tie: margin 0 at init) → " in lines
    assert labels == ["dpo loss per pair"]  # not nats/token: the loss is a pair's
    model, where = load_model(tmp_path / "dpo")
    assert where.name == "final"


@pytest.mark.parametrize("stage", ["dpo", "reward"])
def test_rerunning_a_completed_run_keeps_its_summary(tmp_path, base_checkpoint, data, stage):
    if stage == "dpo":
        run_stage, make = run_dpo, lambda: dpo_recipe(tmp_path, base_checkpoint, data)
    else:
        run_stage, make = run_reward, lambda: load_config(RewardRecipe, None, [
            f"run_dir={tmp_path / stage}", f"checkpoint={base_checkpoint}", f"data.train=[{data / 'train.jsonl'}]",
            f"data.val=[{data / 'val.jsonl'}]", *COMMON])
    run_stage(make())
    saved = json.loads((tmp_path / stage / "summary.json").read_text())
    again = run_stage(make())
    assert json.loads((tmp_path / stage / "summary.json").read_text()) == saved
    for key in ("val_loss", "final_loss", "checkpoint", "tokens_per_s", "after", "final_checkpoint"):
        assert key in saved and again[key] == saved[key]


@pytest.mark.parametrize("precompute", ["true", "false"])
def test_bf16_dpo_starts_at_ln2(tmp_path, base_checkpoint, data, precompute):
    """In bf16 too the no-grad reference computes what the policy's training forward does
    (attention included: ``attend`` routes both alike), so the first loss is ln 2."""
    run_dpo(dpo_recipe(tmp_path, base_checkpoint, data, "train.precision=bf16", "train.max_steps=1",
                       f"precompute_reference={precompute}", "score.name=none"))
    first = read_metrics(tmp_path / "dpo")[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["margin"] == pytest.approx(0.0, abs=1e-6)


def test_lora_dpo_uses_the_model_with_adapters_disabled_as_reference(tmp_path, base_checkpoint, data, monkeypatch):
    import lmforge.objectives.reference as reference

    def no_copy(model, prepare=None):
        raise AssertionError("a LoRA policy must not copy the model for its reference")

    monkeypatch.setattr(reference, "frozen_copy_reference", no_copy)
    summary = run_dpo(dpo_recipe(tmp_path, base_checkpoint, data, "lora={r: 4, alpha: 8}",
                                 "precompute_reference=false"))
    records = read_metrics(tmp_path / "dpo")
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # B = 0 at init: policy == reference
    assert records[-1]["kl_k1"] != 0.0 and summary["lora"]
    assert (tmp_path / "dpo" / "adapter" / "adapter_model.safetensors").is_file()


def test_full_fine_tuning_precomputes_the_reference_with_the_policy_itself_not_a_copy(tmp_path, base_checkpoint,
                                                                                     data, monkeypatch):
    import lmforge.objectives.reference as reference

    def no_copy(model, prepare=None):
        raise AssertionError("precomputing the reference must not copy the model")

    monkeypatch.setattr(reference, "frozen_copy_reference", no_copy)
    run_dpo(dpo_recipe(tmp_path, base_checkpoint, data, "precompute_reference=true", "train.max_steps=1",
                       "score.name=none"))
    assert read_metrics(tmp_path / "dpo")[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_precomputed_and_live_reference_give_the_same_losses(tmp_path, base_checkpoint, data):
    run_dpo(dpo_recipe(tmp_path / "a", base_checkpoint, data, "precompute_reference=true"))
    run_dpo(dpo_recipe(tmp_path / "b", base_checkpoint, data, "precompute_reference=false"))
    a = [r["loss"] for r in read_metrics(tmp_path / "a" / "dpo")]
    b = [r["loss"] for r in read_metrics(tmp_path / "b" / "dpo")]
    assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.parametrize("loss", ["simpo", "orpo", "cpo", "ipo"])
def test_every_paired_loss_trains_through_the_loop(tmp_path, base_checkpoint, data, loss):
    summary = run_dpo(dpo_recipe(tmp_path, base_checkpoint, data, f"objective.loss={loss}", "train.max_steps=2"))
    assert math.isfinite(summary["final_loss"]) and summary["loss"] == loss


def test_kto_trains_on_unpaired_examples_with_a_kl_baseline(tmp_path, base_checkpoint, data):
    recipe = load_config(KTORecipe, None, [
        f"run_dir={tmp_path / 'kto'}", f"checkpoint={base_checkpoint}", f"data.train=[{data / 'kto_train.jsonl'}]",
        f"pairs=[{data / 'val.jsonl'}]", "score.tasks=[]", "score.name=none", *COMMON])
    summary = run_kto(recipe)
    records = read_metrics(tmp_path / "kto")
    assert records[0]["loss"] == pytest.approx(0.5, abs=1e-5)  # r = z0 = 0: each example costs λ/2
    assert records[-1]["loss"] < records[0]["loss"] and "kl" in records[-1]
    assert summary["after"]["logp_margin"] > summary["before"]["logp_margin"]


def test_kto_warns_at_the_start_when_the_weights_are_out_of_balance(tmp_path, base_checkpoint, data, caplog):
    import logging

    from lmforge.core.run import log

    log.addHandler(caplog.handler)  # the lmforge logger does not propagate to the root logger
    try:
        with caplog.at_level(logging.WARNING, logger="lmforge"):
            run_kto(load_config(KTORecipe, None, [
                f"run_dir={tmp_path / 'kto'}", f"checkpoint={base_checkpoint}",
                f"data.train=[{data / 'kto_train.jsonl'}]", "objective.desirable_weight=3", "score.name=none",
                *COMMON, "train.max_steps=1"]))
    finally:
        log.removeHandler(caplog.handler)
    (warning,) = {r.getMessage() for r in caplog.records if "out of balance" in r.getMessage()}
    assert "3·22 / (1·22) = 3.00" in warning and "desirable_weight in [1.00, 1.33]" in warning


def test_reward_model_learns_the_pairs_and_reloads_with_its_head(tmp_path, base_checkpoint, data):
    recipe = load_config(RewardRecipe, None, [
        f"run_dir={tmp_path / 'rm'}", f"checkpoint={base_checkpoint}", f"data.train=[{data / 'train.jsonl'}]",
        f"data.val=[{data / 'val.jsonl'}]", *COMMON, "data.max_length=128", "train.max_steps=8"])
    summary = run_reward(recipe)
    records = read_metrics(tmp_path / "rm")
    assert records[-1]["loss"] < records[0]["loss"]
    assert 0.0 <= summary["after"]["val_accuracy"] <= 1.0 and "val_margin" in summary["after"]
    model = load_reward_model(tmp_path / "rm")
    ids = torch.tensor([[1, 5, 9, 11]])
    assert model(ids).shape == (1,)
    head = tmp_path / "rm" / "final" / "reward_head.safetensors"
    head.write_bytes(head.read_bytes()[:-8])  # the head is checksummed with the rest of final/
    with pytest.raises(InputError, match="reward_head.safetensors: checksum mismatch"):
        load_reward_model(tmp_path / "rm")


def test_reward_model_skips_and_counts_over_long_pairs_by_default_while_dpo_truncates(tmp_path, base_checkpoint,
                                                                                     data):
    from lmforge.stages.reward import report as reward_report

    lines = (data / "train.jsonl").read_text().splitlines()[:8]
    long_pair = '{"prompt": "Q", "chosen": "' + " a" * 200 + '", "rejected": " b"}'
    (tmp_path / "train.jsonl").write_text("\n".join([*lines, long_pair]) + "\n")
    recipe = load_config(RewardRecipe, None, [
        f"run_dir={tmp_path / 'rm'}", f"checkpoint={base_checkpoint}", f"data.train=[{tmp_path / 'train.jsonl'}]",
        *COMMON, "data.max_length=128", "train.max_steps=1"])
    assert recipe.data.on_too_long == "skip" and load_config(DPORecipe).data.on_too_long == "truncate"
    summary = run_reward(recipe)
    assert summary["train_examples"] == 8 and summary["skipped"]["by_reason"] == {"too_long": 1}
    assert any("skipped or truncated: 1 {'too_long': 1}" in line
               for line in reward_report(summary, tmp_path / "rm", tmp_path / "plot.png"))


def test_dpo_gradient_accumulation_equals_one_big_batch(tmp_path, base_checkpoint, data):
    # batch_tokens counts a pair as two rows of data.max_length: 2 x 96 x 4 x 2 = two micro-batches of 4
    run_dpo(dpo_recipe(tmp_path / "a", base_checkpoint, data, "train.micro_batch_size=4", "train.batch_tokens=1536",
                       "train.max_steps=3", "score.name=none"))
    run_dpo(dpo_recipe(tmp_path / "b", base_checkpoint, data, "train.micro_batch_size=8", "train.batch_tokens=1536",
                       "train.max_steps=3", "score.name=none"))  # one micro-batch of 8 pairs
    a = [r["loss"] for r in read_metrics(tmp_path / "a" / "dpo")]
    b = [r["loss"] for r in read_metrics(tmp_path / "b" / "dpo")]
    assert a == pytest.approx(b, rel=1e-5) and len(a) == 3


def test_auto_precision_is_chosen_once_so_evaluation_and_training_agree(tmp_path, base_checkpoint, data,
                                                                       monkeypatch):
    import lmforge.train.loop as loop

    measured = iter(["fp32", "bf16"])  # a quick CPU measurement can come out otherwise the second time
    chosen = []

    def resolve(precision, device):
        chosen.append(precision)
        return (next(measured), "auto") if precision == "auto" else (precision, "set in the recipe")

    monkeypatch.setattr(loop, "resolve_precision", resolve)
    summary = run_dpo(dpo_recipe(tmp_path, base_checkpoint, data, "train.precision=auto", "train.max_steps=1",
                                 "score.name=none"))
    assert chosen.count("auto") == 1 and summary["precision"] == "fp32"


@pytest.mark.parametrize("stage", ["dpo", "kto", "reward"])
@pytest.mark.parametrize("overrides", [["parallel.tp=2"], ["parallel.pp=2"], ["lora={r: 4, quantize_base: true}"]])
def test_preference_stages_under_torchrun_refuse_tensor_pipeline_and_qlora_layouts_before_any_work(
        tmp_path, base_checkpoint, data, monkeypatch, stage, overrides):
    from lmforge.core.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    train = data / ("kto_train.jsonl" if stage == "kto" else "train.jsonl")
    recipe_type, run = {"dpo": (DPORecipe, run_dpo), "kto": (KTORecipe, run_kto), "reward": (RewardRecipe, run_reward)}[stage]
    recipe = load_config(recipe_type, None, [f"run_dir={tmp_path / stage}", f"checkpoint={base_checkpoint}",
                                             f"data.train=[{train}]", *COMMON, *overrides])
    with pytest.raises(ConfigError, match=rf"(?s){stage} under torchrun .*(parallel\.tp=1 and parallel\.pp=1|quantize_base=false)"):
        run(recipe)
    assert not (tmp_path / stage).exists()


def test_pairwise_preference_restores_train_mode_when_scoring_fails():
    from lmforge.stages.scoring import pairwise_preference

    class Failing(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise RuntimeError("out of memory")

    model = Failing().train()
    rows = {f"{side}_{k}": torch.ones(2, 4, dtype=torch.long) for side in ("chosen", "rejected")
            for k in ("input_ids", "labels", "attention_mask")}
    with pytest.raises(RuntimeError, match="out of memory"):
        pairwise_preference(model, rows, 2, torch.device("cpu"), "fp32")
    assert model.training


@pytest.mark.parametrize("key", ["data.val", "score.tasks", "pairs"])
def test_a_missing_data_path_names_its_recipe_key_before_the_model_loads(tmp_path, base_checkpoint, data,
                                                                         monkeypatch, key):
    import lmforge.stages.finetune as finetune

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load before the data paths are checked")

    monkeypatch.setattr(finetune, "load_base", no_load)
    missing = tmp_path / "nope.jsonl"
    if key == "pairs":
        recipe = load_config(KTORecipe, None, [f"run_dir={tmp_path / 'kto'}", f"checkpoint={base_checkpoint}",
                                               f"data.train=[{data / 'kto_train.jsonl'}]", f"pairs=[{missing}]",
                                               *COMMON])
        run = run_kto
    else:
        recipe, run = dpo_recipe(tmp_path, base_checkpoint, data, f"{key}=[{missing}]"), run_dpo
    with pytest.raises(InputError, match=rf"{key} path '{missing}' matches no file"):
        run(recipe)


def test_kto_held_out_pairs_follow_the_recipes_on_bad(tmp_path, base_checkpoint, data):

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text((data / "val.jsonl").read_text() + '{"prompt": "Q", "chosen": " same", "rejected": " same"}\n')
    common = [f"checkpoint={base_checkpoint}", f"data.train=[{data / 'kto_train.jsonl'}]", f"pairs=[{pairs}]",
              "score.name=none", *COMMON, "train.max_steps=1"]
    with pytest.raises(InputError, match=r"pairs.jsonl:9: 'chosen' and 'rejected' are identical"):
        run_kto(load_config(KTORecipe, None, [f"run_dir={tmp_path / 'a'}", *common]))
    summary = run_kto(load_config(KTORecipe, None, [f"run_dir={tmp_path / 'b'}", *common, "data.on_bad=skip"]))
    assert summary["after"]["pairs"] == 8


@pytest.mark.parametrize("n", [0, 1, 3, 8])
def test_equal_shares_cover_every_row_once_and_give_every_rank_as_many_rows(n):
    """How the ranks split the rows whose reference log-probs they precompute (finetune.attach_reference)."""
    from lmforge.stages.finetune import equal_share

    shares = [equal_share(n, rank, 2) for rank in range(2)]
    rows = [i for share, _ in shares for i in range(n)[share]]
    assert rows == list(range(n))  # in order, each once
    sizes = {share.stop - share.start + pad for share, pad in shares}
    assert sizes == {-(-n // 2)}  # padded to the same size


def test_dpo_report_says_ties_as_ties():
    from lmforge.stages.dpo import report

    res = {"loss": "dpo", "before": {"val_margin": 0.0, "val_accuracy": 0.0, "val_ties": 1.0},
           "after": {"val_margin": 0.5, "val_accuracy": 0.7733, "val_ties": 0.02}}
    lines = "\n".join(report(res, Path("/nonexistent"), Path("/nonexistent/plot.png")))
    assert "preference accuracy n/a (every pair a tie: margin 0 at init) → 77.3% (2.0% ties)" in lines


def test_fine_tuning_results_print_formatted_not_as_dicts():
    from lmforge.stages.finetune import format_results

    text = format_results({"val_loss": 0.6931471805599453, "exact_match": {"exact_match": 0.10666666666666667,
                                                                           "examples": 150}})
    assert text == "val_loss 0.6931, exact_match {exact_match 0.1067, examples 150}"
    assert format_results({}) == "nothing scored"
