"""Sweep: a grid of pre-training runs from one pretrain recipe, for scaling laws. Each grid point
is a run of `lmforge pretrain` in its own run directory under run_dir, named from the point, so a
rerun skips the finished runs (final checkpoint and summary at the last step, same recipe) and
resumes the interrupted ones from their newest checkpoint. Two grids:

- grid: tokens: every model size x every token budget D (`tokens`), steps = D / tokens per step;
- grid: isoflop: every FLOP budget C (`flops`) x every model size, steps = C / (FLOPs per token x
  tokens per step): IsoFLOP profiles (Hoffmann et al. 2022, approach 2).

FLOPs per token are the training loop's (MFU's): 6 x matmul parameters + attention. Model sizes
are preset names or mappings of ModelConfig fields over the pretrain recipe's `model:` section
(a mapping naming `preset` replaces that section), each with an optional `name`. A budget listed
twice, or two grid points that resolve to one run directory or one recipe, are refused: they would
train one run twice and count its row twice in a fit. Runs go one
after another in this process, or max_parallel at once as independent processes (logs in
run_dir/logs). Then run_dir/runs.csv (run,params,tokens,flops,loss: params = non-embedding N,
tokens and flops = the run's D and C, loss = final validation loss in nats per token),
run_dir/curves.csv (run,step,params,tokens,flops,loss: every validation of every run) and
run_dir/sweep.json (each run's grid point and status), the input of `lmforge scaling fit`.

  lmforge sweep recipes/scaling/cpu_isoflop.yaml
  lmforge sweep recipes/scaling/cpu_isoflop.yaml max_parallel=2 run_dir=runs/isoflop2
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lmforge.checkpoints.load import checkpoint_dir, latest_valid_checkpoint
from lmforge.core.config import (
    ConfigError,
    apply_override,
    from_dict,
    load_config,
    option,
    positive,
    save_config,
    to_dict,
    unit_interval,
)
from lmforge.core.io import InputError, atomic_write_json, atomic_write_text, check_output_dir, read_json
from lmforge.core.run import log, record_config, run_dir_lock, start_run
from lmforge.core.untrusted import path_name, read_yaml
from lmforge.data.shards import read_manifest
from lmforge.model.config import ModelConfig
from lmforge.model.families import PRESETS
from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
from lmforge.train.loop import accumulation_steps
from lmforge.train.metrics import read_metrics
from lmforge.train.step_log import format_eta

RUNS_CSV, CURVES_CSV, SWEEP_JSON = "runs.csv", "curves.csv", "sweep.json"
RUN_COLUMNS = ("run", "params", "tokens", "flops", "loss")
CURVE_COLUMNS = ("run", "step", "params", "tokens", "flops", "loss")
# keys that say how a run is driven, not what it computes: changing them resumes a sweep's runs
RUN_ONLY_KEYS = {"train.max_minutes", "train.stop_at_step", "train.log_every", "train.tensorboard", "train.loggers"}
SHORT_KEYS = {"d_model": "d", "n_layers": "l", "n_heads": "h", "n_kv_heads": "kv", "ffn_hidden": "f", "head_dim": "hd"}


@dataclass
class SweepRecipe:
    run_dir: str = option("runs/sweep", help="each run in run_dir/<name>; runs.csv, curves.csv, sweep.json beside them")
    pretrain: str = option("recipes/demo/pretrain.yaml", help="the pretrain recipe every run starts from")
    overrides: list[str] = option(
        default_factory=list, help="dotted overrides of that recipe for every run (train.eval_every=25)"
    )
    models: list[str | dict[str, Any]] = option(
        default_factory=list,
        help="model sizes: a preset name, or a mapping of ModelConfig fields over the recipe's model section "
        "(with `preset`: that preset and these fields instead) and an optional `name` for the runs",
    )
    grid: Literal["isoflop", "tokens"] = option("isoflop", help="isoflop: flops x models; tokens: models x tokens")
    flops: list[float] = positive(default_factory=list, help="isoflop: the FLOP budgets C, one run per budget and size")
    tokens: list[float] = positive(default_factory=list, help="tokens grid: the token budgets D of each size")
    warmup_fraction: float | None = unit_interval(
        None, help="warm-up as a share of each run's steps; None: train.warmup_steps"
    )
    max_parallel: int = positive(1, help="runs at once; 1: one after another in this process, more: a process each")


@dataclass
class SweepRun:
    """One grid point: its run's recipe and what it spends."""

    name: str
    size: str  # the model size's name
    budget: dict[str, float]  # {"flops": C} or {"tokens": D}: the grid point asked for
    recipe: PretrainRecipe
    params: int  # non-embedding parameters N
    flops_per_token: int
    steps: int
    tokens: int  # D: steps x tokens per step
    status: str = "new"  # new | partial | finished | unfinished (stopped early) | failed

    @property
    def flops(self) -> int:
        return self.flops_per_token * self.tokens

    @property
    def run_dir(self) -> Path:
        return Path(self.recipe.run_dir)


def non_embedding_params(cfg: ModelConfig) -> int:
    """Kaplan et al.'s N: every parameter but the vocabulary matrices (token embedding and output head)."""
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return cfg.num_params(include_embedding=False) - head


def compact(x: float) -> str:
    """A number for a run name: ``1e12``, ``3.5e12``, ``2048``."""
    return re.sub(r"e\+?(-?)0*(\d)", r"e\1\2", f"{x:.4g}")


# --------------------------------------------------------------------------- the grid


def pretrain_data(sweep: SweepRecipe) -> dict:
    """The pretrain recipe as written, with the sweep's overrides (checked as a recipe first, so an
    error names the recipe file or the override)."""
    load_config(PretrainRecipe, sweep.pretrain, sweep.overrides, overrides_label="sweep override")
    data = read_yaml(sweep.pretrain) or {}
    for item in sweep.overrides:
        apply_override(data, item)
    return data


def model_sizes(sweep: SweepRecipe, base_model: dict) -> list[tuple[str, dict]]:
    """(name, the model section of its runs) for each of ``sweep.models``."""
    if not sweep.models:
        raise InputError(f"sweep models is empty: list model sizes (preset names such as {', '.join(PRESETS)}, or "
                         "mappings of model fields such as {d_model: 64, n_layers: 2})")
    sizes, names = [], {}
    for i, entry in enumerate(sweep.models):
        entry = {"preset": entry} if isinstance(entry, str) else dict(entry)
        if entry.get("preset") is not None and entry["preset"] not in PRESETS:
            raise InputError(f"sweep models[{i}]: unknown model preset {entry['preset']!r}; choose one of "
                             f"{', '.join(PRESETS)}")
        name = path_name(str(entry.pop("name", None) or default_size_name(entry)), f"sweep models[{i}].name")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", name):
            raise InputError(f"sweep models[{i}].name = {name!r} must be letters, digits and _.+- (it names run directories)")
        if name in names:
            raise InputError(f"sweep models[{i}] and models[{names[name]}] are both named {name!r}: give one a `name`")
        names[name] = i
        sizes.append((name, entry if "preset" in entry else {**base_model, **entry}))
    return sizes


def default_size_name(entry: dict) -> str:
    """``tiny``, ``d64-l2``, ``tiny-d128``: the preset and the fields a size sets (not those it unsets)."""
    parts = [str(entry["preset"])] if entry.get("preset") else []
    parts += [f"{SHORT_KEYS.get(k, k)}{v}" for k, v in entry.items() if k != "preset" and v is not None]
    return "-".join(parts) or "base"


def build_grid(sweep: SweepRecipe) -> list[SweepRun]:
    """Every run of the sweep, each recipe built and checked; a clear error for a bad grid."""
    budgets_key, other_key = ("flops", "tokens") if sweep.grid == "isoflop" else ("tokens", "flops")
    budgets = getattr(sweep, budgets_key)
    if not budgets:
        raise InputError(f"sweep grid {sweep.grid} needs {budgets_key}: list the {budgets_key} budgets of the runs")
    if getattr(sweep, other_key):
        raise InputError(f"sweep {other_key} is set but grid is {sweep.grid}, which reads {budgets_key} only "
                         f"(set grid: {other_key} to sweep {other_key} budgets)")
    check_distinct_budgets(budgets, budgets_key)
    data = pretrain_data(sweep)
    runs, points = [], {}
    for size, model in model_sizes(sweep, data.get("model") or {}):
        for i, budget in enumerate(budgets):
            name = f"C{compact(budget)}-{size}" if sweep.grid == "isoflop" else f"{size}-D{compact(budget)}"
            path_name(name, f"sweep {budgets_key}[{i}] x models entry {size!r}")
            run = grid_run(sweep, data, size, model, budgets_key, budget, name)
            check_distinct_point(run, f"{budgets_key}[{i}] = {budget:g}", points)
            runs.append(run)
    runs.sort(key=lambda r: (r.budget[budgets_key], r.params))
    check_validation_split(runs[0].recipe)
    return runs


def check_distinct_budgets(budgets: list[float], key: str) -> None:
    """A budget listed twice would be one run directory trained twice (and its row counted twice)."""
    seen: dict[float, int] = {}
    for i, budget in enumerate(budgets):
        if budget in seen:
            raise InputError(f"sweep {key}[{i}] = {budget:g} repeats {key}[{seen[budget]}]: each grid point is one "
                             f"run; remove the repeat")
        seen[budget] = i


def check_distinct_point(run: SweepRun, where: str, points: dict) -> None:
    """Refuse a grid point that names the run directory of an earlier one, or that trains the same
    recipe (budgets or sizes that differ as written but resolve to one run): either would train
    one run twice, and a fit would count it twice. ``points`` holds the points seen so far."""
    recipe = to_dict(run.recipe)
    recipe.pop("run_dir")
    for key in (("dir", run.name), ("recipe", json.dumps(recipe, sort_keys=True, default=str))):
        if key in points:
            earlier, other = points[key]
            what = "names the run directory" if key[0] == "dir" else "resolves to the same run as"
            raise InputError(f"sweep {where} (models entry {run.size!r}) {what} {earlier.name} ({other}, "
                             f"{earlier.steps} steps): each grid point must be a distinct run; remove one of them")
        points[key] = (run, where)


def grid_run(sweep: SweepRecipe, data: dict, size: str, model: dict, kind: str, budget: float, name: str) -> SweepRun:
    """The run of one grid point: its model, its step count for the budget, its run directory."""
    where = f"sweep run {name} (models entry {size!r} over {sweep.pretrain})"
    base = from_dict(PretrainRecipe, {**data, "model": model}, source=where)
    cfg = base.train
    tokens_per_step = accumulation_steps(cfg, cfg.micro_batch_size * base.data.seq_len) * cfg.micro_batch_size \
        * base.data.seq_len
    fpt = base.model.flops_per_token(base.data.seq_len)
    exact = budget / (fpt * tokens_per_step) if kind == "flops" else budget / tokens_per_step
    steps = round(exact)
    if steps < 1:
        spent = f"{fpt * tokens_per_step:.3g} FLOPs" if kind == "flops" else f"{tokens_per_step} tokens"
        raise InputError(f"{where}: the budget {kind} = {budget:.3g} buys {exact:.2f} optimizer steps, but one step "
                         f"spends {spent} ({tokens_per_step} tokens); raise the budget, take a smaller model or "
                         "lower train.batch_tokens")
    warmup = round(sweep.warmup_fraction * steps) if sweep.warmup_fraction is not None else cfg.warmup_steps
    if warmup > steps:
        raise InputError(f"{where}: {steps} steps, fewer than train.warmup_steps = {warmup}; set warmup_fraction "
                         "(a share of each run's steps) or lower train.warmup_steps")
    train = {**(data.get("train") or {}), "max_steps": steps, "warmup_steps": warmup, "resume": "auto"}
    recipe = from_dict(PretrainRecipe, {**data, "model": model, "train": train,
                                        "run_dir": str(Path(sweep.run_dir) / name)}, source=where)
    return SweepRun(name, size, {kind: budget}, recipe, non_embedding_params(recipe.model), fpt, steps,
                    steps * tokens_per_step)


def check_validation_split(recipe: PretrainRecipe) -> None:
    """A sweep reads each run's validation losses: the first dataset needs a validation split."""
    if not recipe.data.datasets:
        raise InputError("data.datasets of the pretrain recipe is empty: list a directory written by `lmforge prepare`")
    path = recipe.data.datasets[0].path
    if read_manifest(path)["splits"]["val"]["n_tokens"] <= recipe.data.seq_len:
        raise InputError(f"{path}: the validation split is shorter than one window of {recipe.data.seq_len} tokens; "
                         "a sweep needs validation losses (prepare with a larger val_fraction)")


# --------------------------------------------------------------------------- the runs


def run_status(run: SweepRun) -> str:
    """``finished`` (its summary and a valid final checkpoint at the last step), ``partial`` (begun)
    or ``new``. A run directory trained with another recipe (other than in ``RUN_ONLY_KEYS``) is
    an error, never reused."""
    config = run.run_dir / "config.yaml"
    if not config.exists():
        return "new"
    stored, wanted = normalised(read_yaml(config), config), to_dict(run.recipe)
    differing = [k for k in changed_keys(stored or {}, wanted) if k not in RUN_ONLY_KEYS]
    if differing:
        keys = ", ".join(differing[:6])
        raise InputError(f"{run.run_dir} was trained with another recipe (differing: {keys}); remove it, or sweep "
                         "into another run_dir")
    summary_path = run.run_dir / "summary.json"
    summary = read_json(summary_path) if summary_path.exists() else {}
    if summary.get("step") == run.steps and latest_valid_checkpoint(run.run_dir) == checkpoint_dir(run.run_dir, run.steps):
        return "finished"
    return "partial"


def normalised(stored: Any, path: Path) -> Any:
    """A stored run config read through today's recipe schema, so that an option added to lmforge
    after the run began counts as its default, not as a change. Left as read where it no longer
    parses (then the comparison names what differs)."""
    try:
        return to_dict(from_dict(PretrainRecipe, stored, source=str(path)))
    except (ConfigError, TypeError, ValueError):
        return stored or {}


def changed_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested mappings."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [prefix.rstrip(".") or "(the recipe)"] if a != b else []
    return [k for key in sorted(set(a) | set(b), key=str) for k in changed_keys(a.get(key), b.get(key), f"{prefix}{key}.")]


class Progress:
    """Console lines of the sweep: run i/n, and an ETA from the FLOPs trained so far."""

    def __init__(self, runs: list[SweepRun]):
        self.total = len(runs)
        self.flops_left = sum(r.flops for r in runs if r.status != "finished")
        self.flops_done, self.started = 0, time.perf_counter()
        self.finished = self.begun = sum(r.status == "finished" for r in runs)
        self.lock = threading.Lock()

    def eta(self) -> str:
        if not self.flops_done or self.flops_left <= 0:
            return ""
        rate = self.flops_done / (time.perf_counter() - self.started)
        return f", eta {format_eta(self.flops_left / rate)}"

    def starting(self, run: SweepRun) -> None:
        with self.lock:  # the threads that launch parallel runs
            self.begun += 1
        how = "resuming" if run.status == "partial" else "starting"
        log.info("sweep: run %d/%d %s (%s): N %.3g, %d steps, D %.3g tokens, C %.3g FLOPs%s", self.begun, self.total,
                 run.name, how, run.params, run.steps, run.tokens, run.flops, self.eta())

    def done(self, run: SweepRun) -> None:
        self.flops_done += run.flops
        self.flops_left -= run.flops
        self.finished += run.status == "finished"
        log.info("sweep: %s %s; %d/%d runs finished%s", run.name, run.status, self.finished, self.total, self.eta())


def train_in_process(run: SweepRun) -> None:
    run_pretrain(run.recipe)


def train_in_subprocess(run: SweepRun, recipe_path: Path, log_path: Path, threads: int, progress: Progress) -> None:
    """``lmforge pretrain`` on the run's recipe in its own process (``threads`` threads unless
    ``OMP_NUM_THREADS`` says), its output in ``log_path``."""
    progress.starting(run)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    with open(log_path, "ab") as out:
        proc = subprocess.run([sys.executable, "-m", "lmforge", "pretrain", str(recipe_path)], stdout=out,
                              stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise InputError(f"{run.name}: lmforge pretrain exited with {proc.returncode}; see {log_path}")


def train_runs(sweep: SweepRecipe, todo: list[SweepRun], progress: Progress) -> list[str]:
    """Train ``todo`` (one after another, or ``max_parallel`` processes at once); the errors of failed runs."""
    def finish(run: SweepRun, failed: bool = False) -> None:
        run.status = "failed" if failed else "finished" if run_status(run) == "finished" else "unfinished"
        progress.done(run)

    if sweep.max_parallel == 1:
        for run in todo:
            progress.starting(run)
            train_in_process(run)
            finish(run)
        return []
    root = Path(sweep.run_dir)
    (root / "logs").mkdir(exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // sweep.max_parallel)
    errors = []
    with ThreadPoolExecutor(sweep.max_parallel) as pool:
        futures = {}
        for run in sorted(todo, key=lambda r: (-r.flops, r.params)):  # the longest first, so the last ones are short
            recipe_path = save_config(run.recipe, root / "recipes", f"{run.name}.yaml")
            log_path = root / "logs" / f"{run.name}.log"
            futures[pool.submit(train_in_subprocess, run, recipe_path, log_path, threads, progress)] = run
        for future in as_completed(futures):
            run = futures[future]
            try:
                future.result()
            except InputError as exc:
                errors.append(str(exc))
            finish(run, failed=future.exception() is not None)
    return errors


# --------------------------------------------------------------------------- the results


def run_rows(run: SweepRun) -> tuple[dict | None, list[dict]]:
    """The run's row of runs.csv (its final validation loss; None until it finished) and its curve."""
    curve = [{"run": run.name, "step": r["step"], "params": run.params, "tokens": r["tokens"],
              "flops": run.flops_per_token * r["tokens"], "loss": r["val_loss"]}
             for r in read_metrics(run.run_dir) if "val_loss" in r]
    final = [row for row in curve if row["step"] == run.steps]
    if run.status != "finished" or not final:
        return None, curve
    return {"run": run.name, "params": run.params, "tokens": run.tokens, "flops": run.flops,
            "loss": final[-1]["loss"]}, curve


def csv_text(columns: tuple[str, ...], rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def write_results(sweep: SweepRecipe, runs: list[SweepRun]) -> list[dict]:
    """runs.csv, curves.csv and sweep.json in the sweep's run directory; the rows of runs.csv."""
    root = Path(sweep.run_dir)
    rows, curves, points = [], [], []
    for run in runs:
        row, curve = run_rows(run)
        rows += [row] if row else []
        curves += curve
        summary = read_json(run.run_dir / "summary.json") if (run.run_dir / "summary.json").exists() else {}
        points.append({"run": run.name, "model": run.size, **run.budget, "status": run.status, "steps": run.steps,
                       "params": run.params, "flops_per_token": run.flops_per_token, "tokens": run.tokens,
                       "flops": run.flops, "loss": row["loss"] if row else None,
                       **{k: summary[k] for k in ("wall_s", "tokens_per_s", "noise_scale") if k in summary}})
    atomic_write_text(root / RUNS_CSV, csv_text(RUN_COLUMNS, rows))
    atomic_write_text(root / CURVES_CSV, csv_text(CURVE_COLUMNS, curves))
    atomic_write_json(root / SWEEP_JSON, {"grid": sweep.grid, "pretrain": sweep.pretrain, "runs": points})
    return rows


def run_sweep(sweep: SweepRecipe) -> dict:
    check_output_dir(sweep.run_dir, "run_dir")
    try:
        runs = build_grid(sweep)
    except ConfigError as exc:
        raise InputError(str(exc)) from exc
    with run_dir_lock(sweep.run_dir):
        start_run(sweep, sweep.run_dir)
        for run in runs:
            run.status = run_status(run)
        todo = [r for r in runs if r.status != "finished"]
        log.info("sweep: %d runs (%s grid) in %s: %d finished, %d to resume, %d new; %.3g FLOPs to train",
                 len(runs), sweep.grid, sweep.run_dir, len(runs) - len(todo), sum(r.status == "partial" for r in todo),
                 sum(r.status == "new" for r in todo), sum(r.flops for r in todo))
        for run in runs:
            if run.status == "finished":
                log.info("sweep: %s finished already: skipped", run.name)
        errors = train_runs(sweep, todo, Progress(runs))
        rows = write_results(sweep, runs)
        record_config(sweep, sweep.run_dir)
    for row in rows:
        log.info("sweep: %-28s N %9.3g  D %9.3g  C %9.3g  val loss %.4f", row["run"], row["params"], row["tokens"],
                 row["flops"], row["loss"])
    log.info("sweep: %d of %d runs in %s", len(rows), len(runs), Path(sweep.run_dir) / RUNS_CSV)
    unfinished = [r.name for r in runs if r.status == "unfinished"]
    if errors or unfinished:
        raise InputError("; ".join(errors + ([f"stopped before their last step (max_minutes or stop_at_step): "
                                              f"{', '.join(unfinished)}; rerun the sweep to resume them"]
                                             if unfinished else [])))
    return {"runs": rows, "n_runs": len(runs)}


RECIPE = SweepRecipe
run = run_sweep
