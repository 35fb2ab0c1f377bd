"""Task files as hostile input: templates that try to reach Python, YAML that explodes, names
that escape, and values of the wrong type or range, each refused in one line naming the file,
the key and (for a template) the document; the bundled tasks render as they always did."""

from __future__ import annotations

import time
from pathlib import Path

import jinja2
import pytest

from lmforge.core.io import InputError
from lmforge.eval import tasks as tasks_module
from lmforge.eval.suite import BUNDLED, is_suite, load_tasks
from lmforge.eval.tasks import fewshot_context, load_task
from tests.conftest import REPO
from tests.eval.conftest import MC_YAML
from tests.eval.test_tasks import mc_task

# Known ways out of a Jinja template into Python: through a global's function globals (cycler,
# joiner, namespace, lipsum), the class hierarchy, the template's own context, attr and format
# (which reach attributes by name), and mutation of an object the template made.
PAYLOADS = [
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ lipsum.__globals__['os'].popen('touch PWNED').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ namespace.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ ((cycler|attr('__init__'))|attr('__globals__')).os.system('touch PWNED') }}",
    "{{ '{0.__class__.__mro__}'.format(word) }}",
    "{% set d = {} %}{{ d.update({'a': 1}) }}",
]
# every templated field of a task, each with a template that renders a valid value around the payload
FIELDS = {
    "doc_to_text": "{payload}Question: {{{{ word }}}}",
    "doc_to_target": "{payload}{{{{ label }}}}",
    "doc_to_choice": "{payload}{{{{ choices }}}}",
    "description": "{payload}Answer these.\\n",
}


def render_every_field(task) -> list:
    """What the task's templates give for every document of every split: prompt, target, choices."""
    out = []
    for docs in task.splits.values():
        for doc in docs:
            out.append((fewshot_context(task, doc, 0, None), task.doc_to_target(doc),
                        task.doc_to_choice(doc) if task.config.get("doc_to_choice") is not None else None))
    return out


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_template_reaching_python_is_refused_naming_file_field_and_document(tmp_path, monkeypatch, field, payload):
    monkeypatch.chdir(tmp_path)
    template = FIELDS[field].format(payload=payload).replace('"', '\\"')
    lines = [line for line in MC_YAML.splitlines() if not line.startswith(f"{field}:")]
    lines.append(f'{field}: "{template}"')
    task = load_task(mc_task(tmp_path, "\n".join(lines) + "\n"))
    refused = r"(the template .* is refused: .*(unsafe|not safely callable)|has no attribute '__\w+__')"  # attr's
    with pytest.raises(InputError, match=rf"task\.yaml:{len(lines)}: {field}: .*mc_\w+\.jsonl:1: .*{refused}") as caught:
        render_every_field(task)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "PWNED").exists()


OLD_JINJA = jinja2.Environment(loader=jinja2.BaseLoader(), undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
OLD_JINJA.filters["regex_replace"] = tasks_module._regex_replace


def test_every_bundled_task_renders_every_document_as_without_the_sandbox(monkeypatch):
    monkeypatch.chdir(REPO)
    files = sorted(p for p in BUNDLED.glob("*.yaml") if not is_suite(p))
    assert len(files) >= 2
    sandboxed = [render_every_field(task) for task in load_tasks(list(map(str, files)))[0]]
    monkeypatch.setattr(tasks_module, "JINJA", OLD_JINJA)
    plain = [render_every_field(task) for task in load_tasks(list(map(str, files)))[0]]
    assert sandboxed == plain and all(len(rendered) > 10 for rendered in plain)


BOMB = "".join(f"  {c}: &{c} [{', '.join([f'*{p}'] * 9 if p else ['x'] * 9)}]\n"
               for p, c in zip(["", *"abcdefgh"], "abcdefghi"))


def test_a_yaml_alias_bomb_in_metadata_is_refused_fast_naming_its_line(tmp_path):
    path = mc_task(tmp_path, MC_YAML + "metadata:\n" + BOMB)
    first_alias = len(MC_YAML.splitlines()) + 3  # the line after &a's: the bomb's first alias, *a
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=rf"task\.yaml:{first_alias}:\d+: aliases expand this document past"):
        load_task(path)
    assert time.perf_counter() - t0 < 2.0


def test_a_function_tag_is_still_refused_with_its_line(tmp_path):
    path = mc_task(tmp_path, MC_YAML + "metadata: !function utils.process\n")
    with pytest.raises(InputError, match=rf"task\.yaml:{len(MC_YAML.splitlines()) + 1}:11: '!function utils.process' "
                                         "runs Python code"):
        load_task(path)


@pytest.mark.parametrize("name", ["../../ESCAPED", "a/b", "..", "/abs", ""])
def test_a_task_name_that_is_not_a_plain_name_is_refused(tmp_path, name):
    path = mc_task(tmp_path, MC_YAML.replace("task: tiny_mc", f"task: {name!r}"))
    with pytest.raises(InputError, match=r"task\.yaml:1: task = .* must be a plain name"):
        load_task(path)


@pytest.mark.parametrize("line,message", [
    ("repeats: 0", r"repeats: must be an integer >= 1"),
    ("repeats: two", r"repeats: must be an integer >= 1"),
    ("num_fewshot: -3", r"num_fewshot: must be an integer >= 0"),
    ("generation_kwargs: {until: 5}", r"generation_kwargs\.until must be a stop string or a list"),
    ("generation_kwargs: {until: ['', x]}", r"generation_kwargs\.until: a stop string must not be empty"),
    ("generation_kwargs: [until]", r"generation_kwargs must be a mapping"),
    ("generation_kwargs: {temperature: -1, do_sample: true}", r"generation_kwargs\.temperature must be a number >= 0"),
    ("generation_kwargs: {temperature: hot}", r"generation_kwargs\.temperature must be a number >= 0"),
    ("generation_kwargs: {top_p: 0}", r"generation_kwargs\.top_p must be a number in \(0, 1\]"),
    ("generation_kwargs: {top_p: 1.5}", r"generation_kwargs\.top_p must be a number in \(0, 1\]"),
    ("generation_kwargs: {top_k: -1}", r"generation_kwargs\.top_k must be an integer >= 0"),
    ("generation_kwargs: {max_gen_toks: 0}", r"generation_kwargs\.max_gen_toks must be an integer >= 1"),
    ("generation_kwargs: {do_sample: 'yes'}", r"generation_kwargs\.do_sample must be true or false"),
    ("description: [a]", r"description: must be a string"),
    ("target_delimiter: 5", r"target_delimiter: must be a string"),
    ("fewshot_split: [train]", r"fewshot_split: must be a string"),
])
def test_a_value_of_the_wrong_type_or_range_is_named_with_file_line_and_key(tmp_path, line, message):
    key = line.split(":")[0]
    text = "".join(f"{x}\n" for x in MC_YAML.splitlines() if not x.startswith(f"{key}:")) + line + "\n"
    with pytest.raises(InputError, match=rf"task\.yaml:{len(text.splitlines())}: {message}"):
        load_task(mc_task(tmp_path, text))


@pytest.mark.parametrize("entry,message", [
    ("filter_list: [{name: f, filter: [{function: take_first_k}]}]", r"f: take_first_k needs k"),
    ("filter_list: [{name: f, filter: [{function: regex, regex_pattern: '(('}, {function: take_first}]}]",
     r"f: regex: regex_pattern must be a regular expression"),
    ("filter_list: [{name: f, filter: [{function: regex, group_select: a}, {function: take_first}]}]",
     r"f: regex: group_select must be an integer"),
    ("filter_list: [{name: f, filter: [{function: [take_first]}]}]", r"f: unknown filter function \['take_first'\]"),
    ("filter_list: [{name: [f], filter: [{function: take_first}]}]", r"each entry needs a name \(a string\)"),
    ("metric_list: [{metric: exact_match, aggregation: [mean]}]", r"exact_match: unknown aggregation \['mean'\]"),
    ("metric_list: [{metric: numeric_match, rel_tol: x}]", r"numeric_match: rel_tol must be a number >= 0"),
    ("metric_list: [{metric: exact_match, regexes_to_ignore: ['((']}]",
     r"exact_match: regexes_to_ignore must be a list of regular expressions"),
    ("metric_list: [{metric: exact_match, ignore_case: 1}]", r"exact_match: ignore_case must be true or false"),
    ("metric_list: [{metric: exact_match, higher_is_better: 'yes'}]", r"exact_match: higher_is_better must be"),
])
def test_a_bad_metric_or_filter_option_stops_the_run_before_any_task_is_scored(tmp_path, entry, message):
    (tmp_path / "gen.jsonl").write_text('{"q": "a", "a": "b"}\n', encoding="utf-8")
    path = tmp_path / "gen.yaml"
    path.write_text("task: gen\ndataset_path: json\ndataset_kwargs: {data_files: gen.jsonl}\ntest_split: train\n"
                    f"doc_to_text: '{{{{ q }}}}'\ndoc_to_target: a\n{entry}\n", encoding="utf-8")
    with pytest.raises(InputError, match=rf"gen\.yaml:7: {entry.split(':')[0]}: {message}"):
        load_tasks([str(path)])  # what `lmforge eval` checks before it loads the model


def test_a_raw_file_with_invalid_utf8_is_named_without_a_key_eval_does_not_have(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_bytes(b'{"text": "fine"}\n\xff\xfe\n')
    with pytest.raises(InputError, match=r"notes\.jsonl:2: invalid UTF-8.*fix or remove them") as caught:
        load_task(path)
    assert "skip_bad_records" not in str(caught.value)


def test_a_json_data_file_that_is_not_utf8_or_not_json_is_named(tmp_path):
    path = mc_task(tmp_path, MC_YAML.replace("mc_test.jsonl", "mc_test.json"))
    data = tmp_path / "mc_test.json"
    data.write_bytes(b'[{"word": "\xff"}]')
    with pytest.raises(InputError, match=r"mc_test\.json: not valid UTF-8"):
        load_task(path)
    data.write_text('[{"word": "a",}]', encoding="utf-8")
    with pytest.raises(InputError, match=r"mc_test\.json:1:15: not valid JSON"):
        load_task(Path(path))


@pytest.mark.parametrize("target,shown", [("n", "5"), ("a", "'b'"), ("'{{ s }}'", "'²'")])
def test_a_target_that_is_not_an_index_into_the_choices_is_named(tmp_path, tiny_checkpoint, target, shown):
    from lmforge.eval.evaluate import EvalSettings, evaluate_task
    from lmforge.eval.scoring import load_checkpoint

    (tmp_path / "gen.jsonl").write_text('{"q": "a", "a": "b", "n": 5, "c": ["x", "y"], "s": "\\u00b2"}\n',
                                        encoding="utf-8")
    path = tmp_path / "gen.yaml"
    path.write_text("task: gen\ndataset_path: json\ndataset_kwargs: {data_files: gen.jsonl}\ntest_split: train\n"
                    f"doc_to_text: '{{{{ q }}}}'\ndoc_to_choice: c\ndoc_to_target: {target}\n"
                    "generation_kwargs: {until: ['\\n'], max_gen_toks: 2}\n", encoding="utf-8")
    model, tok = load_checkpoint(str(tiny_checkpoint), "cpu")
    with pytest.raises(InputError, match=rf"gen\.yaml:7: doc_to_target: .*gen\.jsonl:1: with doc_to_choice the target "
                                         rf"is the index of the answer among 2 choices, got {shown}"):
        evaluate_task(load_task(path), model, tok, EvalSettings(bootstrap_iters=0))


def test_a_description_field_that_is_not_text_is_named(tmp_path):
    task = load_task(mc_task(tmp_path, MC_YAML + "description: label\n"))
    with pytest.raises(InputError, match=r"task\.yaml:\d+: description: .*mc_test\.jsonl:1: the field 'label' gives 1, not text"):
        fewshot_context(task, task.splits["test"][0], 0, None)
