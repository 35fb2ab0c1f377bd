"""Run a lifecycle: a list of stages (verb + recipe + overrides) in order, each reading what
the previous ones wrote, then write report.md with every stage's results and the loss
curve (and, with ``report_card: {tasks: [...]}``, the same tasks scored on every stage's final
model, side by side: ``stages.report_card``). A stage is skipped when its marker says it completed with the same resolved config,
the files its config names (inputs, walked when folders) have the same sizes and times, and
its own outputs are still as it left them (and pass the stage's ``verify_outputs``, where it
has one: prepare hashes its shards); so a rerun after an interruption continues where
it stopped. Change a stage's recipe or inputs, or damage its outputs, and it (and every stage
after it) runs again.

With ``rounds: {count: k, stages: [...]}`` the same stages run k times after ``stages``, each
round reading what the one before left (Llama 2/3's post-training loop: sample with the last
round's model, rank by a reward or verifier, train on the result). The rounds are expanded
into ordinary stages before anything runs (``planned_stages``: round r's ``rs`` runs as
``rs_r<r>``, its placeholders replaced), so skipping and resuming work as for any stage.

  lmforge run recipes/demo/lifecycle.yaml
  lmforge run recipes/demo/lifecycle.yaml force=true      # rerun every stage
  lmforge run recipes/iterative/demo.yaml                 # k rounds of rs -> dpo
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.core.config import ConfigError, at_least, dump_config, load_config, option, plugins, to_dict
from lmforge.core.io import InputError, atomic_write_json, atomic_write_text, file_stamps, named_paths
from lmforge.core.run import HOLDER_FILE, LOCK_FILE, clear_run_dir, log, record_config, run_dir_lock, start_run
from lmforge.core.untrusted import path_name
from lmforge.stages import VERBS_BY_NAME
from lmforge.stages.report_card import ReportCardConfig, card_lines, check_stages, score_stages

MARKER = ".lmforge-complete.json"


@dataclass
class StageSpec:
    name: str = option(
        "",
        help="the stage's name, unique: its report row, its run_dir/<name> when its recipe sets no "
        "run_dir; default: its verb",
    )
    verb: str = option("", help="any `lmforge` verb with a recipe: tokenizer, prepare, pretrain, generate, ...")
    recipe: str | None = option(None, help="YAML recipe; None = the verb's defaults")
    overrides: list[str] = option(default_factory=list, help="key=value, as on the command line")


# ``{name}`` with an identifier inside, in a round stage's recipe path or overrides (YAML's
# ``{kind: regex}`` has a colon and a space, so it is no placeholder)
PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")
PLACEHOLDERS = {
    "round": "the round's number, 1 to count",
    "prev": "the previous round's number (0 in round 1)",
    "prev_model": "the model the previous round left (rounds.model; rounds.start in round 1)",
}


@dataclass
class RoundsConfig:
    """The lifecycle recipe's ``rounds:`` section: ``stages`` run ``count`` times, after the
    lifecycle's own ``stages``. Round r's stage ``name`` (default: its verb) runs as
    ``<name>_r<r>``, with ``{round}``, ``{prev}`` and ``{prev_model}`` replaced in its recipe path
    and overrides (``PLACEHOLDERS``), so round r's rs samples with round r-1's model."""

    count: int = at_least(0, 0, help="k, the number of rounds (>= 1 with stages; 0 and no stages: no rounds)")
    stages: list[StageSpec] = option(default_factory=list, help="the stages of one round, in order")
    model: str | None = option(
        None, help="where each round leaves its model, with {round}: a stage's run_dir, e.g. runs/it/r{round}/dpo"
    )
    start: str | None = option(
        None, help="the model round 1 starts from (its {prev_model}); scored on the report card as `start`"
    )


@dataclass
class PlannedStage:
    """One stage as it runs: a stage of ``stages``, or a round's copy with its placeholders replaced."""

    name: str
    spec: StageSpec
    round: int | None = None  # None: a stage of the lifecycle's own ``stages``


@dataclass
class LifecycleRecipe:
    run_dir: str = option(
        "runs/lifecycle",
        help="receives report.md, its figures (<stage>-loss.png; curate: <stage>-stats.png), lifecycle.json",
    )
    stages: list[StageSpec] = option(default_factory=list, help="the stages, run in order")
    rounds: RoundsConfig = option(
        default_factory=RoundsConfig, help="the same stages k times after `stages`, each round reading the one before"
    )
    force: bool = option(False, help="rerun stages even when their outputs are complete")
    report_card: ReportCardConfig = option(
        default_factory=ReportCardConfig,
        help="tasks scored on each stage's final model after the run, compared in report.md (stages.report_card)",
    )

    def __post_init__(self) -> None:
        planned_stages(self)  # a bad placeholder or a repeated name fails as the recipe is read, naming its file


# --------------------------------------------------------------------------- rounds


def planned_stages(recipe: LifecycleRecipe) -> list[PlannedStage]:
    """The stages in the order they run: ``stages``, then each round's copy of ``rounds.stages``.
    A ValueError names the key: a placeholder outside ``rounds.stages`` or unknown, ``{prev_model}``
    without ``rounds.start``/``rounds.model``, or two stages of one name."""
    planned = []
    for i, spec in enumerate(recipe.stages):
        for key, text in spec_texts(spec, f"stages[{i}]"):
            found = [m for m in PLACEHOLDER.findall(text) if m in PLACEHOLDERS]
            if found:
                raise ValueError(f"{key} = {text!r}: {{{found[0]}}} is replaced only in rounds.stages")
        planned.append(PlannedStage(path_name(spec.name or spec.verb, f"stages[{i}].name"), spec))
    planned += expand_rounds(recipe.rounds)
    seen: dict[str, str] = {}
    for p in planned:
        where = "stages" if p.round is None else f"round {p.round} of rounds.stages"
        if p.name in seen:
            raise ValueError(f"stage names must be unique: {p.name!r} is in {seen[p.name]} and in {where}")
        seen[p.name] = where
    if recipe.rounds.start is not None and "start" in seen:
        raise ValueError("a stage is named 'start', the report card's name for rounds.start: rename the stage")
    return planned


def expand_rounds(rounds: RoundsConfig) -> list[PlannedStage]:
    """Round 1 to ``count``'s copies of ``rounds.stages``, named ``<name>_r<round>``; none when
    ``rounds`` is left unset."""
    if rounds == RoundsConfig():
        return []
    if rounds.count < 1:
        raise ValueError(f"rounds.count = {rounds.count}: must be >= 1, the number of times rounds.stages run")
    if not rounds.stages:
        raise ValueError("rounds.stages is empty: list the stages each round runs (name, verb, recipe, overrides)")
    if rounds.model is not None and "{round}" not in rounds.model:
        raise ValueError(f"rounds.model = {rounds.model!r}: it must contain {{round}}, each round leaving its model "
                         "in a directory of its own")
    for key in ("model", "start"):
        value = getattr(rounds, key) or ""
        extra = [m for m in PLACEHOLDER.findall(value) if not (key == "model" and m == "round")]
        if extra:
            raise ValueError(f"rounds.{key} = {value!r}: {{{extra[0]}}} is not replaced here"
                             + (" (only {round} is)" if key == "model" else " (it names one model)"))
    out = []
    for r in range(1, rounds.count + 1):
        values = {"round": str(r), "prev": str(r - 1), "prev_model": previous_model(rounds, r)}
        for i, spec in enumerate(rounds.stages):
            key = f"rounds.stages[{i}]"
            if PLACEHOLDER.search(spec.name):
                raise ValueError(f"{key}.name = {spec.name!r}: takes no placeholder (round r's stage runs as "
                                 "<name>_r<r>)")
            recipe = substitute(spec.recipe, values, f"{key}.recipe") if spec.recipe is not None else None
            overrides = [substitute(o, values, f"{key}.overrides[{j}]") for j, o in enumerate(spec.overrides)]
            name = path_name(f"{spec.name or spec.verb}_r{r}", f"{key}.name")
            out.append(PlannedStage(name, StageSpec(name, spec.verb, recipe, overrides), r))
    return out


def previous_model(rounds: RoundsConfig, r: int) -> str | None:
    """Round r's ``{prev_model}``: ``rounds.start`` in round 1, else round r-1's ``rounds.model``."""
    if r == 1:
        return rounds.start
    return rounds.model.replace("{round}", str(r - 1)) if rounds.model is not None else None


def substitute(text: str, values: dict[str, str | None], key: str) -> str:
    """``text`` with each placeholder replaced by its value; an unknown one, or one without a value, is a ValueError."""
    def value(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            close = difflib.get_close_matches(name, list(PLACEHOLDERS), n=1, cutoff=0.5)
            hint = f"; did you mean {{{close[0]}}}?" if close else ""
            known = ", ".join(f"{{{p}}} ({what})" for p, what in PLACEHOLDERS.items())
            raise ValueError(f"{key} = {text!r}: unknown placeholder {{{name}}}{hint} (placeholders: {known})")
        if values[name] is None:
            raise ValueError(f"{key} = {text!r}: {{prev_model}} needs rounds.start (the model round 1 starts from) "
                             "and rounds.model (where each round leaves its model)")
        return values[name]

    return PLACEHOLDER.sub(value, text)


def spec_texts(spec: StageSpec, key: str) -> list[tuple[str, str]]:
    """A stage's texts that may hold placeholders, with their keys: its recipe path and overrides."""
    texts = [(f"{key}.recipe", spec.recipe)] if spec.recipe is not None else []
    return texts + [(f"{key}.overrides[{j}]", o) for j, o in enumerate(spec.overrides)]


def check_round_models(rounds: RoundsConfig, plans: list[tuple]) -> None:
    """Each round's ``rounds.model`` is one of its stages' run directories (or inside one), so the
    next round's ``{prev_model}`` is what this round trained (checked before any stage runs)."""
    if rounds.model is None:
        return
    for r in range(1, rounds.count + 1):
        model = Path(rounds.model.replace("{round}", str(r))).resolve()
        dirs = [stage_dir for planned, _, _, stage_dir in plans if planned.round == r]
        if not any(model == d.resolve() or d.resolve() in model.parents for d in dirs):
            raise ConfigError(f"rounds.model: round {r}'s model {model} is in none of round {r}'s stage run_dirs "
                              f"({', '.join(str(d) for d in dirs)}): set it to the run_dir of the stage that trains "
                              "the round's model")


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
    plans = resolve_stages(recipe)
    with run_dir_lock(recipe.run_dir):  # a second lifecycle into it fails at once, naming this one
        results = run_stages(recipe, plans)
    log.info("report: %s", Path(recipe.run_dir) / "report.md")
    return results


def resolve_stages(recipe: LifecycleRecipe) -> list[tuple]:
    """``(PlannedStage, module, config, stage_dir)`` of every stage in order, each config resolved
    and checked, so a typo in the last recipe fails before hours of work; nothing runs."""
    if not recipe.stages and not recipe.rounds.stages:
        raise ConfigError("stages is empty: list the stages to run (name, verb, recipe), or rounds: {count, stages}")
    try:
        planned = planned_stages(recipe)
    except ValueError as exc:  # a recipe built in Python, not read by load_config
        raise ConfigError(str(exc)) from exc
    plans = []
    for stage in planned:
        name, spec = stage.name, stage.spec
        if spec.verb == "run":
            raise ConfigError(f"stage {name!r}: verb 'run' cannot be a stage (a lifecycle inside a lifecycle): "
                              "list that lifecycle's stages here instead")
        if spec.verb not in VERBS_BY_NAME:
            verbs = [v for v in VERBS_BY_NAME if v != "run"]
            close = difflib.get_close_matches(str(spec.verb), verbs, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"stage {name!r}: unknown verb {spec.verb!r}{hint} (verbs: {', '.join(verbs)})")
        module = VERBS_BY_NAME[spec.verb].load()
        try:
            cfg = load_config(module.RECIPE, spec.recipe, spec.overrides)
        except ConfigError as exc:
            raise ConfigError(f"stage {name!r}: {exc}") from exc
        stage_dir = Path(getattr(cfg, "run_dir", None) or Path(recipe.run_dir) / name)
        plans.append((stage, module, cfg, stage_dir))
    check_round_models(recipe.rounds, plans)
    check_stages(recipe.report_card, [p.name for p in planned] + (["start"] if start_model(recipe, plans) else []))
    return plans


def stage_plugins(recipe: LifecycleRecipe) -> list[tuple[str, str]]:
    """Every plugin (``module:function``) the lifecycle's stages will import, keyed by stage:
    what ``lmforge run ... --print-config`` lists."""
    return [(f"{stage.name}: {key}", spec) for stage, _, cfg, _ in resolve_stages(recipe) for key, spec in plugins(cfg)]


def start_model(recipe: LifecycleRecipe, plans: list[tuple]) -> str | None:
    """``rounds.start`` when the report card should score it as its own column: no stage of the
    lifecycle wrote it (such a stage is scored under its own name)."""
    start = recipe.rounds.start
    if start is None:
        return None
    made = any(Path(start).resolve() == d.resolve() or d.resolve() in Path(start).resolve().parents
               for *_, d in plans)
    return None if made else start


def run_stages(recipe: LifecycleRecipe, plans: list[tuple]) -> list[dict]:
    """Each planned stage in order, skipped when complete, then lifecycle.json and report.md."""
    run_dir = start_run(recipe, recipe.run_dir)
    results = []
    upstream_ran = False
    for stage, module, cfg, stage_dir in plans:
        name, spec = stage.name, stage.spec
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
                results.append({**done, "status": "skipped", "round": stage.round})
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
            status = stop_status(result)
            if status == "ran":
                atomic_write_json(marker, entry)
            else:  # no marker: the next run resumes the stage, and reruns the stages after it
                log.warning("== %s (%s): %s, by a time limit (train.max_minutes or train.stop_at_step): the stages "
                            "after it run on a partly trained model; run the lifecycle again to finish it",
                            name, spec.verb, status)
        results.append({**entry, "status": status, "round": stage.round})
        upstream_ran = True
    card = score_stages(recipe.report_card, run_dir, results, start_model(recipe, plans))
    atomic_write_json(run_dir / "lifecycle.json", results)
    write_report(run_dir, results, card)
    record_config(recipe, run_dir)  # the lifecycle the report describes
    return results


def stop_status(result: Any) -> str:
    """``ran``, or ``stopped early at step N of M`` when the stage's training loop stopped at a
    time limit before its last step (its summary's ``stopped_early``)."""
    if isinstance(result, dict) and result.get("stopped_early"):
        return f"stopped early at step {result.get('step')} of {result.get('max_steps')}"
    return "ran"


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
    """report.md: the stages, the report card, then each stage's section (with rounds, under a
    heading per round, in order)."""
    rounds = any(r.get("round") is not None for r in results)
    lines = ["# lmforge run report", ""]
    lines += ["| stage | " + ("round | " if rounds else "") + "verb | status | seconds | outputs |",
              "|---|" + ("---|" if rounds else "") + "---|---|---|---|"]
    for r in results:
        cell = (f"{r['round'] if r.get('round') is not None else ''} | " if rounds else "")
        lines.append(f"| {r['name']} | {cell}{r['verb']} | {r['status']} | {r['seconds']:.1f} | `{r['run_dir']}` |")
    lines.append("")
    stopped = [r for r in results if r["status"].startswith("stopped early")]
    if stopped:
        named = ", ".join(f"{r['name']} ({r['status']})" for r in stopped)
        lines += [f"**Stopped early:** {named}, by a time limit: "
                  "its figures, and those of every stage after it, are of a partly trained model. Run the "
                  "lifecycle again: it resumes the stopped stage and reruns the stages after it.", ""]
    lines += card_lines(card or {}, {r["name"] for r in stopped})
    current = None
    for r in results:
        if r.get("round") is not None and r["round"] != current:
            current = r["round"]
            lines += [f"## round {current}", ""]
        lines += [f"{'###' if current is not None else '##'} {r['name']} ({r['verb']})", ""]
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
recipe_plugins = stage_plugins  # what --print-config lists for this verb
