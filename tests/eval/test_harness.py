"""The harness adapter: lm_eval.simple_evaluate on lmforge's model class gives, task by task and
metric by metric, the numbers `lmforge eval` gives on the same task files (and the same stderrs)."""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["DISABLE_MULTIPROC"] = "1"  # the harness's bootstrap in this process (its draws are the same either way)

lm_eval = pytest.importorskip("lm_eval")
datasets = pytest.importorskip("datasets")

from lm_eval.tasks import TaskManager  # noqa: E402

from lmforge.eval.evaluate import EvalSettings, evaluate_task  # noqa: E402
from lmforge.eval.harness import LMForgeLM  # noqa: E402
from lmforge.eval.scoring import load_checkpoint  # noqa: E402
from lmforge.eval.tasks import load_task  # noqa: E402
from tests.eval.conftest import GEN_YAML, model_answers, write_tasks  # noqa: E402

BOOTSTRAP = 200
VOTE_YAML = """\
task: tiny_vote
dataset_path: json
dataset_kwargs:
  data_files: gen.jsonl
test_split: train
output_type: generate_until
doc_to_text: "Q: {{ q }}\\nA:"
doc_to_target: "{{ a }}"
repeats: 3
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: true
  temperature: 1.0
filter_list:
  - name: vote
    filter:
      - function: lowercase
      - function: majority_vote
      - function: take_first
  - name: first
    filter:
      - function: take_first
"""


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory, tiny_checkpoint, corpus_texts):
    root = tmp_path_factory.mktemp("harness-tasks")
    model, tok = load_checkpoint(str(tiny_checkpoint), "cpu")
    files = write_tasks(root, corpus_texts, model_answers(model, tok))
    files["tiny_num"] = root / "tiny_num.yaml"  # lmforge's numeric_match, registered in the harness by the adapter
    files["tiny_num"].write_text(GEN_YAML.replace("task: tiny_gen", "task: tiny_num").replace(
        "metric: exact_match", "metric: numeric_match").replace("    ignore_case: true\n    ignore_punctuation: true\n",
                                                                "    rel_tol: 0.01\n"), encoding="utf-8")
    files["tiny_vote"] = root / "tiny_vote.yaml"  # sampled, 3 repeats, majority vote: seeds and filters agree
    files["tiny_vote"].write_text(VOTE_YAML, encoding="utf-8")
    cache = tmp_path_factory.mktemp("hf-datasets")
    old_cache, datasets.config.HF_DATASETS_CACHE = datasets.config.HF_DATASETS_CACHE, cache
    old_cwd = os.getcwd()
    os.chdir(root)  # the harness reads data_files relative to the working directory, lmforge to the YAML
    try:
        lm = LMForgeLM(checkpoint=str(tiny_checkpoint), device="cpu", batch_size=4)
        out = lm_eval.simple_evaluate(model=lm, tasks=list(files), task_manager=TaskManager(include_path=str(root)),
                                      bootstrap_iters=BOOTSTRAP, limit=None)
    finally:
        os.chdir(old_cwd)
        datasets.config.HF_DATASETS_CACHE = old_cache
    return files, out["results"], lm


def ours(files, lm, name):
    settings = EvalSettings(bootstrap_iters=BOOTSTRAP, batch_size=3)
    return evaluate_task(load_task(files[name]), lm.model, lm.tok, settings)


@pytest.mark.parametrize("name", ["tiny_mc", "tiny_ll", "tiny_rolling", "tiny_gen", "tiny_num", "tiny_vote"])
def test_lmforge_eval_gives_the_harness_numbers_on_each_task_kind(harness_run, name):
    files, harness, lm = harness_run
    results = ours(files, lm, name)
    assert results
    for r in results:
        theirs = harness[name][f"{r.metric},{r.filter}"]
        assert r.value == pytest.approx(theirs, rel=1e-5, abs=1e-6), (name, r.metric, r.filter)
        their_err = harness[name][f"{r.metric}_stderr,{r.filter}"]
        if their_err == "N/A":
            assert r.stderr is None, (name, r.metric)
        else:
            assert r.stderr == pytest.approx(their_err, rel=1e-5, abs=1e-9), (name, r.metric)


def test_the_tasks_have_figures_that_differ_from_trivial_ones(harness_run):
    files, harness, lm = harness_run
    assert math.isfinite(harness["tiny_rolling"]["bits_per_byte,none"]) and harness["tiny_rolling"]["bits_per_byte,none"] > 0
    assert 0.0 <= harness["tiny_mc"]["acc,none"] <= 1.0
    assert harness["tiny_gen"]["exact_match,raw"] == 0.5  # the model's own answers to half the questions
    assert set(harness["tiny_gen"]) >= {"exact_match,raw", "exact_match,first-word"}
    assert {r.metric for r in ours(files, lm, "tiny_ll")} == {"perplexity", "acc"}
