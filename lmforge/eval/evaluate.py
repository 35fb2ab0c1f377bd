"""Scoring a task on a model: its requests, each document's metric items, the task's figures.

Per output type, each document gives (as the harness's ``ConfigurableTask.process_results``):

- ``multiple_choice``: log-likelihood of ``target_delimiter + choice`` for each choice after the
  prompt; ``acc`` (the most likely choice is the gold one), ``acc_norm`` (log-likelihood divided
  by the choice's length in characters, the harness's ``acc_norm``), ``acc_bytes`` (divided by
  its UTF-8 bytes), ``exact_match`` (the gold choice is the greedy continuation);
- ``loglikelihood``: of the target after the prompt; ``perplexity`` (exp of minus the mean
  log-likelihood), ``acc`` (the target is the greedy continuation) and, an lmforge addition,
  ``bits_per_byte`` of the target (-Σ ll / Σ bytes / ln 2);
- ``loglikelihood_rolling``: of the whole target text; ``word_perplexity``, ``byte_perplexity``
  (weighted by words, ``re.split(r"\\s+")``, and UTF-8 bytes) and ``bits_per_byte``;
- ``generate_until``: ``repeats`` continuations; each filter of ``filter_list`` (default: the
  first continuation) gives the response that ``exact_match`` (the harness's options) and, lmforge
  additions, ``numeric_match`` (``answers.numeric_match``, ``rel_tol``) score against the target
  (any of several targets); ``pass_at_k`` (``k: [1, 5]``) counts the correct ones among all
  ``repeats`` samples after the filter's per-sample steps (Chen et al.'s unbiased estimator).

Aggregations and standard errors are the harness's (``eval.metrics``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.data.tokenizer import Tokenizer
from lmforge.eval import answers, scoring
from lmforge.eval.metrics import AGGREGATIONS, pass_at_k, stderr
from lmforge.eval.tasks import (
    DEFAULT_FEWSHOT_SEED,
    DEFAULT_METRICS,
    FewshotSampler,
    Task,
    effective_fewshot,
    fewshot_context,
    limited,
)

# metric -> (default aggregation, higher is better, output types, its options)
EXACT_MATCH_OPTIONS = {"ignore_case", "ignore_punctuation", "ignore_numbers", "regexes_to_ignore"}
METRICS: dict[str, tuple[str, bool, set[str], set[str]]] = {
    "acc": ("mean", True, {"multiple_choice", "loglikelihood"}, set()),
    "acc_norm": ("mean", True, {"multiple_choice"}, set()),
    "acc_bytes": ("mean", True, {"multiple_choice"}, set()),
    "exact_match": ("mean", True, {"multiple_choice", "generate_until"}, EXACT_MATCH_OPTIONS),
    "perplexity": ("perplexity", False, {"loglikelihood"}, set()),
    "bits_per_byte": ("bits_per_byte", False, {"loglikelihood", "loglikelihood_rolling"}, set()),
    "word_perplexity": ("weighted_perplexity", False, {"loglikelihood_rolling"}, set()),
    "byte_perplexity": ("weighted_perplexity", False, {"loglikelihood_rolling"}, set()),
    "numeric_match": ("mean", True, {"generate_until"}, {"rel_tol", "abs_tol"}),
    "pass_at_k": ("mean", True, {"generate_until"}, {"k"} | EXACT_MATCH_OPTIONS),
}
FILTERS = {"regex": {"regex_pattern", "group_select", "fallback"}, "remove_whitespace": set(), "lowercase": set(),
           "uppercase": set(), "take_first": set(), "take_first_k": {"k"}, "majority_vote": set()}
SELECTIONS = {"take_first", "take_first_k", "majority_vote"}


def _is_regex(value: object) -> bool:
    try:
        re.compile(value)  # type: ignore[arg-type]
    except (re.error, TypeError):
        return False
    return isinstance(value, str)


def _non_negative(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


# option -> (is it valid, what it must be): the options of METRICS and FILTERS, checked as read
OPTION_RULES: dict[str, tuple[Any, str]] = {
    **{key: (lambda v: isinstance(v, bool), "true or false") for key in ("ignore_case", "ignore_punctuation",
                                                                         "ignore_numbers")},
    "regexes_to_ignore": (lambda v: isinstance(v, list) and all(map(_is_regex, v)), "a list of regular expressions"),
    "rel_tol": (_non_negative, "a number >= 0"),
    "abs_tol": (_non_negative, "a number >= 0"),
    "regex_pattern": (_is_regex, "a regular expression"),
    "group_select": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer (negative: from the end)"),
    "fallback": (lambda v: isinstance(v, str), "a string"),
    "k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
}


def check_options(task: Task, key: str, owner: str, options: dict[str, Any]) -> None:
    """Each option's type, named by the task key and its metric or filter, before anything is scored."""
    for option, value in options.items():
        valid, what = OPTION_RULES[option]
        if option == "k" and owner == "pass_at_k":  # one k or a list of them, checked against repeats below
            continue
        if not valid(value):
            raise task.error(key, f"{owner}: {option} must be {what}, got {value!r}")


@dataclass
class MetricSpec:
    name: str
    aggregation: str
    higher_is_better: bool
    options: dict[str, Any]


@dataclass
class EvalSettings:
    """How ``evaluate_task`` runs: simple_evaluate's options of the same names and defaults."""

    limit: float | None = None  # the first N documents (a fraction below 1: that share)
    num_fewshot: int | None = None  # overrides the task's, unless the task fixes 0
    fewshot_seed: int | None = DEFAULT_FEWSHOT_SEED
    bootstrap_iters: int = 100000
    batch_size: int = 16
    seed: int = 1234  # sampled generation

    def for_hash(self, num_fewshot: int) -> dict:
        return {"limit": self.limit, "num_fewshot": num_fewshot, "fewshot_seed": self.fewshot_seed,
                "bootstrap_iters": self.bootstrap_iters, "seed": self.seed}


@dataclass
class MetricResult:
    """One figure of one task, as results.json holds it."""

    task: str
    metric: str
    filter: str
    value: float
    stderr: float | None
    n: int
    higher_is_better: bool
    aggregation: str
    num_fewshot: int
    config_hash: str
    file: str


def metric_specs(task: Task) -> list[MetricSpec]:
    """The task's ``metric_list`` checked against what its output type gives (or its default metrics)."""
    entries = task.config.get("metric_list")
    if entries is None:
        entries = [{"metric": m} for m in DEFAULT_METRICS[task.output_type]]
    if not isinstance(entries, list) or not entries:
        raise task.error("metric_list", "must be a non-empty list of {metric: NAME, ...}")
    specs = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("metric"), str):
            raise task.error("metric_list", f"each entry needs 'metric: NAME'; got {entry!r}")
        name = entry["metric"]
        known = [m for m, spec in METRICS.items() if task.output_type in spec[2]]
        if name not in known:
            raise task.error("metric_list", f"unknown metric {name!r} for output_type {task.output_type} "
                                            f"(lmforge eval has: {', '.join(known)})")
        aggregation, higher, _, allowed = METRICS[name]
        options = {k: v for k, v in entry.items() if k not in ("metric", "aggregation", "higher_is_better", "hf_evaluate")}
        bad = set(options) - allowed
        if bad:
            raise task.error("metric_list", f"{name}: unknown option(s) {', '.join(sorted(bad))}"
                                            f"{' (options: ' + ', '.join(sorted(allowed)) + ')' if allowed else ''}")
        check_options(task, "metric_list", name, options)
        aggregation = entry.get("aggregation", aggregation)
        if not isinstance(aggregation, str) or aggregation not in AGGREGATIONS:
            raise task.error("metric_list", f"{name}: unknown aggregation {aggregation!r} "
                                            f"(choose from {', '.join(AGGREGATIONS)})")
        if name == "pass_at_k":
            ks = options.get("k", [1])
            ks = [ks] if isinstance(ks, int) else ks
            if not ks or not all(isinstance(k, int) and 1 <= k <= task.repeats for k in ks):
                raise task.error("metric_list", f"pass_at_k: k must be integers in [1, repeats={task.repeats}]; got {ks!r}")
            options["k"] = ks
        higher = entry.get("higher_is_better", higher)
        if not isinstance(higher, bool):
            raise task.error("metric_list", f"{name}: higher_is_better must be true or false, got {higher!r}")
        specs.append(MetricSpec(name, aggregation, higher, options))
    return specs


def filter_pipelines(task: Task) -> list[tuple[str, list[tuple[str, dict]]]]:
    """``filter_list`` as (name, [(function, options)]); the default keeps the first response."""
    spec = task.config.get("filter_list")
    if spec is None:
        return [("none", [("take_first", {})])]
    if not isinstance(spec, list) or not spec:
        raise task.error("filter_list", "must be a list of {name: NAME, filter: [{function: ...}, ...]}")
    out = []
    for entry in spec:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"] \
                or not isinstance(entry.get("filter"), list):
            raise task.error("filter_list", f"each entry needs a name (a string) and a filter list; got {entry!r}")
        steps = []
        for step in entry["filter"]:
            function = step.get("function") if isinstance(step, dict) else None
            if not isinstance(function, str) or function not in FILTERS:
                raise task.error("filter_list", f"{entry['name']}: unknown filter function {function!r} "
                                                f"(lmforge eval has: {', '.join(FILTERS)})")
            options = {k: v for k, v in step.items() if k != "function"}
            bad = set(options) - FILTERS[function]
            if bad:
                raise task.error("filter_list", f"{entry['name']}: {function}: unknown option(s) {', '.join(sorted(bad))}")
            if function == "take_first_k" and "k" not in options:
                raise task.error("filter_list", f"{entry['name']}: take_first_k needs k (how many responses to keep)")
            check_options(task, "filter_list", f"{entry['name']}: {function}", options)
            if steps and steps[-1][0] in SELECTIONS and function not in SELECTIONS:
                raise task.error("filter_list", f"{entry['name']}: {function} after {steps[-1][0]}: per-response "
                                                "steps must come before the selection (take_first, ...)")
            steps.append((function, options))
        out.append((entry["name"], steps))
    return out


def map_response(function: str, options: dict, text: str) -> str:
    if function == "regex":
        return answers.extract(text, options.get("regex_pattern", r"#### (\-?[0-9\.\,]+)"),
                               options.get("group_select", 0), options.get("fallback", "[invalid]"))
    if function == "remove_whitespace":
        return text.strip()
    return text.lower() if function == "lowercase" else text.upper()


def apply_filter(steps: list[tuple[str, dict]], responses: list[str]) -> tuple[list[str], Any]:
    """(every response after the per-response steps, the selection: one response or a list)."""
    samples: list[Any] = list(responses)
    selected: Any = None
    for function, options in steps:
        if function in SELECTIONS:
            current = samples if selected is None else selected
            if function == "take_first":
                selected = current[0]
            elif function == "take_first_k":
                selected = current[: options["k"]]
            else:
                selected = [Counter(current).most_common(1)[0][0]]
        else:
            samples = [map_response(function, options, s) for s in samples]
    return samples, (samples if selected is None else selected)


def _em(prediction: str, gold: Any, options: dict) -> bool:
    golds = gold if isinstance(gold, list) else [gold]
    em_options = {k: v for k, v in options.items() if k in EXACT_MATCH_OPTIONS}
    return any(answers.exact_match(prediction, str(g), **em_options) for g in golds)


def generation_items(task: Task, doc: dict, gold: Any, responses: list[str], steps, specs: list[MetricSpec],
                     filter_name: str) -> dict[str, Any]:
    samples, selected = apply_filter(steps, responses)
    items: dict[str, Any] = {}
    for spec in specs:
        if spec.name == "pass_at_k":
            correct = sum(_em(s, gold, spec.options) for s in samples)
            for k in spec.options["k"]:
                items[f"pass@{k}"] = pass_at_k(len(samples), correct, k)
            continue
        if not isinstance(selected, str):
            raise task.error("filter_list", f"{filter_name}: leaves {selected!r}, not one response, for {spec.name}; "
                                            "end the filter with take_first")
        if spec.name == "exact_match":
            items["exact_match"] = float(_em(selected, gold, spec.options))
        else:  # numeric_match
            golds = gold if isinstance(gold, list) else [gold]
            items["numeric_match"] = float(any(answers.numeric_match(selected, g, **spec.options) for g in golds))
    return items


def choice_items(task: Task, doc: dict, results: list[tuple[float, bool]]) -> dict[str, float]:
    choices = task.doc_to_choice(doc)
    lls = np.array([ll for ll, _ in results])
    greedy = [g for _, g in results]
    pred = int(np.argmax(lls))
    pred_norm = int(np.argmax(lls / np.array([float(len(c)) for c in choices])))
    pred_bytes = int(np.argmax(lls / np.array([float(len(c.encode("utf-8"))) for c in choices])))
    gold = task.doc_to_target(doc)
    golds = gold if isinstance(gold, list) else [gold]
    index = []
    for g in golds:
        if isinstance(g, str):
            g = choices.index(g) if g in choices else -100
        elif not isinstance(g, int) or g >= len(choices):
            g = -100
        if g == -100:
            log.warning("%s: %s: the gold answer %r is not one of the %d choices; scored as wrong",
                        task.path, task.source_of(doc), gold, len(choices))
        index.append(g)
    return {"acc": float(pred in index), "acc_norm": float(pred_norm in index), "acc_bytes": float(pred_bytes in index),
            "exact_match": float(any(greedy[g] for g in index if g != -100))}


def target_text(task: Task, doc: dict, key: str = "doc_to_target") -> str:
    target = task.doc_to_target(doc)
    if not isinstance(target, str):
        raise task.error(key, f"{task.source_of(doc)}: a {task.output_type} target must be text, got {target!r}")
    return target


def evaluate_task(task: Task, model: nn.Module, tok: Tokenizer, settings: EvalSettings) -> list[MetricResult]:
    """Every figure of ``task`` on ``model``."""
    specs = metric_specs(task)
    pipelines = filter_pipelines(task) if task.output_type == "generate_until" else [("none", [])]
    docs = limited(task.splits[task.eval_split()], settings.limit)
    num_fewshot = effective_fewshot(task, settings.num_fewshot)
    pool = task.fewshot_pool()
    sampler = FewshotSampler(pool, settings.fewshot_seed) if pool is not None else None
    contexts = [fewshot_context(task, doc, num_fewshot, sampler) for doc in docs]
    kind = task.output_type
    per_doc: list[dict[str, dict[str, Any]]] = []  # doc -> filter -> metric -> item
    log.info("eval: %s (%s, %d documents, %d-shot)", task.name, kind, len(docs), num_fewshot)
    try:
        if kind == "multiple_choice":
            choices = [task.doc_to_choice(doc) for doc in docs]
            pairs = [(ctx, task.target_delimiter + c) for ctx, cs in zip(contexts, choices) for c in cs]
            results = scoring.loglikelihood_pairs(model, tok, pairs, settings.batch_size)
            start = 0
            for doc, cs in zip(docs, choices):
                per_doc.append({"none": choice_items(task, doc, results[start : start + len(cs)])})
                start += len(cs)
        elif kind == "loglikelihood":
            targets = [target_text(task, doc) for doc in docs]
            results = scoring.loglikelihood_pairs(model, tok, list(zip(contexts, targets)), settings.batch_size)
            for target, (ll, greedy) in zip(targets, results):
                per_doc.append({"none": {"perplexity": ll, "acc": float(greedy),
                                         "bits_per_byte": (ll, len(target.encode("utf-8")))}})
        elif kind == "loglikelihood_rolling":
            texts = [target_text(task, doc) for doc in docs]
            totals = scoring.loglikelihood_rolling(model, tok, texts, settings.batch_size)
            for text, ll in zip(texts, totals):
                n_bytes = len(text.encode("utf-8"))
                per_doc.append({"none": {"word_perplexity": (ll, len(re.split(r"\s+", text))),
                                         "byte_perplexity": (ll, n_bytes), "bits_per_byte": (ll, n_bytes)}})
        else:
            kwargs = task.generation_kwargs()
            requests = [(ctx, kwargs) for ctx in contexts for _ in range(task.repeats)]
            outputs = scoring.generate_until(model, tok, requests, settings.seed, settings.batch_size)
            multiple = isinstance(task.doc_to_target(docs[0]), list)
            for i, doc in enumerate(docs):
                gold = task.doc_to_target(doc)
                if task.config.get("doc_to_choice") is not None:
                    gold = task.choice_at(doc, gold)
                elif multiple:
                    gold = list(gold) if isinstance(gold, list) else [gold]
                else:
                    gold = str(gold)
                responses = outputs[i * task.repeats : (i + 1) * task.repeats]
                per_doc.append({name: generation_items(task, doc, gold, responses, steps, specs, name)
                                for name, steps in pipelines})
    except ValueError as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"{task.path}: {exc}") from exc
    return aggregate(task, specs, pipelines, per_doc, num_fewshot, settings)


def aggregate(task: Task, specs: list[MetricSpec], pipelines, per_doc, num_fewshot: int,
              settings: EvalSettings) -> list[MetricResult]:
    digest = task.config_hash(settings.for_hash(num_fewshot))
    out = []
    for name, _ in pipelines:
        for spec in specs:
            keys = [f"pass@{k}" for k in spec.options["k"]] if spec.name == "pass_at_k" else [spec.name]
            for key in keys:
                items = [d[name][key] for d in per_doc]
                value = float(AGGREGATIONS[spec.aggregation](items))
                err = stderr(spec.aggregation, items, settings.bootstrap_iters)
                out.append(MetricResult(task.name, key, name, value, err, len(items), spec.higher_is_better,
                                        spec.aggregation, num_fewshot, digest, str(task.path)))
    return out


def results_table(results: list[MetricResult]) -> str:
    """The figures as a Markdown table."""
    lines = ["| task | metric | filter | n-shot | value | ± stderr | n |", "|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        arrow = "↑" if r.higher_is_better else "↓"
        err = f"{r.stderr:.4f}" if r.stderr is not None else ""
        lines.append(f"| {r.task} | {r.metric} {arrow} | {r.filter} | {r.num_fewshot} | {r.value:.4f} | {err} | {r.n} |")
    return "\n".join(lines) + "\n"
