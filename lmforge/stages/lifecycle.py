"""Run a lifecycle: a list of stages (verb + recipe + overrides) in order, each reading what
the previous ones wrote, then write report.md with every stage's results and the loss
curve. A stage whose outputs are complete for the same resolved config is skipped, so a
rerun after an interruption continues where it stopped; change a stage's recipe and it
(and every stage after it) runs again.

  lmforge run recipes/demo/lifecycle.yaml
  lmforge run recipes/demo/lifecycle.yaml force=true      # rerun every stage
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.core.config import ConfigError, dump_config, load_config
from lmforge.core.io import atomic_write_json, atomic_write_text
from lmforge.core.run import log, start_run
from lmforge.stages import VERBS_BY_NAME

MARKER = ".lmforge-complete.json"


@dataclass
class StageSpec:
    name: str = ""
    verb: str = ""  # any `lmforge` verb with a recipe: tokenizer, prepare, pretrain, generate, ...
    recipe: str | None = None  # YAML recipe; None = the verb's defaults
    overrides: list[str] = field(default_factory=list)  # key=value, as on the command line


@dataclass
class LifecycleRecipe:
    run_dir: str = "runs/lifecycle"  # receives report.md, loss.png and lifecycle.json
    stages: list[StageSpec] = field(default_factory=list)
    force: bool = False  # rerun stages even when their outputs are complete


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

    run_dir = start_run(recipe, recipe.run_dir)
    results = []
    upstream_ran = False
    for name, spec, module, cfg in plans:
        stage_dir = Path(getattr(cfg, "run_dir", None) or run_dir / name)
        if stage_dir.resolve() == run_dir.resolve():
            raise ConfigError(f"stage {name!r}: its run_dir must differ from the lifecycle's run_dir {run_dir}")
        digest = hashlib.sha256(dump_config(cfg).encode()).hexdigest()
        marker = stage_dir / MARKER
        done = json.loads(marker.read_text()) if marker.exists() else None
        if done and done.get("config_sha256") == digest and not upstream_ran and not recipe.force:
            log.info("== %s (%s): complete, skipped (outputs in %s)", name, spec.verb, stage_dir)
            results.append({**done, "status": "skipped"})
            continue
        if done:
            # Complete outputs of another config (or of stale inputs): start the stage afresh rather
            # than resume from them. Outputs without a marker are an interrupted run and are resumed.
            log.info("== %s (%s): outputs in %s are stale; removing them", name, spec.verb, stage_dir)
            shutil.rmtree(stage_dir)
        log.info("== %s (%s)", name, spec.verb)
        t0 = time.perf_counter()
        result = module.run(cfg)
        entry = {
            "name": name,
            "verb": spec.verb,
            "run_dir": str(stage_dir),
            "config_sha256": digest,
            "seconds": round(time.perf_counter() - t0, 2),
            "result": _jsonable(result),
        }
        stage_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(marker, entry)
        results.append({**entry, "status": "ran"})
        upstream_ran = True
    atomic_write_json(run_dir / "lifecycle.json", results)
    write_report(run_dir, results)
    log.info("report: %s", run_dir / "report.md")
    return results


# --------------------------------------------------------------------------- report


def write_report(run_dir: Path, results: list[dict]) -> None:
    lines = ["# lmforge run report", ""]
    lines += ["| stage | verb | status | seconds | outputs |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['verb']} | {r['status']} | {r['seconds']:.1f} | `{r['run_dir']}` |")
    lines.append("")
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
