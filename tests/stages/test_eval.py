"""`lmforge eval`: task files and raw text in, results.json and results.md out."""

from __future__ import annotations

import json

import pytest

from lmforge.cli.main import main
from tests.eval.conftest import write_jsonl, write_tasks, write_tiny_checkpoint

SAMPLED_YAML = """\
task: tiny_sampled
dataset_path: json
dataset_kwargs:
  data_files: sampled.jsonl
test_split: train
output_type: generate_until
doc_to_text: "{{ q }}"
doc_to_target: "{{ a }}"
repeats: 4
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 3
  do_sample: true
  temperature: 1.0
metric_list:
  - metric: pass_at_k
    k: [1, 4]
  - metric: numeric_match
    rel_tol: 0.0
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, small_tokenizer_dir):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("eval-ckpt"), small_tokenizer_dir)


def test_eval_writes_results_for_every_task_metric_and_filter(tmp_path, tiny_checkpoint, corpus_texts, capsys):
    files = write_tasks(tmp_path / "tasks", corpus_texts)
    raw = tmp_path / "docs.jsonl"
    write_jsonl(raw, [{"text": t[:300]} for t in corpus_texts[:3]])
    (tmp_path / "notes.txt").write_text(corpus_texts[5][:500], encoding="utf-8")
    out = tmp_path / "out"
    code = main(["eval", str(tiny_checkpoint), "--tasks", *map(str, files.values()), str(raw), str(tmp_path / "notes.txt"),
                 "--limit", "5", "--out", str(out), "device=cpu", "bootstrap_iters=100"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())["results"]
    got = {(r["task"], r["metric"], r["filter"]) for r in results}
    assert ("tiny_mc", "acc_norm", "none") in got and ("tiny_gen", "exact_match", "first-word") in got
    assert ("docs", "bits_per_byte", "none") in got and ("notes", "byte_perplexity", "none") in got
    for r in results:
        assert set(r) >= {"metric", "value", "stderr", "n", "config_hash", "higher_is_better"}
        assert r["n"] == (3 if r["task"] == "docs" else 1 if r["task"] == "notes" else 4 if r["task"] == "tiny_rolling" else 5)
    assert len({r["config_hash"] for r in results}) == 6  # one per task
    table = (out / "results.md").read_text()
    assert "| tiny_mc | acc ↑ | none | 2 |" in table and table in capsys.readouterr().out


def test_sampled_generation_is_seeded_and_gives_pass_at_k(tmp_path, tiny_checkpoint):
    task = tmp_path / "sampled.yaml"
    task.write_text(SAMPLED_YAML, encoding="utf-8")
    write_jsonl(tmp_path / "sampled.jsonl", [{"q": f"Count: {i}", "a": str(i + 1)} for i in range(6)])
    runs = []
    for seed in (1, 1, 2):
        out = tmp_path / f"out{len(runs)}"
        assert main(["eval", str(tiny_checkpoint), "--out", str(out), "--tasks", str(task), f"seed={seed}", "device=cpu"]) == 0
        runs.append({r["metric"]: r["value"] for r in json.loads((out / "results.json").read_text())["results"]})
    assert runs[0] == runs[1]
    assert set(runs[0]) == {"pass@1", "pass@4", "numeric_match", "exact_match"}
    assert runs[0]["pass@1"] <= runs[0]["pass@4"]


def test_bad_task_is_one_line_naming_the_file(tmp_path, tiny_checkpoint, capsys):
    task = tmp_path / "bad.yaml"
    task.write_text("task: bad\noutput_type: ranking\n", encoding="utf-8")
    assert main(["eval", str(tiny_checkpoint), "--tasks", str(task)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml:2: output_type: unknown 'ranking'" in err and len(err.strip().splitlines()) == 1


HOSTILE_YAML = """\
task: hostile
dataset_path: json
dataset_kwargs:
  data_files: docs.jsonl
test_split: train
doc_to_text: "{{ q }}"
doc_to_target: a
generation_kwargs: {until: ["\\n"], max_gen_toks: 3}
"""


def hostile_task(tmp_path, line: str):
    (tmp_path / "docs.jsonl").write_text('{"q": "1 + 1 =", "a": "2"}\n', encoding="utf-8")
    key = line.split(":")[0]
    text = "".join(f"{x}\n" for x in HOSTILE_YAML.splitlines() if not x.startswith(f"{key}:")) + line + "\n"
    (tmp_path / "t.yaml").write_text(text, encoding="utf-8")
    return tmp_path / "t.yaml", len(text.splitlines())


@pytest.mark.parametrize("line", [
    "doc_to_text: \"{{ cycler.__init__.__globals__.os.system('touch PWNED') }}{{ q }}\"",
    "description: \"{{ lipsum.__globals__['os'].popen('touch PWNED').read() }}\"",
])
def test_a_task_template_that_runs_a_command_is_refused_and_runs_nothing(tmp_path, tiny_checkpoint, monkeypatch,
                                                                         capsys, line):
    monkeypatch.chdir(tmp_path)
    task, lineno = hostile_task(tmp_path, line)
    assert main(["eval", str(tiny_checkpoint), "--tasks", str(task), "device=cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"t.yaml:{lineno}: {line.split(':')[0]}: " in err and "docs.jsonl:1: the template" in err and "refused" in err
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("args,message", [
    (["--num-fewshot", "-5"], "--num-fewshot must be 0 or more"),
    (["--limit", "0"], "--limit must be positive"),
])
def test_a_negative_flag_is_refused_naming_it(tmp_path, tiny_checkpoint, capsys, args, message):
    task, _ = hostile_task(tmp_path, "num_fewshot: 0")
    assert main(["eval", str(tiny_checkpoint), "--tasks", str(task), *args, "device=cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_negative_temperature_with_sampling_is_refused_not_decoded_greedily(tmp_path, tiny_checkpoint, capsys):
    task, lineno = hostile_task(tmp_path, "generation_kwargs: {temperature: -1, do_sample: true, max_gen_toks: 3}")
    assert main(["eval", str(tiny_checkpoint), "--tasks", str(task), "device=cpu"]) == 2
    assert f"t.yaml:{lineno}: generation_kwargs.temperature must be a number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("out", ["existing-file", "/proc/lmforge-eval-out"])
def test_an_out_that_cannot_take_the_results_is_refused_before_any_task_is_scored(tmp_path, tiny_checkpoint, capsys,
                                                                                 monkeypatch, out):
    import lmforge.stages.eval as stage

    scored = []
    monkeypatch.setattr(stage, "evaluate_all", lambda *a, **k: scored.append(a) or [])
    (tmp_path / "existing-file").write_text("not a folder\n", encoding="utf-8")
    task, _ = hostile_task(tmp_path, "num_fewshot: 0")
    out = out if out.startswith("/") else str(tmp_path / out)
    assert main(["eval", str(tiny_checkpoint), "--tasks", str(task), "--out", out, "device=cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"run_dir (--out) = {out}: " in err and len(err.splitlines()) == 1
    assert scored == [] and (tmp_path / "existing-file").read_text() == "not a folder\n"
