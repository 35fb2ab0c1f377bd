"""A lifecycle's ``rounds:``: k rounds of the same stages written once, expanded into named stages
(``rs_r1``, ``dpo_r1``, ...) whose placeholders make round r read round r-1's model; bad rounds
refused as the recipe is read, naming its file and key; a real two-round run of rs -> dpo that a
rerun skips; and the shipped recipes/iterative/ lifecycles resolve without running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lmforge.core.config import ConfigError, load_config
from lmforge.stages.lifecycle import LifecycleRecipe, planned_stages, resolve_stages, run_lifecycle
from tests.conftest import REPO

# a random model's responses (mostly cut at max_new_tokens) differ in their number of characters
REWARD = ["reward.components=[{kind: callable, function: 'tests.stages.test_lifecycle_rounds:characters'}]"]
TRAIN = ["train.max_steps=1", "train.warmup_steps=0", "train.micro_batch_size=2", "train.precision=fp32",
         "train.eval_every=1", "train.tensorboard=false", "train.device=cpu", "data.max_length=96"]


def characters(text: str, prompt) -> float:
    """The reward of the real run: the response's length in characters."""
    return float(len(text))


def rounds_recipe(tmp_path: Path, start: str, prompts: Path, count: int = 2) -> dict:
    """Rounds of rs (pairs, sampled by the previous round's model) -> dpo (from that model)."""
    out = tmp_path / "it"
    return {"run_dir": str(tmp_path / "run"), "rounds": {
        "count": count, "start": start, "model": f"{out}/r{{round}}/dpo",
        "stages": [
            {"name": "rs", "verb": "rs", "overrides": [
                "checkpoint={prev_model}", f"run_dir={out}/r{{round}}/rs", "output=pairs", f"data.prompts=[{prompts}]",
                "rollout.n=4", "rollout.max_new_tokens=8", "rollout.seed={round}", "device=cpu", *REWARD]},
            {"name": "dpo", "verb": "dpo", "overrides": [
                "checkpoint={prev_model}", f"data.train=[{out}/r{{round}}/rs/pairs.jsonl]", f"run_dir={out}/r{{round}}/dpo",
                *TRAIN]},
        ]}}


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "life.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_rounds_expand_into_named_stages_each_reading_the_previous_rounds_model(tmp_path):
    data = rounds_recipe(tmp_path, "runs/demo/sft", tmp_path / "p.jsonl", count=3)
    data["stages"] = [{"name": "sft", "verb": "sft"}]
    planned = planned_stages(load_config(LifecycleRecipe, write(tmp_path, data)))
    assert [(p.name, p.round) for p in planned] == [("sft", None), ("rs_r1", 1), ("dpo_r1", 1), ("rs_r2", 2),
                                                    ("dpo_r2", 2), ("rs_r3", 3), ("dpo_r3", 3)]
    out = tmp_path / "it"
    rs = {p.round: p.spec.overrides for p in planned if p.spec.verb == "rs"}
    assert rs[1][:2] == ["checkpoint=runs/demo/sft", f"run_dir={out}/r1/rs"] and "rollout.seed=1" in rs[1]
    assert rs[2][:2] == [f"checkpoint={out}/r1/dpo", f"run_dir={out}/r2/rs"] and "rollout.seed=2" in rs[2]
    assert rs[3][0] == f"checkpoint={out}/r2/dpo"
    dpo = next(p for p in planned if p.name == "dpo_r3")
    assert dpo.spec.name == "dpo_r3" and dpo.spec.overrides[:3] == [
        f"checkpoint={out}/r2/dpo", f"data.train=[{out}/r3/rs/pairs.jsonl]", f"run_dir={out}/r3/dpo"]
    # {prev} is the previous round's number; a YAML flow mapping ({kind: callable, ...}) is no placeholder
    data["rounds"]["stages"][1]["overrides"].append("data.val=[r{prev}.jsonl]")
    planned = planned_stages(load_config(LifecycleRecipe, write(tmp_path, data)))
    assert [p.spec.overrides[-1] for p in planned if p.spec.verb == "dpo"] == [
        "data.val=[r0.jsonl]", "data.val=[r1.jsonl]", "data.val=[r2.jsonl]"]
    assert REWARD[0] in planned[1].spec.overrides


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["rounds"]["stages"][0]["overrides"].append("rollout.seed={rond}"),
     r"life.yaml: .*rounds.stages\[0\].overrides\[9\] = 'rollout.seed=\{rond\}': unknown placeholder \{rond\}; "
     r"did you mean \{round\}\?"),
    (lambda d: d["rounds"].update(count=0), r"life.yaml: .*rounds.count = 0: must be >= 1"),
    (lambda d: d["rounds"].update(count=-1), r"life.yaml: 'rounds.count' = -1: must be >= 0"),
    (lambda d: d["rounds"].pop("count"), r"life.yaml: .*rounds.count = 0: must be >= 1"),
    (lambda d: d.update(stages=[{"name": "rs_r2", "verb": "rs"}]),
     r"life.yaml: .*stage names must be unique: 'rs_r2' is in stages and in round 2 of rounds.stages"),
    (lambda d: d.update(stages=[{"name": "x", "verb": "rs", "overrides": ["checkpoint={prev_model}"]}]),
     r"life.yaml: .*stages\[0\].overrides\[0\] = 'checkpoint=\{prev_model\}': \{prev_model\} is replaced only in "
     r"rounds.stages"),
    (lambda d: d["rounds"].pop("start"), r"life.yaml: .*\{prev_model\} needs rounds.start"),
    (lambda d: d["rounds"].update(model="runs/it/dpo"), r"life.yaml: .*rounds.model = 'runs/it/dpo': it must contain "
                                                        r"\{round\}"),
    (lambda d: d["rounds"].update(stages=[]), r"life.yaml: .*rounds.stages is empty"),
    (lambda d: d["rounds"]["stages"][0].update(name="rs{round}"), r"life.yaml: .*rounds.stages\[0\].name = "
                                                                  r"'rs\{round\}': takes no placeholder"),
])
def test_bad_rounds_are_refused_as_the_recipe_is_read_naming_the_file_and_key(tmp_path, change, message):
    data = rounds_recipe(tmp_path, "runs/demo/sft", tmp_path / "p.jsonl")
    change(data)
    with pytest.raises(ConfigError, match=message):
        load_config(LifecycleRecipe, write(tmp_path, data))


def test_a_rounds_model_that_no_stage_of_the_round_writes_fails_before_any_stage_runs(tmp_path, base_checkpoint,
                                                                                       prompts):
    data = rounds_recipe(tmp_path, str(base_checkpoint), prompts)
    data["rounds"]["model"] = str(tmp_path / "elsewhere" / "r{round}")
    with pytest.raises(ConfigError, match=r"rounds.model: round 1's model .*elsewhere/r1 is in none of round 1's "
                                          r"stage run_dirs \(.*it/r1/rs, .*it/r1/dpo\)"):
        run_lifecycle(load_config(LifecycleRecipe, write(tmp_path, data)))
    assert not (tmp_path / "it").exists()


def test_two_real_rounds_each_sample_with_the_previous_rounds_model_and_a_rerun_skips_them(
        tmp_path, base_checkpoint, prompts, corpus_texts):
    from tests.eval.conftest import write_tasks

    tasks = write_tasks(tmp_path / "tasks", corpus_texts)
    data = rounds_recipe(tmp_path, str(base_checkpoint), prompts)
    data["report_card"] = {"tasks": [str(tasks["tiny_mc"])], "device": "cpu"}
    life = write(tmp_path, data)
    results = run_lifecycle(load_config(LifecycleRecipe, life))
    assert [(r["name"], r["round"], r["status"]) for r in results] == [
        ("rs_r1", 1, "ran"), ("dpo_r1", 1, "ran"), ("rs_r2", 2, "ran"), ("dpo_r2", 2, "ran")]
    out = tmp_path / "it"
    sampled_by = [Path(json.loads((out / f"r{r}" / "rs" / "summary.json").read_text())["checkpoint"]) for r in (1, 2)]
    assert sampled_by[0] == base_checkpoint.resolve()  # round 1: rounds.start
    assert sampled_by[1] == (out / "r1" / "dpo" / "final").resolve()  # round 2: round 1's DPO model
    assert yaml.safe_load((out / "r2" / "rs" / "config.yaml").read_text())["checkpoint"] == str(out / "r1" / "dpo")
    trained_from = [yaml.safe_load((out / f"r{r}" / "dpo" / "config.yaml").read_text()) for r in (1, 2)]
    assert [c["checkpoint"] for c in trained_from] == [str(base_checkpoint), str(out / "r1" / "dpo")]
    assert trained_from[1]["data"]["train"] == [str(out / "r2" / "rs" / "pairs.jsonl")]
    assert results[3]["result"]["train_examples"] == results[2]["result"]["kept"] > 0

    report = (tmp_path / "run" / "report.md").read_text()
    assert "| stage | round | verb | status | seconds | outputs |" in report and "| rs_r2 | 2 | rs | ran |" in report
    assert "| task | metric | start | dpo_r1 | dpo_r2 |" in report and "| *round* | | *0* | *1* | *2* |" in report
    assert report.index("## round 1") < report.index("### rs_r1 (rs)") < report.index("### dpo_r1 (dpo)") < \
        report.index("## round 2") < report.index("### rs_r2 (rs)") < report.index("### dpo_r2 (dpo)")
    assert (tmp_path / "run" / "report-card" / "start" / "results.json").is_file()

    card = tmp_path / "run" / "report-card" / "dpo_r2" / "results.json"
    stamp = card.stat().st_mtime_ns
    again = run_lifecycle(load_config(LifecycleRecipe, life))
    assert [(r["name"], r["status"]) for r in again] == [
        ("rs_r1", "skipped"), ("dpo_r1", "skipped"), ("rs_r2", "skipped"), ("dpo_r2", "skipped")]
    assert card.stat().st_mtime_ns == stamp and "## round 2" in (tmp_path / "run" / "report.md").read_text()


def test_the_shipped_iterative_recipes_parse_and_resolve_every_round(monkeypatch):
    monkeypatch.chdir(REPO)  # their paths are relative to the repository
    paths = sorted((REPO / "recipes" / "iterative").glob("*.yaml"))
    assert paths
    for path in paths:
        recipe = load_config(LifecycleRecipe, path)
        assert recipe.rounds.count >= 2 and recipe.report_card.tasks
        plans = resolve_stages(recipe)  # every stage's config, the rounds' models checked; nothing runs
        cfgs = {p.name: cfg for p, _, cfg, _ in plans}
        assert cfgs["rs_r1"].checkpoint == recipe.rounds.start  # each round's first rs: the previous round's model
        assert cfgs["rs_r2"].checkpoint == recipe.rounds.model.replace("{round}", "1")
        assert cfgs["rs_r1"].reward.components[0].kind == "demo_exact_match"
        assert cfgs["dpo_r2"].run_dir == recipe.rounds.model.replace("{round}", "2")
        made = [recipe.rounds.start]  # what the start and the stages so far leave
        for planned, _, cfg, stage_dir in plans:  # each reads the start, an earlier stage's files or bundled data
            reads = [cfg.checkpoint, *(cfg.data.prompts if planned.spec.verb == "rs" else cfg.data.train)]
            for path in reads:
                bundled = not path.startswith("runs/") and Path(path).exists()
                assert bundled or any(path == m or path.startswith(m + "/") for m in made), (
                    f"{planned.name} reads {path}, which no earlier stage writes")
            made.append(str(stage_dir))


def test_the_demo_mid_trains_on_the_sft_tasks_but_never_on_the_held_out_ones(monkeypatch):
    monkeypatch.chdir(REPO)
    plans = resolve_stages(load_config(LifecycleRecipe, REPO / "recipes" / "demo" / "lifecycle.yaml"))
    cfgs = {p.name: cfg for p, _, cfg, _ in plans}
    names = list(cfgs)
    assert names.index("prepare") < names.index("prepare_chat") < names.index("pretrain") < names.index("sft")
    chat = cfgs["prepare_chat"]
    assert chat.data.messages_field == "messages" and chat.tokenizer == cfgs["tokenizer"].run_dir
    mixture = {d.path: d.weight for d in cfgs["pretrain"].data.datasets}
    assert mixture == {cfgs["prepare"].run_dir: 0.75, chat.run_dir: 0.25}
    held_out = {json.loads(line)["messages"][1]["content"] for line in open("data/sft/val.jsonl")}
    assert len(held_out) == 75 and cfgs["sft"].data.val == cfgs["grpo"].data.val == ["data/sft/val.jsonl"]
    for path in chat.data.paths:  # the exact-match scores are of questions pre-training never saw
        questions = {m["content"] for line in open(path) for m in json.loads(line)["messages"] if m["role"] == "user"}
        assert questions and not questions & held_out, path
