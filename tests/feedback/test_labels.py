"""Soft labels from a judge's answer tokens, the parsed fallback, balancing the two orders,
disagreement, thresholds and margins: exact values from judges whose answers are known."""

from __future__ import annotations

import math

import pytest

from lmforge.feedback.judges import Answer, Comparison, TokenChoice, comparison_messages
from lmforge.feedback.labels import (
    MAX_MARGIN,
    NoChoice,
    PairToJudge,
    choice_probability,
    judge_pairs,
    pair_output,
    parsed_choice,
)


def test_the_soft_label_is_the_normalised_probability_of_a_and_b_at_the_answer_token():
    la, lb = math.log(0.6), math.log(0.2)
    answer = Answer("(A)", [TokenChoice("(", -0.1, [("(", -0.1), ("The", -3.0)]),
                            TokenChoice("A", la, [("A", la), (" B", lb), ("C", math.log(0.1))]),
                            TokenChoice(")", -0.01, [])])
    p, how = choice_probability(answer)
    assert how == "logprobs" and p == pytest.approx(0.6 / 0.8, abs=1e-12)


def test_tokens_reading_as_one_option_add_up_and_a_missing_option_counts_as_zero():
    answer = Answer("B", [TokenChoice("B", math.log(0.5), [("B", math.log(0.5)), ("(B", math.log(0.25)),
                                                           ("A)", math.log(0.125)), ("Also", math.log(0.1))])])
    assert choice_probability(answer) == (pytest.approx(0.125 / 0.875, abs=1e-12), "logprobs")
    only_a = Answer("A", [TokenChoice("A", -0.2, [("A", -0.2), ("x", -2.0)])])
    assert choice_probability(only_a) == (1.0, "logprobs")


def test_the_answer_token_is_the_first_naming_an_option_even_after_words():
    answer = Answer("The answer is (B)", [TokenChoice("The", -0.1, [("The", -0.1), ("A", -5.0)]),
                                          TokenChoice(" answer is (", -0.1, []),
                                          TokenChoice("B", math.log(0.9), [("B", math.log(0.9)), ("A", math.log(0.1))])])
    p, how = choice_probability(answer)
    assert how == "logprobs" and p == pytest.approx(0.1, abs=1e-12)


def test_without_log_probs_or_options_among_them_the_text_is_parsed():
    assert choice_probability(Answer("I pick (B), clearly.")) == (0.0, "parsed")
    assert choice_probability(Answer("A")) == (1.0, "parsed")
    no_options = Answer("(A)", [TokenChoice("1", -0.1, [("1", -0.1), ("2", -1.0)])])
    assert choice_probability(no_options) == (1.0, "parsed")
    assert choice_probability(Answer("(A) or (B)")) == (None, "no_choice")
    assert choice_probability(Answer("Both are good")) == (None, "no_choice")
    assert parsed_choice("Answer: (A)") == "A" and parsed_choice("Apple") is None
    assert parsed_choice("Option B is better.") == "B" and parsed_choice("The answer is A") == "A"
    assert parsed_choice("Option A or option B") is None and parsed_choice("A cat is (B)") == "B"


def test_a_callables_probability_is_taken_as_given():
    assert choice_probability(Answer("", p_a=0.3)) == (0.3, "callable")


class Scripted:
    """A judge answering P(A) from a table keyed by (A, B)."""

    def __init__(self, table):
        self.table, self.seen = table, []

    def compare(self, comparisons):
        self.seen += comparisons
        return [Answer("", p_a=self.table[(c.a, c.b)]) for c in comparisons]


def pair(x="short", y="much longer", key="f.jsonl:1 samples 0,1"):
    return PairToJudge(key, [{"role": "user", "content": "hi"}], x, y, 0, 1, "correct", "Which is right?")


def test_each_pair_is_judged_in_both_orders_and_averaged():
    judge = Scripted({("short", "much longer"): 0.9, ("much longer", "short"): 0.3})
    (judged,) = judge_pairs(judge, [pair()])
    assert [(c.a, c.b) for c in judge.seen] == [("short", "much longer"), ("much longer", "short")]
    assert judged["p_x"] == [0.9, pytest.approx(0.7)] and judged["p_x_better"] == pytest.approx(0.8)
    assert judged["disagree"] is False and judged["principle"] == "correct" and judged["read"] == ["callable"] * 2


def test_a_judge_that_always_picks_a_disagrees_with_itself_and_its_label_is_a_tie():
    judge = Scripted({("short", "much longer"): 0.8, ("much longer", "short"): 0.8})
    (judged,) = judge_pairs(judge, [pair()])
    assert judged["disagree"] is True and judged["p_x_better"] == pytest.approx(0.5)


def test_an_answer_naming_neither_option_is_an_error_naming_the_item_or_a_counted_skip():
    class Neither:
        def compare(self, comparisons):
            return [Answer("(A)") if i == 0 else Answer("no idea") for i, _ in enumerate(comparisons)]

    with pytest.raises(NoChoice, match=r"f.jsonl:1 samples 0,1 \(y, x\): the judge's answer names neither .*no idea"):
        judge_pairs(Neither(), [pair()])
    (judged,) = judge_pairs(Neither(), [pair()], on_no_choice="skip")
    assert judged["skipped"] == "no_choice" and pair_output("p", "x", "y", judged, 0.5) == (None, "no_choice")


def test_pair_output_picks_the_preferred_side_with_confidence_margin_and_threshold():
    judged = {"p_x_better": 0.25}
    record, why = pair_output([{"role": "user", "content": "q"}], "x", "y", judged, 0.7)
    assert why == "kept" and record["chosen"] == [{"role": "assistant", "content": "y"}]
    assert record["rejected"] == [{"role": "assistant", "content": "x"}]
    assert record["confidence"] == 0.75 and record["margin"] == pytest.approx(math.log(3))
    assert pair_output("q", "x", "y", judged, 0.8) == (None, "below_threshold")
    assert pair_output("q", "x", "y", {"p_x_better": 0.5}, 0.5) == (None, "no_preference")
    sure, _ = pair_output("q", "x", "y", {"p_x_better": 1.0}, 0.5)
    assert sure["chosen"] == "x" and sure["margin"] == MAX_MARGIN and math.isfinite(sure["margin"])


def test_the_comparison_prompt_shows_the_conversation_question_and_both_options():
    (message,) = comparison_messages(Comparison("k", [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "2+2?"}], "4", "5", "Which is right?"))
    text = message["content"]
    assert message["role"] == "user" and "System: Be brief.\nUser: 2+2?" in text
    assert "Which is right?\n\nOptions:\n(A) 4\n(B) 5" in text and text.endswith("Answer with (A) or (B) only.")
