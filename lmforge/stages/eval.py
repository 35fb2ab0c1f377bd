"""Score a checkpoint on tasks in lm-evaluation-harness's YAML format: multiple choice
(acc, acc_norm), log-likelihood (perplexity, acc, bits per byte of the target), rolling
log-likelihood (word/byte perplexity, bits per byte) and generation (exact match, numeric
match, pass@k), with the harness's prompts, few-shot sampling and standard errors.
A JSONL (`text` field), Parquet or plain-text file in --tasks is scored for bits per byte; a
suite (data/eval/demo_suite.yaml: a group of tasks) adds its CORE aggregate (accuracies centred
on chance, averaged).
Writes results.json (one record per task, metric and filter: value, stderr, n, config hash)
and results.md into --out. <checkpoint> is a checkpoint directory or a run directory (its
newest valid checkpoint). The same tasks run in the harness itself with --model lmforge
(lmforge.eval.harness). A checkpoint pre-trained with objective=mlm or span scores text files
and prepared data for masked-token accuracy and loss, or span-reconstruction loss and accuracy
(lmforge.eval.denoising).

  lmforge eval runs/demo/sft --tasks data/eval/demo_suite.yaml --out runs/eval-sft
  lmforge eval runs/demo/sft --tasks data/eval/demo_answers.yaml
  lmforge eval runs/demo/pretrain --tasks data/pretrain/milton.jsonl --limit 8 batch_size=32
  lmforge eval runs/encoder/mlm --tasks runs/encoder/data
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from lmforge.checkpoints.load import resolve_checkpoint
from lmforge.core.config import at_least, load_config, option, positive, seed_field
from lmforge.core.io import InputError, atomic_write_json, atomic_write_text, check_output_dir
from lmforge.core.run import log, record_config, run_dir_lock, start_run
from lmforge.eval.denoising import check_tasks, trained_denoising
from lmforge.eval.evaluate import EvalSettings, MetricResult, results_table
from lmforge.eval.scoring import load_checkpoint
from lmforge.eval.suite import evaluate_all, load_tasks
from lmforge.eval.tasks import DEFAULT_FEWSHOT_SEED


@dataclass
class EvalRecipe:
    checkpoint: str = option(
        "runs/demo/pretrain", help="a checkpoint directory, or a run directory (its newest valid checkpoint)"
    )
    tasks: list[str] = option(
        default_factory=list,
        help="task YAML files, suites (a group of tasks and its CORE aggregate) or bundled names "
        "(data/eval/<name>.yaml of lmforge's repository); any other file: bits per byte of its text",
    )
    limit: float | None = positive(None, help="the first N documents of each task (below 1: that share); null = all")
    num_fewshot: int | None = at_least(0, None, help="overrides each task's num_fewshot, unless a task fixes 0")
    run_dir: str | None = option(None, help="receives results.json, results.md and config.yaml")
    batch_size: int = positive(16, help="rows per forward / sequences decoding together")
    fewshot_seed: int | None = seed_field(DEFAULT_FEWSHOT_SEED, help="the harness's fewshot_random_seed")
    seed: int = seed_field(1234, help="sampled generation")
    bootstrap_iters: int = at_least(0, 100000, help="resamples for bootstrapped stderrs (perplexity, median); 0 = none")
    dtype: Literal["float32", "bfloat16"] = option("float32", help="the model's weights and compute")
    device: str = option("auto", help="auto = cuda when available, else cpu")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory, or a run directory (uses its newest valid checkpoint)")
    parser.add_argument("--tasks", nargs="+", required=True, metavar="FILE",
                        help="task YAML files (lm-evaluation-harness format), or text files for bits per byte")
    parser.add_argument("--limit", type=float, default=None, help="score the first N documents of each task")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (overrides the tasks')")
    parser.add_argument("--out", default=None, help="folder for results.json and results.md (recipe key run_dir)")


def recipe_from_args(args: argparse.Namespace) -> EvalRecipe:
    # `--tasks a.yaml batch_size=32`: the key=value after the files is an override, not a task file
    overrides = [t for t in args.tasks if "=" in t and not Path(t).exists()]
    tasks = [t for t in args.tasks if t not in overrides]
    recipe = load_config(EvalRecipe, None, [*overrides, *args.overrides])
    recipe = dataclasses.replace(recipe, checkpoint=args.checkpoint, tasks=tasks)
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise InputError(f"--num-fewshot must be 0 or more (the few-shot examples per document), got {args.num_fewshot}")
    if args.limit is not None and args.limit <= 0:
        raise InputError(f"--limit must be positive (documents per task, or below 1 a share of them), got {args.limit:g}")
    for key, value in (("limit", args.limit), ("num_fewshot", args.num_fewshot), ("run_dir", args.out)):
        if value is not None:
            recipe = dataclasses.replace(recipe, **{key: value})
    return recipe


def run_eval(recipe: EvalRecipe) -> dict:
    """Score every task; return what results.json holds."""
    if not recipe.tasks:
        raise InputError("no tasks: give task files with --tasks a.yaml b.yaml (or tasks='[...]')")
    if recipe.limit is not None and recipe.limit <= 0:
        raise InputError(f"limit must be positive, got {recipe.limit}")
    if recipe.run_dir is not None:  # before any work: a place that cannot take results.json would lose it all
        check_output_dir(recipe.run_dir, "run_dir (--out)")
    tasks, suites = load_tasks(recipe.tasks)  # every file checked before the model loads
    directory = resolve_checkpoint(recipe.checkpoint)
    model, tok = load_checkpoint(str(directory), recipe.device, recipe.dtype, verify=False)
    denoising = trained_denoising(directory, tok, model.cfg.max_seq_len)  # mlm, span: their own figures on text
    check_tasks(tasks, denoising)
    settings = EvalSettings(limit=recipe.limit, num_fewshot=recipe.num_fewshot, fewshot_seed=recipe.fewshot_seed,
                            bootstrap_iters=recipe.bootstrap_iters, batch_size=recipe.batch_size, seed=recipe.seed)
    results = evaluate_all(tasks, suites, model, tok, settings, denoising)
    table = results_table(results)
    print(table, end="", flush=True)
    out = {"checkpoint": str(recipe.checkpoint), "results": [asdict(r) for r in results]}
    if recipe.run_dir is not None:
        with run_dir_lock(recipe.run_dir):
            run_dir = start_run(recipe, recipe.run_dir)
            atomic_write_json(run_dir / "results.json", out)
            atomic_write_text(run_dir / "results.md", table)
            record_config(recipe, run_dir)
        log.info("eval: wrote %s and results.md", Path(recipe.run_dir) / "results.json")
    return out


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: the results table."""
    return results_table([MetricResult(**r) for r in res.get("results", [])]).splitlines()


RECIPE = EvalRecipe
run = run_eval
