"""Suites: a YAML file listing task files, scored together, with a CORE-style aggregate.

A suite is the harness's group file (``group:`` its name, ``task:`` its members), its members
named by path (relative to the suite file; a task YAML, or a text file for bits per byte), plus
``core:``, the tasks of the aggregate::

    group: demo_suite
    task: [heldout/bpb_milton.jsonl, demo_choices.yaml, demo_answers.yaml]
    core:
      - {task: demo_choices, metric: acc}
      - {task: demo_answers, metric: exact_match}

The aggregate is DCLM's CORE (Li et al. 2024, "DataComp-LM", as nanochat computes it): each
task's accuracy centred on its chance level, ``centered = (acc - chance) / (1 - chance)``, and
``core`` their mean, so 0 is guessing and 1 is every answer right whatever the number of choices.
Chance is ``chance:`` where an entry gives it, else, for a multiple-choice task, the mean over
the scored documents of 1 / (number of choices), and 0 for any other task (an exact answer
cannot be guessed). Bits-per-byte tasks are reported, not aggregated: they have no chance level.
The stderr of a centred figure is the task's divided by (1 - chance); of ``core``,
``sqrt(Σ stderr²) / k`` (the tasks taken as independent).
"""

from __future__ import annotations

import difflib
import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.core.untrusted import path_name
from lmforge.data.tokenizer import Tokenizer
from lmforge.eval.denoising import TrainedDenoising, evaluate_denoising
from lmforge.eval.evaluate import EvalSettings, MetricResult, evaluate_task, filter_pipelines, metric_specs
from lmforge.eval.tasks import Task, limited, load_task, read_yaml

SUITE_KEYS = {"group", "task", "core"}
CORE_KEYS = {"task", "metric", "filter", "chance"}
# where a bare task name (``demo_choices``) is looked up: data/eval of the repository lmforge is
# installed from (this file is lmforge/eval/suite.py), whatever the current directory
BUNDLED = Path(__file__).resolve().parents[2] / "data" / "eval"


@dataclass
class CoreEntry:
    task: str
    metric: str
    filter: str = "none"
    chance: float | None = None  # None: from the task (1 / choices for multiple choice, else 0)


@dataclass
class Suite:
    name: str
    path: Path
    tasks: list[Path]
    core: list[CoreEntry]


def resolve_task_path(spec: str) -> Path:
    """A task file, or a bundled task or suite by name (``demo_suite`` -> data/eval/demo_suite.yaml of
    lmforge's repository, ``BUNDLED``)."""
    path = Path(spec)
    if path.exists() or path.suffix or ("@" in path.name and Path(spec.rpartition("@")[0]).is_dir()):
        return path  # a file, a prepared directory, or DIR@SPLIT
    for candidate in (BUNDLED / f"{spec}.yaml", BUNDLED / "heldout" / f"{spec}.jsonl"):
        if candidate.is_file():
            return candidate
    names = sorted(p.stem for p in [*BUNDLED.glob("*.yaml"), *BUNDLED.glob("heldout/*.jsonl")])
    close = difflib.get_close_matches(spec, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f" (bundled: {', '.join(names)})" if names else ""
    raise InputError(f"{spec}: no such task file, and no bundled task of that name in {shown(BUNDLED)}{hint}")


def shown(path: Path) -> Path:
    """``path`` as a message gives it: relative to the current directory when under it."""
    try:
        return path.relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def is_suite(path: Path) -> bool:
    return path.suffix in (".yaml", ".yml") and path.is_file() and "group" in read_yaml(path)[0]


def load_suite(path: str | Path) -> Suite:
    """Read a suite file; every member and core entry is checked here."""
    path = Path(path)
    config, lines = read_yaml(path)

    def where(key: str) -> str:
        return f"{path}:{lines.get(key, '?')}"

    for key in config:
        if key not in SUITE_KEYS:
            close = difflib.get_close_matches(str(key), sorted(SUITE_KEYS), n=1)
            raise InputError(f"{where(key)}: unknown suite key {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    name, members = config.get("group"), config.get("task")
    if not isinstance(name, str) or not name:
        raise InputError(f"{where('group')}: group: the suite's name (a string) is needed")
    path_name(name, f"{where('group')}: group")  # a results key, as a task's name is
    if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
        raise InputError(f"{where('task')}: task: a non-empty list of task files (relative to the suite) is needed")
    tasks = []
    for member in members:
        file = path.parent / member
        if not file.is_file():
            raise InputError(f"{where('task')}: task: {member}: {file} not found (paths are relative to the suite file)")
        if is_suite(file):
            raise InputError(f"{where('task')}: task: {member} is itself a suite; list its tasks instead")
        tasks.append(file)
    core = []
    for entry in config.get("core") or []:
        if not isinstance(entry, dict) or not {"task", "metric"} <= set(entry) or set(entry) - CORE_KEYS:
            raise InputError(f"{where('core')}: core: each entry is {{task: NAME, metric: NAME}} (optional filter, "
                             f"chance); got {entry!r}")
        chance = entry.get("chance")
        if chance is not None and not (isinstance(chance, (int, float)) and 0 <= chance < 1):
            raise InputError(f"{where('core')}: core: {entry['task']}: chance must be a number in [0, 1), got {chance!r}")
        core.append(CoreEntry(str(entry["task"]), str(entry["metric"]), str(entry.get("filter", "none")), chance))
    return Suite(name, path, tasks, core)


def expand(specs: list[str]) -> tuple[list[Path], list[Suite]]:
    """Task files and suites named in ``specs`` -> (every task file, the suites)."""
    files: list[Path] = []
    suites: list[Suite] = []
    for spec in specs:
        path = resolve_task_path(spec)
        if is_suite(path):
            suite = load_suite(path)
            suites.append(suite)
            files += [f for f in suite.tasks if f not in files]
        elif path not in files:
            files.append(path)
    return files, suites


def chance_level(task: Task, limit: float | None) -> float:
    """What guessing scores: the mean of 1 / choices over the documents scored (multiple choice), else 0."""
    if task.output_type != "multiple_choice":
        return 0.0
    docs = limited(task.splits[task.eval_split()], limit)
    return sum(1.0 / len(task.doc_to_choice(d)) for d in docs) / len(docs)


def core_results(suite: Suite, tasks: dict[str, Task], results: list[MetricResult],
                 limit: float | None) -> list[MetricResult]:
    """Each core entry's centred figure (``centered_<metric>`` of its task) and the suite's ``core``."""
    if not suite.core:
        return []
    by_key = {(r.task, r.metric, r.filter): r for r in results}
    out = []
    for entry in suite.core:
        found = by_key.get((entry.task, entry.metric, entry.filter))
        if found is None:
            have = sorted(f"{t}/{m}" + ("" if f == "none" else f"/{f}") for t, m, f in by_key)
            raise InputError(f"{suite.path}: core: {entry.task}/{entry.metric} (filter {entry.filter}) is not among the "
                             f"suite's figures: {', '.join(have)}")
        chance = entry.chance if entry.chance is not None else chance_level(tasks[entry.task], limit)
        value = (found.value - chance) / (1.0 - chance)
        err = found.stderr / (1.0 - chance) if found.stderr is not None else None
        out.append(MetricResult(entry.task, f"centered_{entry.metric}", entry.filter, value, err, found.n, True,
                                f"centered(chance={chance:.4g})", found.num_fewshot, found.config_hash, found.file))
    errs = [r.stderr for r in out]
    err = math.sqrt(sum(e * e for e in errs)) / len(out) if all(e is not None for e in errs) else None
    digest = hashlib.sha256("".join(r.config_hash for r in out).encode()).hexdigest()[:16]
    out.append(MetricResult(suite.name, "core", "none", sum(r.value for r in out) / len(out), err, len(out), True,
                            "mean of centered", 0, digest, str(suite.path)))
    return out


def load_tasks(specs: list[str]) -> tuple[list[Task], list[Suite]]:
    """Every task of ``specs`` (task files, bundled names, suites) read and checked, and the suites."""
    files, suites = expand(specs)
    tasks = [load_task(f) for f in files]
    for task in tasks:  # metrics and filters too, so a bad one stops the run before any task is scored
        metric_specs(task)
        if task.output_type == "generate_until":
            filter_pipelines(task)
    names = [t.name for t in tasks]
    if len(set(names)) < len(names):
        raise InputError(f"two tasks are named the same ({', '.join(sorted({n for n in names if names.count(n) > 1}))}); "
                         "give each a distinct 'task:' name")
    for suite in suites:
        for entry in suite.core:
            if entry.task not in names:
                raise InputError(f"{suite.path}: core: {entry.task!r} is not a task of the suite "
                                 f"(its tasks: {', '.join(t.name for t in tasks if t.path in suite.tasks)})")
    return tasks, suites


def evaluate_all(tasks: list[Task], suites: list[Suite], model: nn.Module, tok: Tokenizer,
                 settings: EvalSettings, denoising: TrainedDenoising | None = None) -> list[MetricResult]:
    """Every figure of every task, then each suite's centred figures and ``core``. For a model
    pre-trained with a denoising objective (``denoising``), a text task gives that objective's figures."""
    results: list[MetricResult] = []
    for task in tasks:
        t0 = time.perf_counter()
        if denoising is not None and task.output_type == "loglikelihood_rolling":
            figures = evaluate_denoising(task, model, tok, denoising, settings)
        else:
            figures = evaluate_task(task, model, tok, settings)
        results += figures
        log.info("eval: %s: %s (%.1fs)", task.name,
                 ", ".join(f"{r.metric}{'' if r.filter == 'none' else '/' + r.filter}={r.value:.4f}" for r in figures),
                 time.perf_counter() - t0)
    by_name = {t.name: t for t in tasks}
    for suite in suites:
        results += core_results(suite, by_name, results, settings.limit)
    return results
