"""`lmforge cai label` and `cai revise` with rule-based judges whose preferences are known: the
pairs, the swap averaging, disagreement, thresholds and output files are exactly right; a
rerun resumes without judging again and gives the uninterrupted run's files; bad recipes
are refused before any work."""

from __future__ import annotations

import json
import math
from itertools import combinations

import pytest

from lmforge.core.config import ConfigError, load_config
from lmforge.data.chat import read_sft_examples
from lmforge.data.preference import read_preference_pairs
from lmforge.feedback.labels import NoChoice
from lmforge.stages import VERBS_BY_NAME
from lmforge.stages.cai import CAIRecipe, run_cai
from tests.conftest import REPO
from tests.feedback import rules

pytestmark = pytest.mark.usefixtures("one_thread")

CONSTITUTION = str(REPO / "data" / "constitutions" / "demo_tasks.yaml")


def recipe(run_dir, checkpoint, prompts, *overrides, what="label") -> CAIRecipe:
    return load_config(CAIRecipe, None, [f"what={what}", f"run_dir={run_dir}", f"checkpoint={checkpoint}",
                                         f"data.prompts=[{prompts}]", f"constitution={CONSTITUTION}",
                                         "rollout.n=3", "rollout.max_new_tokens=6", "prompts_per_chunk=2",
                                         "device=cpu", "judge.function=tests.feedback.rules:shorter", *overrides])


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_label_pairs_every_two_distinct_responses_and_prefers_what_the_judge_prefers(tmp_path, judge_checkpoint,
                                                                                    prompts, small_tokenizer):
    summary = run_cai(recipe(tmp_path / "cai", judge_checkpoint, prompts))
    judged = lines(tmp_path / "cai" / "judgements.jsonl")
    pairs = lines(tmp_path / "cai" / "pairs.jsonl")
    expected, ties, judged_pairs = [], 0, 0
    for record in judged:  # what a "prefer the shorter" judge must give, from the samples alone
        texts = [s["text"] for s in record["samples"]]
        first = {}
        for i, t in enumerate(texts):
            if t.strip():
                first.setdefault(t, i)
        for ix, iy in combinations(sorted(first.values()), 2):
            judged_pairs += 1
            x, y = texts[ix], texts[iy]
            if len(x) == len(y):
                ties += 1
                continue
            chosen, rejected = (x, y) if len(x) < len(y) else (y, x)
            expected.append((record["source"], chosen, rejected))
    assert [(p["cai"]["source"], p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == expected
    assert all(p["confidence"] == 1.0 and p["margin"] == pytest.approx(math.log(9999)) for p in pairs)
    assert summary["prompts"] == 6 and summary["pairs_judged"] == judged_pairs and summary["kept"] == len(expected)
    assert summary["dropped"].get("no_preference", 0) == ties and summary["disagreement_rate"] == 0.0
    assert pairs[0]["answer"] == judged[0]["fields"]["answer"] and pairs[0]["prompt"] == judged[0]["prompt"]
    read = list(read_preference_pairs([str(tmp_path / "cai" / "pairs.jsonl")], small_tokenizer, 256))
    assert len(read) == len(pairs) and all(p.margin == pytest.approx(math.log(9999)) for p in read)


def test_a_position_biased_judge_is_balanced_by_the_two_orders_and_its_disagreement_reported(
        tmp_path, judge_checkpoint, prompts):
    summary = run_cai(recipe(tmp_path / "cai", judge_checkpoint, prompts, "judge.function=tests.feedback.rules:biased"))
    pairs = lines(tmp_path / "cai" / "pairs.jsonl")
    judged = [p for r in lines(tmp_path / "cai" / "judgements.jsonl") for p in r["pairs"]]
    unequal = [p for p in judged if p["p_x"][0] != 0.75]  # responses of different lengths
    assert unequal and len(pairs) == len(unequal)
    for p in unequal:  # P(A) 0.95 for the shorter as (A), 0.55 for the longer: P(x) 0.95 and 0.45, or 0.55 and 0.05
        assert p["disagree"] is True and p["p_x"] in ([pytest.approx(0.95), pytest.approx(0.45)],
                                                      [pytest.approx(0.55), pytest.approx(0.05)])
        assert p["p_x_better"] == pytest.approx(0.7 if p["p_x"][0] > 0.9 else 0.3)
    assert all(p["confidence"] == pytest.approx(0.7) and p["margin"] == pytest.approx(math.log(0.7 / 0.3))
               for p in pairs)
    assert summary["disagreement_rate"] == pytest.approx(sum(p["disagree"] for p in judged) / len(judged))
    assert summary["mean_p_first_position"] > 0.7  # the bias is visible, and cancelled in the labels
    # a threshold above 0.7 drops every pair; nothing is judged again
    summary = run_cai(recipe(tmp_path / "cai", judge_checkpoint, prompts, "judge.function=tests.feedback.rules:biased",
                             "label.threshold=0.75"))
    assert summary["kept"] == 0 and summary["dropped"]["below_threshold"] == len(unequal)
    assert (tmp_path / "cai" / "pairs.jsonl").read_text() == ""


def test_a_text_judge_that_always_says_a_gives_ties_and_full_disagreement(tmp_path, judge_checkpoint, prompts):
    summary = run_cai(recipe(tmp_path / "cai", judge_checkpoint, prompts, "judge.function=tests.feedback.rules:says_a"))
    assert summary["kept"] == 0 and summary["dropped"]["no_preference"] == summary["pairs_judged"] > 0
    assert summary["disagreement_rate"] == 1.0 and summary["answers_read_by"] == {"parsed": 2 * summary["pairs_judged"]}


def test_an_answer_naming_neither_option_stops_naming_the_pair_or_is_counted(tmp_path, judge_checkpoint, prompts):
    neither = "judge.function=tests.feedback.rules:neither"
    with pytest.raises(NoChoice, match=r"prompts.jsonl:1 samples \d,\d \(x, y\): the judge's answer names neither"):
        run_cai(recipe(tmp_path / "a", judge_checkpoint, prompts, neither))
    summary = run_cai(recipe(tmp_path / "b", judge_checkpoint, prompts, neither, "label.on_no_choice=skip"))
    pairs = sum(len(r["pairs"]) for r in lines(tmp_path / "b" / "judgements.jsonl"))
    assert summary["kept"] == summary["pairs_judged"] == 0 and summary["dropped"]["no_choice"] == pairs > 0


def test_an_interrupted_label_run_resumes_to_the_uninterrupted_runs_files(tmp_path, judge_checkpoint, prompts):
    run_cai(recipe(tmp_path / "whole", judge_checkpoint, prompts))
    run_cai(recipe(tmp_path / "cut", judge_checkpoint, prompts, "data.max_prompts=2"))  # stopped after one chunk
    log = tmp_path / "cut" / "judgements.jsonl"
    with open(log, "a") as f:
        f.write('{"fingerprint": "a line cut by a ki')  # a kill during the append
    rules.CALLS["n"] = 0
    run_cai(recipe(tmp_path / "cut", judge_checkpoint, prompts))
    calls = rules.CALLS["n"]
    for name in ("judgements.jsonl", "pairs.jsonl"):
        assert (tmp_path / "cut" / name).read_text() == (tmp_path / "whole" / name).read_text()
    whole = lines(tmp_path / "whole" / "judgements.jsonl")
    assert calls == 2 * sum(len(r["pairs"]) for r in whole[2:])  # only the prompts not judged before
    rules.CALLS["n"] = 0
    run_cai(recipe(tmp_path / "cut", judge_checkpoint, prompts))
    assert rules.CALLS["n"] == 0


def test_a_log_of_another_recipe_is_refused(tmp_path, judge_checkpoint, prompts):
    run_cai(recipe(tmp_path / "cai", judge_checkpoint, prompts, "data.max_prompts=2"))
    with pytest.raises(Exception, match="another checkpoint, judge, constitution, rollout or seed"):
        run_cai(recipe(tmp_path / "cai", judge_checkpoint, prompts, "rollout.temperature=0.5"))


def test_revise_writes_the_final_revisions_as_sft_data_and_every_round_in_the_trace(tmp_path, judge_checkpoint,
                                                                                   prompts, small_tokenizer):
    r = recipe(tmp_path / "rev", judge_checkpoint, prompts, "rollout.n=1", "revise.rounds=2",
               "judge.function=tests.feedback.rules:critic", what="revise")
    summary = run_cai(r)
    trace = lines(tmp_path / "rev" / "trace.jsonl")
    sft = lines(tmp_path / "rev" / "sft.jsonl")
    assert len(trace) == summary["prompts"] == 6 and summary["rounds"] == 12
    for t in trace:  # what the rule critic must have written, round by round
        current = t["response"]
        assert len(t["rounds"]) == 2
        for step in t["rounds"]:
            assert step["principle"] in {"correct", "format", "complete"}
            if not current.strip():
                assert step == {"principle": step["principle"], "critique": None, "revision": None,
                                "skipped": "empty_response", "kept": False}
                continue
            assert step["critique"] == f"'{current}' is too long" and step["revision"] == current[:3]
            assert step["kept"] == bool(current[:3].strip())
            current = current[:3] if current[:3].strip() else current
        assert t["final"] == current
    written = [t for t in trace if t["final"].strip()]
    assert summary["dropped_empty"] == len(trace) - len(sft)
    assert [s["messages"] for s in sft] == [[*t["prompt"], {"role": "assistant", "content": t["final"]}]
                                            for t in written]
    assert [s["answer"] for s in sft] == [t["fields"]["answer"] for t in written]
    assert len(list(read_sft_examples([str(tmp_path / "rev" / "sft.jsonl")], small_tokenizer, 256))) == len(sft)
    again = run_cai(r)  # a rerun redraws nothing: the same principles, the same files
    assert again == summary and lines(tmp_path / "rev" / "trace.jsonl") == trace


@pytest.mark.parametrize("what", ["revise", "label"])
def test_names_in_a_constitution_never_become_paths(tmp_path, judge_checkpoint, prompts, what):
    """Constitution and principle names are only recorded (trace, summary), never file names:
    names like ``../../x`` write nothing outside run_dir."""
    constitution = tmp_path / "c.yaml"
    constitution.write_text("name: ../../x\nprinciples:\n"
                            + "".join(f"  - {{name: '{n}', critique: c, revision: r, comparison: q}}\n"
                                      for n in ("../../x", str(tmp_path / "abs"), "..")))
    run_dir = tmp_path / "a" / "b" / "run"
    before = set(tmp_path.rglob("*"))
    critic = "critic" if what == "revise" else "shorter"
    summary = run_cai(recipe(run_dir, judge_checkpoint, prompts, f"constitution={constitution}",
                             f"judge.function=tests.feedback.rules:{critic}",
                             *(["rollout.n=1"] if what == "revise" else []), what=what))
    new = set(tmp_path.rglob("*")) - before
    assert {p for p in new if run_dir not in (p, *p.parents)} == {tmp_path / "a", tmp_path / "a" / "b"}
    used = summary["principles"] if what == "revise" else {p["principle"] for r in lines(run_dir / "judgements.jsonl")
                                                           for p in r["pairs"]}
    assert set(used) <= {"../../x", str(tmp_path / "abs"), ".."} and used


def test_an_interrupted_revise_run_resumes_to_the_uninterrupted_runs_files(tmp_path, judge_checkpoint, prompts):
    args = ["rollout.n=1", "revise.rounds=2", "judge.function=tests.feedback.rules:critic"]
    run_cai(recipe(tmp_path / "whole", judge_checkpoint, prompts, *args, what="revise"))
    run_cai(recipe(tmp_path / "cut", judge_checkpoint, prompts, *args, "data.max_prompts=4", what="revise"))
    run_cai(recipe(tmp_path / "cut", judge_checkpoint, prompts, *args, what="revise"))
    for name in ("trace.jsonl", "sft.jsonl", "summary.json"):
        whole, cut = (tmp_path / d / name for d in ("whole", "cut"))
        assert cut.read_text().replace(str(tmp_path / "cut"), "") == whole.read_text().replace(str(tmp_path / "whole"), "")


def test_an_empty_critique_asks_no_revision_and_keeps_the_response(tmp_path, judge_checkpoint, prompts):
    summary = run_cai(recipe(tmp_path / "rev", judge_checkpoint, prompts, "rollout.n=1",
                             "judge.function=tests.feedback.rules:mute", what="revise"))
    trace = lines(tmp_path / "rev" / "trace.jsonl")
    asked = [t for t in trace if t["response"].strip()]
    assert asked and all(t["rounds"][0]["skipped"] == "empty_critique" and t["rounds"][0]["revision"] is None
                         and t["final"] == t["response"] for t in asked)
    assert summary["skipped_rounds"]["empty_critique"] == len(asked) and summary["revised"] == 0


@pytest.mark.parametrize("overrides, message", [
    (["rollout.n=1"], "rollout.n must be at least 2"),
    (["rollout.shuffle=true"], "rollout.shuffle must be false"),
    (["judge.checkpoint=x"], "exactly one of judge.checkpoint"),
    (["judge.function=null"], "exactly one of judge.checkpoint"),
    (["judge.function=null", "judge.base_url=http://127.0.0.1:9/v1"], "needs judge.model"),
    (["judge.function=nomodule_xyz:f"], "cannot import 'nomodule_xyz'"),
    (["judge.function=nocolon"], "module:function"),
])
def test_a_bad_recipe_is_refused_before_any_work(tmp_path, judge_checkpoint, prompts, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_cai(recipe(tmp_path / "cai", judge_checkpoint, prompts, *overrides))
    assert not (tmp_path / "cai" / "judgements.jsonl").exists()


def test_revise_needs_one_response_per_prompt(tmp_path, judge_checkpoint, prompts):
    with pytest.raises(ConfigError, match="set rollout.n=1"):
        run_cai(recipe(tmp_path / "cai", judge_checkpoint, prompts, what="revise"))


def test_the_verb_and_its_demo_recipes_load():
    module = VERBS_BY_NAME["cai"].load()
    for what in ("label", "revise"):
        r = load_config(module.RECIPE, REPO / "recipes" / "demo" / f"cai_{what}.yaml", [f"what={what}"])
        assert r.judge.kind() == "checkpoint" and r.constitution.endswith("demo_tasks.yaml")


def test_the_command_line_reports_a_bad_constitution_as_one_error_line(tmp_path, judge_checkpoint, prompts, capsys):
    from lmforge.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nprinciples:\n  - {name: lone, critique: c, comparison: q}\n")
    code = main(["cai", "label", f"run_dir={tmp_path / 'cai'}", f"checkpoint={judge_checkpoint}",
                 f"data.prompts=[{prompts}]", f"constitution={bad}", "judge.function=tests.feedback.rules:shorter"])
    err = capsys.readouterr().err
    assert code == 2 and f"lmforge cai: error: {bad}: principle 0 ('lone'): missing its 'revision' request" in err
