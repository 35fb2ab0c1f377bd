import json

import pytest
import yaml

from lmforge.core.config import ConfigError, load_config
from lmforge.core.run import RunDirBusy
from lmforge.stages.lifecycle import LifecycleRecipe, run_lifecycle
from tests.core.test_run import hold_in_subprocess


@pytest.fixture()
def lifecycle(tmp_path, corpus_jsonl):
    """tokenizer -> prepare -> pretrain on a tiny corpus, as a lifecycle file with stage recipes."""
    recipes = {
        "tokenizer": {"run_dir": str(tmp_path / "tok"), "data": {"paths": [str(corpus_jsonl)]},
                      "tokenizer": {"vocab_size": 400}},
        "prepare": {"run_dir": str(tmp_path / "data"), "tokenizer": str(tmp_path / "tok"),
                    "data": {"paths": [str(corpus_jsonl)]}, "val_fraction": 0.1},
        "pretrain": {"run_dir": str(tmp_path / "pretrain"), "tokenizer": str(tmp_path / "tok"),
                     "model": {"vocab_size": 400, "d_model": 32, "n_layers": 1, "n_heads": 2, "ffn_hidden": 64,
                               "max_seq_len": 64},
                     "data": {"datasets": [{"path": str(tmp_path / "data")}], "seq_len": 32},
                     "train": {"max_steps": 4, "warmup_steps": 1, "micro_batch_size": 4, "precision": "fp32",
                               "eval_every": 2, "eval_batches": 2, "tensorboard": False, "device": "cpu"}},
    }
    stages = []
    for name, body in recipes.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(body))
        stages.append({"name": name, "verb": name, "recipe": str(path)})
    life = tmp_path / "lifecycle.yaml"
    life.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "stages": stages}))
    return life


def test_stages_run_in_order_and_the_report_has_their_results(lifecycle, tmp_path):
    results = run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    assert [(r["name"], r["status"]) for r in results] == [("tokenizer", "ran"), ("prepare", "ran"), ("pretrain", "ran")]
    report = (tmp_path / "run" / "report.md").read_text()
    assert "bytes/token" in report and "validation loss" in report and "![loss curve](pretrain-loss.png)" in report
    assert (tmp_path / "run" / "pretrain-loss.png").stat().st_size > 1000
    assert json.loads((tmp_path / "run" / "lifecycle.json").read_text())[2]["result"]["step"] == 4


def test_a_rerun_skips_complete_stages_and_a_changed_stage_reruns_with_what_follows(lifecycle, tmp_path):
    run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    again = run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    assert [r["status"] for r in again] == ["skipped"] * 3
    assert "validation loss" in (tmp_path / "run" / "report.md").read_text()  # the report keeps skipped results
    data = yaml.safe_load(lifecycle.read_text())
    data["stages"][1]["overrides"] = ["val_fraction=0.2"]
    lifecycle.write_text(yaml.safe_dump(data))
    changed = run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    assert [r["status"] for r in changed] == ["skipped", "ran", "ran"]


def test_a_bad_later_stage_fails_before_any_stage_runs(lifecycle, tmp_path):
    data = yaml.safe_load(lifecycle.read_text())
    data["stages"][2]["overrides"] = ["train.max_stepz=3"]
    lifecycle.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"stage 'pretrain'.*did you mean 'train.max_steps'"):
        run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    assert not (tmp_path / "tok").exists()


def test_unknown_verb_is_named():
    with pytest.raises(ConfigError, match="unknown verb 'pretrian'"):
        run_lifecycle(load_config(LifecycleRecipe, None, ["stages=[{name: x, verb: pretrian}]"]))


def test_a_nested_lifecycle_is_refused_as_such_not_as_an_unknown_verb():
    with pytest.raises(ConfigError, match="verb 'run' cannot be a stage") as info:
        run_lifecycle(load_config(LifecycleRecipe, None, ["stages=[{name: x, verb: run}]"]))
    assert "unknown verb" not in str(info.value)
    with pytest.raises(ConfigError, match=r"unknown verb 'pretrian'; did you mean 'pretrain'\?") as info:
        run_lifecycle(load_config(LifecycleRecipe, None, ["stages=[{name: x, verb: pretrian}]"]))
    assert " run," not in str(info.value).partition("verbs:")[2]  # the list offers only verbs a stage can be


@pytest.mark.parametrize("override", [
    "stages=[{name: ../../../ESCAPED, verb: tokenizer}]",
    "stages=[{name: /tmp/ESCAPED, verb: tokenizer}]",
    "stages=[{name: '', verb: ''}]",
    "rounds={count: 1, stages: [{name: ../up, verb: tokenizer}]}",
])
def test_a_stage_or_round_name_that_is_a_path_is_refused_before_anything_runs(override, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"(stages|rounds\.stages)\[0\]\.name = .*not a path"):
        run_lifecycle(load_config(LifecycleRecipe, None, [f"run_dir={tmp_path / 'a' / 'b' / 'run'}", override]))
    assert list(tmp_path.iterdir()) == []  # no figure, no run directory, nothing above run_dir


def test_a_stage_whose_outputs_were_removed_or_whose_inputs_changed_runs_again(lifecycle, tmp_path, corpus_jsonl):
    run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    import shutil

    shutil.rmtree(tmp_path / "pretrain" / "checkpoints")  # the marker alone no longer vouches for the stage
    again = run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    assert [r["status"] for r in again] == ["skipped", "skipped", "ran"]
    assert (tmp_path / "pretrain" / "checkpoints" / "step_00000004").is_dir()
    with open(corpus_jsonl, "a") as f:  # the raw corpus the tokenizer and prepare stages read
        f.write(json.dumps({"id": "new", "text": "One more document about the sea and the sky."}) + "\n")
    changed = run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    assert [r["status"] for r in changed] == ["ran", "ran", "ran"]
    assert [r["status"] for r in run_lifecycle(load_config(LifecycleRecipe, lifecycle))] == ["skipped"] * 3


def test_a_busy_stage_directory_stops_the_lifecycle_before_its_outputs_are_removed(lifecycle, tmp_path):
    run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    holder = hold_in_subprocess(tmp_path / "pretrain")  # e.g. `lmforge pretrain` run by hand into it
    try:
        with pytest.raises(RunDirBusy, match=rf"pid {holder.pid} on "):
            run_lifecycle(load_config(LifecycleRecipe, lifecycle, ["force=true"]))
        assert (tmp_path / "pretrain" / "checkpoints" / "step_00000004").is_dir()
    finally:
        holder.communicate("")


def test_report_card_scores_every_stage_model_and_matches_the_in_loop_figures(lifecycle, tmp_path, corpus_texts):
    from lmforge.train.metrics import read_metrics
    from tests.eval.conftest import write_tasks

    files = write_tasks(tmp_path / "tasks", corpus_texts)
    data = yaml.safe_load(lifecycle.read_text())
    data["stages"][2]["overrides"] = [f"train.eval_tasks=[{files['tiny_rolling']}]"]
    data["report_card"] = {"tasks": [str(files["tiny_mc"]), str(files["tiny_rolling"])], "device": "cpu"}
    lifecycle.write_text(yaml.safe_dump(data))
    run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    scored = [r for r in read_metrics(tmp_path / "pretrain") if "eval/tiny_rolling/bits_per_byte" in r]
    assert [r["step"] for r in scored] == [2, 4]
    card = tmp_path / "run" / "report-card" / "pretrain" / "results.json"
    figures = {(r["task"], r["metric"]): r["value"] for r in json.loads(card.read_text())["results"]}
    # the loop's last figure is the final checkpoint's, scored afresh by `lmforge eval`
    assert figures["tiny_rolling", "bits_per_byte"] == pytest.approx(scored[-1]["eval/tiny_rolling/bits_per_byte"])
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## report card" in report and "| task | metric | pretrain |" in report  # the one stage with a model
    assert f"| tiny_mc | acc ↑ | {figures['tiny_mc', 'acc']:.4f} |" in report and "word_perplexity" not in report
    assert "![tasks over steps](pretrain-eval.png)" in report
    stamp = card.stat().st_mtime_ns
    run_lifecycle(load_config(LifecycleRecipe, lifecycle))  # nothing changed: the figures are kept
    assert card.stat().st_mtime_ns == stamp and "## report card" in (tmp_path / "run" / "report.md").read_text()
    data["report_card"]["stages"] = ["pretrian"]
    lifecycle.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"report_card.stages: pretrian not among the stages"):
        run_lifecycle(load_config(LifecycleRecipe, lifecycle))


def test_the_report_card_scores_only_stages_that_trained_a_model():
    from lmforge.stages.report_card import stage_checkpoint

    assert stage_checkpoint({"result": {"step": 300, "checkpoint": "p/checkpoints/step_300"}}) == "p/checkpoints/step_300"
    assert stage_checkpoint({"result": {"step": 150, "checkpoint": "s/c", "final_checkpoint": "s/final"}}) == "s/final"
    assert stage_checkpoint({"result": {"checkpoint": "s/final", "results": []}}) is None  # an eval stage's result
    assert stage_checkpoint({"result": [{"text": "..."}]}) is None and stage_checkpoint({"result": None}) is None


def test_a_stage_stopped_by_a_time_limit_is_said_so_and_resumed_by_the_next_run(lifecycle, tmp_path, caplog):
    data = yaml.safe_load(lifecycle.read_text())
    data["stages"][2]["overrides"] = ["train.stop_at_step=2"]  # the time limit, deterministically
    data["stages"].append({"name": "again", "verb": "tokenizer", "recipe": data["stages"][0]["recipe"],
                           "overrides": [f"run_dir={tmp_path / 'tok2'}"]})
    lifecycle.write_text(yaml.safe_dump(data))
    with caplog.at_level("WARNING", logger="lmforge"):
        first = run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    assert [r["status"] for r in first] == ["ran", "ran", "stopped early at step 2 of 4", "ran"]
    assert "pretrain (pretrain): stopped early at step 2 of 4, by a time limit" in caplog.text
    report = (tmp_path / "run" / "report.md").read_text()
    assert "| pretrain | pretrain | stopped early at step 2 of 4 |" in report
    assert "**Stopped early:** pretrain (stopped early at step 2 of 4)" in report
    assert not (tmp_path / "pretrain" / ".lmforge-complete.json").exists()  # not complete: resumed next time
    data["stages"][2]["overrides"] = []
    lifecycle.write_text(yaml.safe_dump(data))
    second = run_lifecycle(load_config(LifecycleRecipe, lifecycle))
    assert [r["status"] for r in second] == ["skipped", "skipped", "ran", "ran"]  # resumed, and what follows rerun
    assert second[2]["result"]["step"] == 4 and second[2]["result"]["start_step"] == 2
    assert "Stopped early" not in (tmp_path / "run" / "report.md").read_text()
    assert [r["status"] for r in run_lifecycle(load_config(LifecycleRecipe, lifecycle))] == ["skipped"] * 4


def test_the_report_card_heads_a_stopped_stage_as_such():
    from lmforge.stages.report_card import card_lines

    result = {"task": "t", "metric": "acc", "filter": "none", "value": 0.5, "higher_is_better": True}
    card = {"stages": ["pretrain", "sft"], "results": {"pretrain": [result], "sft": [result]}, "seconds": 1.0}
    assert "| task | metric | pretrain (stopped early) | sft |" in card_lines(card, {"pretrain"})
    assert "| task | metric | pretrain | sft |" in card_lines(card)


def test_an_export_stage_writes_a_folder_transformers_loads_and_a_rerun_skips_it(tmp_path, base_checkpoint):
    """The lifecycle locks each stage's folder (which makes it) before the stage runs: export takes the
    folder holding only that lock as its own, and keeps the lock through its atomic swap."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    stages = [{"name": "export", "verb": "export", "overrides": [f"checkpoint={base_checkpoint}",
                                                                 f"run_dir={tmp_path / 'hf'}"]}]
    life = tmp_path / "lifecycle.yaml"
    life.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "stages": stages}))
    assert [r["status"] for r in run_lifecycle(load_config(LifecycleRecipe, life))] == ["ran"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    assert [r["status"] for r in run_lifecycle(load_config(LifecycleRecipe, life))] == ["skipped"]
    again = run_lifecycle(load_config(LifecycleRecipe, life, ["force=true"]))  # an earlier export is replaced
    assert [r["status"] for r in again] == ["ran"]
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.num_hidden_layers == 2
