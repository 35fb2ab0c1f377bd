"""The lifecycle's report card: the same tasks scored on every stage's final model (base -> SFT ->
DPO -> ...), side by side in report.md. A lifecycle recipe's ``report_card: {tasks: [...]}``
turns it on; each stage's figures are ``lmforge eval``'s (``run_eval``), written to
``<lifecycle run_dir>/report-card/<stage>/results.json``, and kept for a rerun while the stage's
outputs, the tasks and their data are unchanged. A lifecycle with ``rounds`` also scores the model
round 1 starts from (as ``start``), and the table says each column's round.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from lmforge.core.config import ConfigError, option, positive, to_dict
from lmforge.core.io import atomic_write_json, file_stamps
from lmforge.core.run import log
from lmforge.eval.suite import load_tasks
from lmforge.stages.eval import EvalRecipe, run_eval
from lmforge.train.metrics import PERPLEXITIES

CARD_DIR = "report-card"
KEY_FILE = "card-key.json"


@dataclass
class ReportCardConfig:
    """The lifecycle recipe's ``report_card:`` section."""

    tasks: list[str] = option(
        default_factory=list, help="lmforge eval's --tasks (files, suites, bundled names); empty: none"
    )
    stages: list[str] = option(
        default_factory=list, help="stage names to score; empty: every stage that leaves a model"
    )
    limit: float | None = positive(None, help="the first N documents of each task")
    batch_size: int = positive(16, help="rows per forward / sequences decoding together")
    device: str = option("auto", help="auto = cuda when available, else cpu")


def stage_checkpoint(entry: dict) -> str | None:
    """The model a stage's result leaves: a fine-tuning stage's ``final_checkpoint``, pre-training's
    last ``checkpoint``; None for a stage that trains no model (curate, prepare, generate, and eval,
    whose result names the checkpoint it read: a trained model's summary has the loop's ``step``)."""
    result = entry.get("result")
    if not isinstance(result, dict) or "step" not in result:
        return None
    found = result.get("final_checkpoint") or result.get("checkpoint")
    return str(found) if found else None


def check_stages(cfg: ReportCardConfig, names: list[str]) -> None:
    """Every stage ``report_card.stages`` names is one of the lifecycle's (checked before any stage runs)."""
    unknown = [s for s in cfg.stages if s not in names]
    if unknown:
        raise ConfigError(f"report_card.stages: {', '.join(unknown)} not among the stages ({', '.join(names)})")
    if cfg.tasks:
        load_tasks(cfg.tasks)  # a bad task file fails before hours of work


def start_entry(start: str) -> dict:
    """A result entry for the model a lifecycle's rounds start from, as ``score_stages`` reads one:
    round 0, its files' sizes and times standing for a stage's outputs."""
    stamps = hashlib.sha256(json.dumps(file_stamps([Path(start)], [])).encode()).hexdigest()
    return {"name": "start", "round": 0, "outputs_sha256": stamps, "result": {"step": 0, "checkpoint": start}}


def score_stages(cfg: ReportCardConfig, run_dir: Path, results: list[dict], start: str | None = None) -> dict:
    """Each chosen stage's figures on ``cfg.tasks`` (first ``start``'s, the model a lifecycle's rounds
    start from, when given): ``{"stages": [names], "results": {name: [...]}, "rounds": {name: round
    or None}, "seconds": s}``; empty without tasks."""
    if not cfg.tasks:
        return {}
    t0 = time.perf_counter()
    tasks, _ = load_tasks(cfg.tasks)
    digests = [t.config_hash({}) for t in tasks]  # each task's config and data
    card: dict = {"stages": [], "results": {}, "rounds": {}}
    for entry in ([start_entry(start)] if start else []) + results:
        checkpoint = stage_checkpoint(entry)
        if checkpoint is None or (cfg.stages and entry["name"] not in cfg.stages):
            continue
        out = run_dir / CARD_DIR / entry["name"]
        key = hashlib.sha256(json.dumps([entry.get("outputs_sha256"), checkpoint, to_dict(cfg), digests]).encode()
                             ).hexdigest()
        if (out / KEY_FILE).is_file() and json.loads((out / KEY_FILE).read_text()) == key:
            log.info("report card: %s unchanged, its figures kept (%s)", entry["name"], out / "results.json")
            res = json.loads((out / "results.json").read_text())
        else:
            log.info("report card: scoring %s (%s)", entry["name"], checkpoint)
            res = run_eval(EvalRecipe(checkpoint=checkpoint, tasks=list(cfg.tasks), limit=cfg.limit, run_dir=str(out),
                                      batch_size=cfg.batch_size, device=cfg.device))
            atomic_write_json(out / KEY_FILE, key)
        card["stages"].append(entry["name"])
        card["results"][entry["name"]] = res["results"]
        card["rounds"][entry["name"]] = entry.get("round")
    card["seconds"] = round(time.perf_counter() - t0, 1)
    return card


def card_lines(card: dict, stopped: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The report's table: one row per task and metric, one column per stage (perplexities left
    out: bits per byte carries them; a stage in ``stopped``, stopped early by a time limit, is
    headed so), the ``core`` aggregate in bold; with rounds, a first row gives each column's
    round (0: the model they start from)."""
    if not card or not card.get("stages"):
        return []
    stages = card["stages"]
    rows: dict[tuple, dict[str, float]] = {}
    arrows: dict[tuple, str] = {}
    for stage in stages:
        for r in card["results"][stage]:
            if r["metric"] in PERPLEXITIES:
                continue
            row = (r["task"], r["metric"], r["filter"])
            rows.setdefault(row, {})[stage] = r["value"]
            arrows[row] = "↑" if r["higher_is_better"] else "↓"
    lines = ["## report card", "",
             f"The same tasks on each stage's final model ({card['seconds']:.0f} s to score; `core`: accuracies centred "
             "on chance, averaged).", "",
             "| task | metric | " + " | ".join(s + (" (stopped early)" if s in stopped else "") for s in stages) + " |", "|---|---|" + "---:|" * len(stages)]
    rounds = card.get("rounds") or {}
    if any(rounds.get(s) is not None for s in stages):
        lines.append("| *round* | | " + " | ".join(f"*{rounds[s]}*" if rounds.get(s) is not None else ""
                                                   for s in stages) + " |")
    for (task, metric, filt), values in rows.items():
        name = metric + ("" if filt == "none" else f" ({filt})")
        cells = [f"{values[s]:.4f}" if s in values else "" for s in stages]
        if metric == "core":
            task, name, cells = f"**{task}**", f"**{name}**", [f"**{c}**" if c else c for c in cells]
        lines.append(f"| {task} | {name} {arrows[(task.strip('*'), metric, filt)]} | " + " | ".join(cells) + " |")
    return lines + [""]
