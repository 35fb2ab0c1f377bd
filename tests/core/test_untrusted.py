"""The readers of untrusted input: bounded YAML, names that become paths, sandboxed templates."""

import time

import jinja2.sandbox
import pytest

from lmforge.core.io import InputError, check_output_dir, check_output_file
from lmforge.core.untrusted import MAX_YAML_NODES, load_yaml, path_name, render_bounded, sandboxed_jinja

BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] + [
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]" for i in range(8)])


def test_nested_aliases_are_refused_quickly_naming_file_line_and_column():
    start = time.perf_counter()
    with pytest.raises(InputError, match=r"^t\.yaml:\d+:\d+: aliases expand this document past"):
        load_yaml(BOMB, "t.yaml")
    assert time.perf_counter() - start < 5  # composing 9 lines, never expanding 9**9 nodes


def test_a_few_aliases_are_kept_as_yaml_means_them():
    text = "base: &b {lr: 0.1, steps: 3}\nrun1: *b\nrun2: {<<: *b, steps: 4}\n"
    assert load_yaml(text, "r.yaml") == {"base": {"lr": 0.1, "steps": 3}, "run1": {"lr": 0.1, "steps": 3},
                                         "run2": {"lr": 0.1, "steps": 4}}


def test_the_bound_counts_expanded_nodes_not_file_size():
    text = "a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9]\nb: [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    assert load_yaml(text, "t.yaml", max_nodes=200)["b"][9] == list(range(1, 10))
    with pytest.raises(InputError, match="past 50 nodes"):
        load_yaml(text, "t.yaml", max_nodes=50)
    assert MAX_YAML_NODES >= 10_000  # a real recipe (hundreds of nodes) is far below it


def test_recursive_alias_is_refused():
    with pytest.raises(InputError, match="recursive alias"):
        load_yaml("a: &a [1, *a]\n", "t.yaml")


@pytest.mark.parametrize("text, message", [
    ("a: [1, 2\n", r"^t\.yaml:2:1: "),
    ("!!python/object/apply:os.system ['touch PWNED']\n", r"^t\.yaml:1:1: could not determine a constructor"),
])
def test_yaml_errors_are_one_line_with_file_line_column(text, message):
    with pytest.raises(InputError, match=message) as info:
        load_yaml(text, "t.yaml")
    assert "\n" not in str(info.value)


def test_invalid_utf8_names_the_file():
    with pytest.raises(InputError, match=r"^t\.yaml: not valid UTF-8"):
        load_yaml(b"a: \xff\n", "t.yaml")


@pytest.mark.parametrize("name", ["../../../ESCAPED", "/etc/passwd", "a/b", "a\\b", "..", ".", "", "  ",
                                  "a\x00b", "x" * 201, 3, None])
def test_path_name_refuses_what_is_not_a_plain_name(name):
    with pytest.raises(InputError, match=r"^stages\[0\]\.name"):
        path_name(name, "stages[0].name")


@pytest.mark.parametrize("name", ["sft", "grpo-round.2", "d_512", "ünïcode"])
def test_path_name_keeps_plain_names(name):
    assert path_name(name, "k") == name


@pytest.mark.parametrize("payload", [
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ question.__class__.__base__.__subclasses__() }}",
    "{% set x = doc.update({'a': 1}) %}{{ x }}",
])
def test_sandboxed_jinja_refuses_the_known_escapes(payload, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(jinja2.sandbox.SecurityError):
        sandboxed_jinja().from_string(payload).render(question="q", doc={})
    assert not (tmp_path / "PWNED").exists()


def test_output_checks_refuse_unwritable_places_before_any_work(tmp_path):
    existing = tmp_path / "f.txt"
    existing.write_text("x")
    with pytest.raises(InputError, match="exists and is not a folder"):
        check_output_dir(existing, "run_dir")
    with pytest.raises(InputError, match="is a file, so no folder"):
        check_output_dir(existing / "sub", "run_dir")
    with pytest.raises(InputError, match="cannot write in /proc"):
        check_output_file("/proc/x", "--out")
    with pytest.raises(InputError, match="is a folder"):
        check_output_file(tmp_path, "--out")
    assert check_output_dir(tmp_path / "new" / "dir", "run_dir") == tmp_path / "new" / "dir"
    assert not (tmp_path / "new").exists()  # the check leaves nothing behind
    assert list(tmp_path.iterdir()) == [existing]


def test_the_size_error_points_at_the_first_alias():
    with pytest.raises(InputError, match=r"^t\.yaml:2:8: aliases expand") as info:
        load_yaml(BOMB, "t.yaml")  # line 1 holds the anchor &a; line 2 its first alias *a, column 8
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("payload", [
    "{{ 'a' * 10**10 }}",
    "{{ [1] * 100000000 }}",
    "{{ 9 ** (9 ** 9) }}",  # Jinja reads 9**9**9 as (9**9)**9, 77 digits: harmless
    "{{ 2 ** 100000 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
])
def test_templates_that_would_exhaust_memory_or_time_are_stopped(payload):
    start = time.perf_counter()
    with pytest.raises(jinja2.sandbox.SecurityError):
        render_bounded(sandboxed_jinja().from_string(payload), {})
    assert time.perf_counter() - start < 5  # stopped at a million characters, not after 10**10


def test_bounded_templates_still_do_ordinary_arithmetic_and_repetition():
    out = render_bounded(sandboxed_jinja().from_string("{{ '-' * 3 }}{{ 2 ** 10 }}{{ q }}{{ 1.5 ** 2 }}"), {"q": "?"})
    assert out == "---1024?2.25"


def test_a_control_character_is_one_line_with_its_line_and_column():
    with pytest.raises(InputError, match=r"^t\.yaml:2:4: character '\\x1b' is not allowed in YAML"):
        load_yaml("a: 1\nb: \x1b\n", "t.yaml")
