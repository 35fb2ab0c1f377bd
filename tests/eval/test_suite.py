"""Suites: a group of task files scored together with the CORE aggregate (accuracies centred on
chance, averaged), and the bundled demo suite built from the demo's own held-out data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.core.io import InputError
from lmforge.data.documents import DocumentsConfig, read_documents, split_of
from lmforge.data.sft_demo import choice_example
from lmforge.eval.evaluate import EvalSettings
from lmforge.eval.scoring import load_checkpoint
from lmforge.eval.suite import evaluate_all, load_tasks, resolve_task_path
from tests.eval.conftest import write_tasks

SUITE = """\
group: tiny_suite
task: [tiny_mc.yaml, tiny_gen.yaml, tiny_rolling.yaml]
core:
  - {task: tiny_mc, metric: acc}
  - {task: tiny_gen, metric: exact_match, filter: raw}
"""


def test_core_is_the_mean_of_accuracies_centred_on_chance(tmp_path, tiny_checkpoint, corpus_texts):
    files = write_tasks(tmp_path, corpus_texts)
    (tmp_path / "suite.yaml").write_text(SUITE, encoding="utf-8")
    tasks, suites = load_tasks([str(tmp_path / "suite.yaml"), str(files["tiny_mc"])])  # a repeat is scored once
    assert [t.name for t in tasks] == ["tiny_mc", "tiny_gen", "tiny_rolling"]
    model, tok = load_checkpoint(str(tiny_checkpoint), device="cpu")
    results = {(r.task, r.metric, r.filter): r for r in
               evaluate_all(tasks, suites, model, tok, EvalSettings(bootstrap_iters=100))}
    acc, em = results["tiny_mc", "acc", "none"], results["tiny_gen", "exact_match", "raw"]
    centred_acc = (acc.value - 1 / 3) / (2 / 3)  # three choices each
    assert results["tiny_mc", "centered_acc", "none"].value == pytest.approx(centred_acc)
    assert results["tiny_gen", "centered_exact_match", "raw"].value == pytest.approx(em.value)  # chance 0
    core = results["tiny_suite", "core", "none"]
    assert core.value == pytest.approx((centred_acc + em.value) / 2) and core.n == 2
    assert core.stderr == pytest.approx(((acc.stderr / (2 / 3)) ** 2 + em.stderr ** 2) ** 0.5 / 2)
    assert ("tiny_rolling", "bits_per_byte", "none") in results  # reported, not aggregated


@pytest.mark.parametrize("text, message", [
    ("group: s\ntask: [tiny_mc.yaml]\ncores: []\n", r"suite\.yaml:3: unknown suite key 'cores'; did you mean 'core'"),
    ("group: s\ntask: [nope.yaml]\n", r"suite\.yaml:2: task: nope\.yaml: .* not found"),
    ("group: s\ntask: [tiny_mc.yaml]\ncore: [{task: tiny_gen, metric: exact_match}]\n",
     r"core: 'tiny_gen' is not a task of the suite \(its tasks: tiny_mc\)"),
    ("group: s\ntask: [tiny_mc.yaml]\ncore: [{task: tiny_mc, metric: acc, chance: 1}]\n", r"chance must be a number in \[0, 1\)"),
    ("group: ../s\ntask: [tiny_mc.yaml]\n", r"suite\.yaml:1: group = '\.\./s' contains a path separator"),
    ("group: s\ntask: [tiny_mc.yaml]\nx: &a [" + "x, " * 400 + "]\ny: &b [" + "*a, " * 400 + "]\n",
     r"suite\.yaml:4:\d+: aliases expand this document past"),
])
def test_a_bad_suite_names_the_file_line_and_key(tmp_path, corpus_texts, text, message):
    write_tasks(tmp_path, corpus_texts)
    (tmp_path / "suite.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match=message):
        load_tasks([str(tmp_path / "suite.yaml")])



def test_a_bundled_task_name_resolves_in_the_installed_repository_from_any_directory(tmp_path, monkeypatch):
    """Bare names are looked up in the repository lmforge is installed from, not under the current
    directory; a file of that path under the current directory still comes first."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    assert resolve_task_path("demo_suite") == root / "data/eval/demo_suite.yaml"
    assert resolve_task_path("bpb_milton") == root / "data/eval/heldout/bpb_milton.jsonl"
    tasks, (suite,) = load_tasks(["demo_suite"])
    assert {"demo_choices", "demo_answers", "bpb_milton"} <= {t.name for t in tasks}
    with pytest.raises(InputError, match=rf"demo_suit: no such task file, and no bundled task of that name in "
                                         rf"{root / 'data/eval'}; did you mean 'demo_suite'\?"):
        resolve_task_path("demo_suit")
    (tmp_path / "demo_suite").mkdir()  # the user's own folder of that name
    assert resolve_task_path("demo_suite") == Path("demo_suite")


def test_bundled_suite_loads_by_name_and_scores_only_held_out_text(monkeypatch):
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    assert resolve_task_path("demo_suite") == root / "data/eval/demo_suite.yaml"
    with pytest.raises(InputError, match="did you mean 'demo_suite'"):
        resolve_task_path("demo_suit")
    tasks, (suite,) = load_tasks(["demo_suite"])
    assert {t.name for t in tasks} >= {"bpb_shakespeare", "bpb_milton", "bpb_python_docs", "bpb_web", "demo_choices",
                                       "demo_answers"}
    assert [e.task for e in suite.core] == ["demo_choices", "demo_answers"]
    for domain in ("shakespeare", "milton", "python_docs"):  # prepare's validation split (val_fraction 0.05)
        source = {d.id: d.text for d in read_documents(DocumentsConfig(paths=[f"data/pretrain/{domain}.jsonl"]))}
        for line in Path(f"data/eval/heldout/bpb_{domain}.jsonl").read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            assert split_of(row["id"], 0.05) == "val" and source[row["id"]].startswith(row["text"])
            assert len(row["text"].encode("utf-8")) <= 4000
    val = [json.loads(line) for line in Path("data/sft/val.jsonl").read_text(encoding="utf-8").splitlines()]
    committed = [json.loads(line) for line in Path("data/eval/demo_choices.jsonl").read_text(encoding="utf-8").splitlines()]
    assert committed == [choice_example(ex) for ex in val]  # scripts/build_eval_suite.py's output, unchanged
