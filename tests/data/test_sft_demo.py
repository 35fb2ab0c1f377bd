"""Demo SFT tasks: exact answers, determinism, a leak-free split, exact match."""

from __future__ import annotations

import ast
import json
import re

import pytest

from lmforge.data.chat import tokenize_example
from lmforge.data.sft_demo import TASKS, exact_match, make_examples, split_examples, write_demo


def test_same_seed_same_examples_and_other_seed_differs():
    assert make_examples(50, seed=1) == make_examples(50, seed=1)
    assert make_examples(50, seed=1) != make_examples(50, seed=2)


def test_examples_cycle_tasks_and_are_distinct_chatml_conversations():
    examples = make_examples(100, seed=0)
    assert [e["task"] for e in examples[:5]] == list(TASKS)
    questions = [e["messages"][1]["content"] for e in examples]
    assert len(set(questions)) == 100
    for e in examples:
        assert [m["role"] for m in e["messages"]] == ["system", "user", "assistant"]
        assert e["messages"][2]["content"] == e["answer"]


def check_answer(question: str, answer: str) -> None:
    if m := re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", question):
        a, op, b = int(m[1]), m[2], int(m[3])
        assert int(answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
    elif m := re.fullmatch(r"How many times does the letter '(\w)' appear in '(\w+)'\?", question):
        assert int(answer) == m[2].count(m[1])
    elif m := re.fullmatch(r"Reverse the string '(\w+)'\.", question):
        assert answer == "".join(reversed(m[1]))
    elif m := re.fullmatch(r"Sort in ascending order: ([\d, ]+)\.", question):
        assert ast.literal_eval(f"[{answer}]") == sorted(ast.literal_eval(f"[{m[1]}]"))
    elif m := re.fullmatch(r"How many (\w+) are in (\d+) (\w+)\?", question):
        factors = {("metres", "kilometres"): 1000, ("centimetres", "metres"): 100, ("grams", "kilograms"): 1000,
                   ("minutes", "hours"): 60, ("seconds", "minutes"): 60, ("hours", "days"): 24}
        assert int(answer) == int(m[2]) * factors[(m[1], m[3])]
    else:
        raise AssertionError(f"unrecognised question {question!r}")


def test_every_answer_is_correct():
    for e in make_examples(300, seed=3):
        check_answer(e["messages"][1]["content"], e["answer"])


def test_split_is_disjoint_stable_and_roughly_sized():
    examples = make_examples(400, seed=0)
    train, val = split_examples(examples, 0.2)
    assert len(train) + len(val) == 400 and 40 <= len(val) <= 120
    assert not {e["messages"][1]["content"] for e in train} & {e["messages"][1]["content"] for e in val}
    # a question's side does not depend on which other examples were generated
    _, val_small = split_examples(examples[:100], 0.2)
    assert val_small == [e for e in val if e in examples[:100]]


def test_write_demo_files_are_valid_sft_data(tmp_path, small_tokenizer):
    counts = write_demo(tmp_path, 40, seed=0, val_fraction=0.25)
    assert counts["train"] + counts["val"] == 40
    for line in (tmp_path / "train.jsonl").read_text().splitlines():
        assert tokenize_example(small_tokenizer, json.loads(line), max_length=256) is not None


@pytest.mark.parametrize("prediction,answer,expected", [
    ("42", "42", True), (" 42.\n", "42", True), ("42<|im_end|>\n", "42", True), ("3, 5,  7", "3, 5, 7", True),
    ("43", "42", False), ("Elppa", "elppa", False), ("42 apples", "42", False),
])
def test_exact_match(prediction, answer, expected):
    assert exact_match(prediction, answer) is expected


def test_an_exhausted_task_leaves_the_cycle_and_the_others_go_on():
    examples = make_examples(400, seed=0, tasks=["reversal", "counting"])
    questions = [e["messages"][1]["content"] for e in examples]
    assert len(set(questions)) == 400
    assert sum(e["task"] == "reversal" for e in examples) == 144  # 12 x 12 words: every one made
    assert examples[:288] == make_examples(288, seed=0, tasks=["reversal", "counting"])  # a prefix
    with pytest.raises(ValueError, match="cannot make 200 distinct examples of tasks \\['reversal'\\]: they hold 144"):
        make_examples(200, seed=0, tasks=["reversal"])


def test_max_val_keeps_the_first_held_out_examples_and_trains_on_none_of_the_rest(tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    write_demo(small, 300, seed=0)
    counts = write_demo(big, 3000, seed=0, max_val=10)
    assert counts["val"] == 10
    val_small = (small / "val.jsonl").read_text().splitlines()
    assert (big / "val.jsonl").read_text().splitlines() == val_small[:10]
    _, all_val = split_examples(make_examples(3000, seed=0))
    held_out = {e["messages"][1]["content"] for e in all_val}
    train = [json.loads(line)["messages"][1]["content"] for line in (big / "train.jsonl").read_text().splitlines()]
    assert len(train) == counts["train"] == 3000 - len(all_val) and not held_out & set(train)


def test_unknown_task_is_an_error():
    with pytest.raises(ValueError, match="unknown demo tasks"):
        make_examples(3, tasks=["poetry"])


def test_distractors_are_distinct_near_misses_the_same_on_every_call():
    from lmforge.data.sft_demo import choice_example, make_examples

    for ex in make_examples(200, seed=3):
        mc = choice_example(ex)
        assert mc == choice_example(ex)  # deterministic
        assert len(set(mc["answers"])) == 4 and mc["answers"][mc["label"]] == ex["answer"]
        assert all(c == a + "<|im_end|>" for c, a in zip(mc["choices"], mc["answers"]))
        wrong = [a for i, a in enumerate(mc["answers"]) if i != mc["label"]]
        if ex["task"] in ("counting", "arithmetic", "unit_conversion"):
            assert all(w.lstrip("-").isdigit() for w in wrong)
        if ex["task"] == "reversal":  # same letters: only the order gives it away
            assert all(sorted(w) == sorted(ex["answer"]) for w in wrong)
        if ex["task"] == "sorting":
            assert all(sorted(w.split(", ")) == sorted(ex["answer"].split(", ")) for w in wrong)
