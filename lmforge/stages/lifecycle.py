"""Run a lifecycle: a list of stages (verb + recipe + overrides) in order, each reading what
the previous ones wrote, then write report.md with every stage's results and the loss
curve (and, with ``report_card: {tasks: [...]}``, the same tasks scored on every stage's final
model, side by side: ``stages.report_card``). A stage is skipped when its marker says it completed with the same resolved config,
the files its config names (inputs, walked when folders) have the same sizes and times, and
its own outputs are still as it left them (and pass the stage's ``verify_outputs``, where it
has one: prepare hashes its shards); so a rerun after an interruption continues where
it stopped. Change a stage's recipe or inputs, or damage its outputs, and it (and every stage
after it) runs again.

  lmforge run recipes/demo/lifecycle.yaml
  lmforge run recipes/demo/lifecycle.yaml force=true      # rerun every stage
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.core.config import ConfigError, dump_config, load_config, to_dict
from lmforge.core.io import InputError, atomic_write_json, atomic_write_text, file_stamps, named_paths
from lmforge.core.run import HOLDER_FILE, LOCK_FILE, clear_run_dir, log, record_config, run_dir_lock, start_run
from lmforge.stages import VERBS_BY_NAME
from lmforge.stages.report_card import ReportCardConfig, card_lines, check_stages, score_stages

MARKER = ".lmforge-complete.json"


@dataclass
class StageSpec:
    name: str = ""
    verb: str = ""  # any `lmforge` verb with a recipe: tokenizer, prepare, pretrain, generate, ...
    recipe: str | None = None  # YAML recipe; None = the verb's defaults
    overrides: list[str] = field(default_factory=list)  # key=value, as on the command line


@dataclass
class LifecycleRecipe:
    run_dir: str = "runs/lifecycle"  # receives report.md, its figures (<stage>-loss.png; curate: <stage>-stats.png), lifecycle.json
    stages: list[StageSpec] = field(default_factory=list)
    force: bool = False  # rerun stages even when their outputs are complete
    # tasks scored on each stage's final model after the run, compared in report.md (stages.report_card)
    report_card: ReportCardConfig = field(default_factory=ReportCardConfig)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_jsonable(v) for v in value]
        return str(value)


def run_lifecycle(recipe: LifecycleRecipe) -> list[dict]:
    if not recipe.stages:
        raise ConfigError("stages is empty: list the stages to run (name, verb, recipe)")
    names = [s.name or s.verb for s in recipe.stages]
    if len(set(names)) != len(names):
        raise ConfigError(f"stage names must be unique, got {names}")
    # Resolve every stage's config first, so a typo in the last recipe fails before hours of work.
    plans = []
    for spec, name in zip(recipe.stages, names):
        if spec.verb not in VERBS_BY_NAME or spec.verb == "run":
            raise ConfigError(f"stage {name!r}: unknown verb {spec.verb!r} (verbs: {', '.join(VERBS_BY_NAME)})")
        module = VERBS_BY_NAME[spec.verb].load()
        try:
            cfg = load_config(module.RECIPE, spec.recipe, spec.overrides)
        except ConfigError as exc:
            raise ConfigError(f"stage {name!r}: {exc}") from exc
        plans.append((name, spec, module, cfg))
    check_stages(recipe.report_card, names)

    with run_dir_lock(recipe.run_dir):  # a second lifecycle into it fails at once, naming this one
        results = run_stages(recipe, plans)
    log.info("report: %s", Path(recipe.run_dir) / "report.md")
    return results


def run_stages(recipe: LifecycleRecipe, plans: list[tuple]) -> list[dict]:
    """Each planned stage in order, skipped when complete, then lifecycle.json and report.md."""
    run_dir = start_run(recipe, recipe.run_dir)
    results = []
    upstream_ran = False
    for name, spec, module, cfg in plans:
        stage_dir = Path(getattr(cfg, "run_dir", None) or run_dir / name)
        if stage_dir.resolve() == run_dir.resolve():
            raise ConfigError(f"stage {name!r}: its run_dir must differ from the lifecycle's run_dir {run_dir}")
        digest = hashlib.sha256(dump_config(cfg).encode()).hexdigest()
        named = named_paths(to_dict(cfg), skip_keys=("run_dir",))
        inputs = inventory_digest(named, exclude=[stage_dir, *lock_files(named)])
        with run_dir_lock(stage_dir):  # held from the check of its outputs to its marker
            marker = stage_dir / MARKER
            done = read_marker(marker)
            stale = done is not None and staleness(done, digest, inputs, stage_dir)
            reuse = done is not None and not stale and not upstream_ran and not recipe.force
            if reuse:  # the stamps agree; a stage that can check its outputs' contents does so too
                stale = outputs_problem(module, cfg)
                reuse = stale is None
            if reuse:
                log.info("== %s (%s): complete, skipped (outputs in %s)", name, spec.verb, stage_dir)
                results.append({**done, "status": "skipped"})
                continue
            if done is not None:
                # Complete outputs of another config, of other inputs or damaged since: start the stage
                # afresh rather than resume from them. Outputs without a marker are an interrupted run and are resumed.
                why = stale or ("an earlier stage ran again" if upstream_ran else "force=true")
                log.info("== %s (%s): outputs in %s are stale (%s); removing them", name, spec.verb, stage_dir, why)
                clear_run_dir(stage_dir)
            log.info("== %s (%s)", name, spec.verb)
            t0 = time.perf_counter()
            result = module.run(cfg)
            entry = {
                "name": name,
                "verb": spec.verb,
                "run_dir": str(stage_dir),
                "config_sha256": digest,
                "inputs_sha256": inputs,
                "seconds": round(time.perf_counter() - t0, 2),
                "result": _jsonable(result),
            }
            entry["outputs_sha256"] = outputs_digest(stage_dir)
            atomic_write_json(marker, entry)
        results.append({**entry, "status": "ran"})
        upstream_ran = True
    card = score_stages(recipe.report_card, run_dir, results)
    atomic_write_json(run_dir / "lifecycle.json", results)
    write_report(run_dir, results, card)
    record_config(recipe, run_dir)  # the lifecycle the report describes
    return results


# --------------------------------------------------------------------------- is a stage complete?


def read_marker(marker: Path) -> dict | None:
    try:
        done = json.loads(marker.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # a damaged marker: the stage is treated as stale
    return done if isinstance(done, dict) else {}


def staleness(done: dict, config_digest: str, inputs_digest: str, stage_dir: Path) -> str | None:
    """Why a completed stage's outputs no longer stand, or None when they do."""
    if done.get("config_sha256") != config_digest:
        return "its config changed"
    if done.get("inputs_sha256") != inputs_digest:
        return "files its config names changed"
    if done.get("outputs_sha256") != outputs_digest(stage_dir):
        return "its outputs were changed or removed"
    return None


def outputs_digest(stage_dir: Path) -> str:
    """``inventory_digest`` of a stage's outputs: all of its run directory but the marker and the lock."""
    return inventory_digest([stage_dir], exclude=[stage_dir / MARKER, *lock_files([stage_dir])])


def lock_files(paths: list[Path]) -> list[Path]:
    """The run-directory lock files that folders among ``paths`` may hold: they come and go with
    the runs that write there (a stage that replaces its directory drops them), not with the outputs."""
    return [path / name for path in paths for name in (LOCK_FILE, HOLDER_FILE)]


def outputs_problem(module: Any, cfg: Any) -> str | None:
    """Why a completed stage's outputs fail the stage's own ``verify_outputs(cfg)`` (prepare hashes
    its shards: a file changed in place with its size and time put back passes the stamps), or None."""
    verify = getattr(module, "verify_outputs", None)
    if verify is None:
        return None
    try:
        verify(cfg)
    except InputError as exc:
        log.warning("%s", exc)
        return f"its outputs fail verification: {exc}"
    return None


def inventory_digest(paths: list[Path], exclude: list[Path]) -> str:
    """sha256 of ``file_stamps``: the size and time of every file under ``paths`` but ``exclude``."""
    return hashlib.sha256(json.dumps(file_stamps(paths, exclude)).encode()).hexdigest()


# --------------------------------------------------------------------------- report


def write_report(run_dir: Path, results: list[dict], card: dict | None = None) -> None:
    lines = ["# lmforge run report", ""]
    lines += ["| stage | verb | status | seconds | outputs |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['verb']} | {r['status']} | {r['seconds']:.1f} | `{r['run_dir']}` |")
    lines.append("")
    lines += card_lines(card or {})
    for r in results:
        lines += [f"## {r['name']} ({r['verb']})", ""]
        lines += stage_report(r, run_dir)
        lines.append("")
    atomic_write_text(run_dir / "report.md", "\n".join(lines))


def stage_report(r: dict, run_dir: Path) -> list[str]:
    """The stage module's ``report(result, stage_dir, plot_path)`` lines, or the result as JSON."""
    report = getattr(VERBS_BY_NAME[r["verb"]].load(), "report", None)
    if report is not None and r.get("result") is not None:
        return report(r["result"], Path(r["run_dir"]), run_dir / f"{r['name']}-loss.png")
    return ["```json", json.dumps(r.get("result"), indent=2)[:4000], "```"]


RECIPE = LifecycleRecipe
run = run_lifecycle
