"""Metrics, stderrs, answer checks, rolling windows and few-shot sampling against
lm-evaluation-harness's own functions; pass@k against counting every k-subset."""

from __future__ import annotations

import itertools
import math
import random
import re

import pytest

from lmforge.eval import answers, metrics
from lmforge.eval.scoring import disjoint_window, rolling_windows
from lmforge.eval.tasks import FewshotSampler

lm_metrics = pytest.importorskip("lm_eval.api.metrics")


@pytest.fixture(autouse=True)
def _harness_bootstrap_in_process(monkeypatch):
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")


def test_aggregations_and_stderrs_equal_the_harness():
    rng = random.Random(0)
    lls = [-rng.uniform(0.1, 5.0) for _ in range(37)]
    pairs = [(ll, rng.randint(3, 40)) for ll in lls]
    assert metrics.mean(lls) == lm_metrics.mean(lls)
    assert metrics.median(lls) == lm_metrics.median(lls)
    assert metrics.perplexity(lls) == lm_metrics.perplexity(lls)
    assert metrics.weighted_perplexity(pairs) == lm_metrics.weighted_perplexity(pairs)
    assert metrics.bits_per_byte(pairs) == lm_metrics.bits_per_byte(pairs)
    assert metrics.mean_stderr(lls) == pytest.approx(lm_metrics.mean_stderr(lls), rel=1e-12)
    for name, fn in (("perplexity", lm_metrics.perplexity), ("median", lm_metrics.median)):
        theirs = lm_metrics.stderr_for_metric(fn, bootstrap_iters=2000)(lls)
        assert metrics.stderr(name, lls, 2000) == pytest.approx(theirs, rel=1e-12)
    assert lm_metrics.stderr_for_metric(lm_metrics.bits_per_byte, 2000) is None
    assert metrics.stderr("bits_per_byte", pairs, 2000) is None
    assert metrics.stderr("mean", [1.0], 2000) is None  # one item: the harness says N/A


EM_CASES = [
    ("The Answer.", "the answer", {}),
    ("The Answer.", "the answer", {"ignore_case": True}),
    ("The Answer.", "the answer", {"ignore_case": True, "ignore_punctuation": True}),
    ("#### 1,234", "1234", {"regexes_to_ignore": [",", "(?s).*#### "]}),
    ("room 101", "room 202", {"ignore_numbers": True}),
    ("  42 ", "42", {}),
]


@pytest.mark.parametrize("prediction,target,options", EM_CASES)
def test_exact_match_is_the_harness_exact_match(prediction, target, options):
    theirs = lm_metrics.exact_match_hf_evaluate([prediction], [target], **options)["exact_match"]
    assert answers.exact_match(prediction, target, **options) == bool(theirs)


def test_exact_match_can_strip_an_answer_as_the_demo_tasks_do():
    assert answers.exact_match(" 42.<|im_end|>", "42", strip_answer=True)
    assert not answers.exact_match(" 42.<|im_end|>", "42")


@pytest.mark.parametrize("text,target,expected", [
    ("so the total is 1,234.", "1234", True), ("x = -3.50", -3.5, True), ("it is 7 or 8", "8", True),
    ("it is 7 or 8", "7", False), ("no number", "3", False), ("#### 12", "The answer: 12", True),
])
def test_numeric_match_compares_the_last_numbers(text, target, expected):
    assert answers.numeric_match(text, target) is expected


def test_numeric_match_tolerance():
    assert answers.numeric_match("3.1416", "3.14159", rel_tol=1e-4)
    assert not answers.numeric_match("3.1416", "3.14159", rel_tol=1e-7)


@pytest.mark.parametrize("pattern,group,text", [
    (r"#### (\-?[0-9\.\,]+)", 0, "so #### 42 and #### 7"),
    (r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1, "first 12 then 3"),
    (r"(-?[$0-9.,]{2,})|(-?[0-9]+)", 0, "nothing here"),
    (r"answer: (\w+)", 0, "answer:  Paris  and answer: Rome"),
])
def test_extract_is_the_harness_regex_filter(pattern, group, text):
    from lm_eval.filters.extraction import RegexFilter

    theirs = RegexFilter(regex_pattern=pattern, group_select=group).apply([[text]], [{}])[0][0]
    assert answers.extract(text, pattern, group) == theirs


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample():
    for n in range(1, 8):
        for c in range(0, n + 1):
            for k in range(1, n + 1):
                samples = [True] * c + [False] * (n - c)
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
                assert metrics.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
                assert metrics.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    with pytest.raises(ValueError):
        metrics.pass_at_k(3, 1, 4)


@pytest.mark.parametrize("n_tokens,max_len", [(1, 4), (4, 4), (5, 4), (10, 4), (23, 7), (64, 64), (130, 64)])
def test_rolling_windows_are_the_harness_windows(n_tokens, max_len):
    from lm_eval import utils

    tokens = list(range(100, 100 + n_tokens))
    theirs = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(tokens, 0, max_len, 1)]
    mine = [disjoint_window(w) for w in rolling_windows(tokens, 0, max_len)]
    assert mine == theirs
    assert [t for _, pred in mine for t in pred] == tokens  # every token predicted once


@pytest.mark.parametrize("with_eval_doc", [False, True])
def test_fewshot_sampler_draws_the_harness_shots(with_eval_doc):
    from lm_eval.api.samplers import ContextSampler

    pool = [{"q": f"question {i}", "a": str(i)} for i in range(12)]
    theirs, mine = ContextSampler(pool, rnd=1234), FewshotSampler(pool, 1234)
    for doc in pool[:8]:
        eval_doc = doc if with_eval_doc else None
        assert mine.sample(3, eval_doc) == theirs.sample(3, eval_doc=eval_doc)


def test_word_count_is_the_harness_word_count():
    from lm_eval.api.task import Task

    text = "  two words\n\nand  more "
    assert len(re.split(r"\s+", text)) == Task.count_words(text)
