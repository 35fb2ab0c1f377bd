"""Task files: the harness's readings of doc_to_* and its prompts, and bad input named by file,
key and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.core.io import InputError
from lmforge.eval.evaluate import metric_specs
from lmforge.eval.tasks import FewshotSampler, fewshot_context, load_task
from tests.eval.conftest import MC_YAML, write_jsonl


def mc_task(tmp_path: Path, yaml_text: str = MC_YAML):
    rows = [{"word": w, "choices": [w, "b", "c"], "label": i % 3} for i, w in enumerate("pqrstuvw")]
    write_jsonl(tmp_path / "mc_train.jsonl", rows[:4])
    write_jsonl(tmp_path / "mc_test.jsonl", rows[4:])
    path = tmp_path / "task.yaml"
    path.write_text(yaml_text, encoding="utf-8")
    return path


def test_a_fewshot_prompt_is_text_delimiter_target_then_the_document(tmp_path):
    task = load_task(mc_task(tmp_path))
    pool = task.fewshot_pool()
    doc = task.splits["test"][0]
    prompt = fewshot_context(task, doc, 2, FewshotSampler(pool, 1234))
    shots = FewshotSampler(pool, 1234).sample(2)
    expected = "".join(f"Question: which word is {s['word']}?\nAnswer: {s['choices'][s['label']]}\n\n" for s in shots)
    assert prompt == expected + f"Question: which word is {doc['word']}?\nAnswer:"


def test_data_files_are_read_relative_to_the_task_file(tmp_path, monkeypatch):
    path = mc_task(tmp_path)
    monkeypatch.chdir(Path(path.anchor))
    assert len(load_task(path).splits["test"]) == 4


def test_a_missing_data_file_is_named(tmp_path):
    path = mc_task(tmp_path)
    (tmp_path / "mc_test.jsonl").unlink()
    with pytest.raises(InputError, match=r"task\.yaml: dataset_kwargs\.data_files: .*mc_test\.jsonl not found"):
        load_task(path)


def test_a_document_missing_a_template_field_names_the_file_line_and_key(tmp_path):
    path = mc_task(tmp_path)
    with open(tmp_path / "mc_test.jsonl", "a") as f:
        f.write('{"choices": ["x", "y"], "label": 0}\n')
    task = load_task(path)
    doc = task.splits["test"][-1]
    with pytest.raises(InputError, match=r"task\.yaml:\d+: doc_to_text: .*mc_test\.jsonl:5: 'word' is undefined"):
        fewshot_context(task, doc, 0, None)


@pytest.mark.parametrize("edit,message", [
    (("output_type: multiple_choice", "output_type: ranking"), r"task\.yaml:9: output_type: unknown 'ranking'"),
    (("  - metric: acc_bytes", "  - metric: bleu"), r"task\.yaml:\d+: metric_list: unknown metric 'bleu'"),
    (("num_fewshot: 2", "num_fewshots: 2"), r"task\.yaml:13: unknown key 'num_fewshots'; did you mean 'num_fewshot'"),
    (("num_fewshot: 2", "process_docs: !function utils.process"), r"task\.yaml:13:\d+: '!function utils.process' runs Python"),
    (("num_fewshot: 2", "num_fewshot: [2"), r"task\.yaml:\d+:\d+: "),
    (("num_fewshot: 2", "gen_prefix: 'A:'"), r"task\.yaml:13: gen_prefix = 'A:': in lm-evaluation-harness it writes "
                                             r"text after the prompt .* lmforge eval does not do; remove the key or set it to None"),
    (("num_fewshot: 2", "should_decontaminate: true"), r"task\.yaml:13: should_decontaminate = True: .* checks test "
                                                       r"documents for overlap"),
    (("num_fewshot: 2", "include: base.yaml"), r"task\.yaml:13: include = 'base.yaml': .* reads another task file .*"
                                               r"remove the key$"),
    (("test_split: test", "test_split: dev"), r"task\.yaml:\d+: test_split: split 'dev' is not in the data files"),
])
def test_bad_task_files_are_named_with_key_and_line(tmp_path, edit, message):
    path = mc_task(tmp_path, MC_YAML.replace(*edit))
    with pytest.raises(InputError, match=message):
        metric_specs(load_task(path))


@pytest.mark.parametrize("lines", [
    "should_decontaminate: false\ndoc_to_decontamination_query: null\nunsafe_code: false",
    "process_docs: null\nprocess_results: null\nuse_prompt: null\nfewshot_config: null",
    "gen_prefix: ''\ndoc_to_image: null\ndoc_to_audio: null\ncustom_dataset: null",
])
def test_harness_keys_set_to_values_that_change_nothing_run_unchanged(tmp_path, lines):
    (tmp_path / "plain").mkdir()
    (tmp_path / "harness").mkdir()
    plain = load_task(mc_task(tmp_path / "plain"))
    task = load_task(mc_task(tmp_path / "harness", MC_YAML + lines + "\n"))
    assert [task.doc_to_text(d) for d in task.splits["test"]] == [plain.doc_to_text(d) for d in plain.splits["test"]]
    assert [task.doc_to_target(d) for d in task.splits["test"]] == [plain.doc_to_target(d) for d in plain.splits["test"]]


def test_doc_to_target_readings_follow_the_harness(tmp_path):
    task = load_task(mc_task(tmp_path))
    doc = task.splits["test"][0]
    assert task.doc_to_target(doc) == doc["label"]  # a field: its value
    task.config["doc_to_target"] = "{{ label }}"
    assert task.doc_to_target(doc) == doc["label"]  # a template giving digits, with choices: an index
    task.config["doc_to_target"] = "{{ choices }}"
    assert task.doc_to_target(doc) == doc["choices"]  # a template giving a list literal: the list
    task.config["doc_to_target"] = 1
    assert task.doc_to_target(doc) == 1


def test_a_raw_text_file_is_a_rolling_task(tmp_path):
    (tmp_path / "notes.txt").write_text("Some plain text to score.\n", encoding="utf-8")
    task = load_task(tmp_path / "notes.txt")
    assert task.output_type == "loglikelihood_rolling" and task.splits["train"] == [{"text": "Some plain text to score.\n"}]


def test_fewshot_override_and_limit_follow_simple_evaluate(tmp_path):
    from lmforge.eval.tasks import effective_fewshot, limited

    task = load_task(mc_task(tmp_path))
    assert effective_fewshot(task, None) == 2 and effective_fewshot(task, 1) == 1
    task.config["num_fewshot"] = 0
    assert effective_fewshot(task, 3) == 0  # a task that fixes 0 keeps it
    docs = list(range(10))
    assert limited(docs, 3) == [0, 1, 2] and limited(docs, 0.25) == [0, 1, 2] and limited(docs, None) == docs


def test_a_prepared_split_is_a_rolling_task_over_its_stored_documents(tmp_path, small_tokenizer_dir, corpus_texts):
    from lmforge.data.documents import DocumentsConfig, split_of
    from lmforge.eval.suite import resolve_task_path
    from lmforge.stages.prepare import PrepareRecipe, run_prepare
    from tests.conftest import write_jsonl as write_rows

    rows = [{"id": f"doc{i}", "text": t} for i, t in enumerate(corpus_texts)]
    source = write_rows(tmp_path / "corpus.jsonl", rows)
    out = tmp_path / "prepared"
    run_prepare(PrepareRecipe(run_dir=str(out), tokenizer=str(small_tokenizer_dir), val_fraction=0.3,
                              data=DocumentsConfig(paths=[str(source)])))
    val = load_task(resolve_task_path(str(out)))  # the directory: its validation split
    train = load_task(resolve_task_path(f"{out}@train"))
    expected_val = [r["text"] for r in rows if split_of(r["id"], 0.3) == "val"]
    assert val.output_type == "loglikelihood_rolling" and expected_val
    assert sorted(d["text"] for d in val.splits["val"]) == sorted(expected_val)  # the stored text, exactly
    assert len(train.splits["train"]) == len(rows) - len(expected_val)
    with pytest.raises(InputError, match="no split 'test'"):
        load_task(f"{out}@test")
