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
        lines += _stage_section(r, run_dir)
        lines.append("")
    atomic_write_text(run_dir / "report.md", "\n".join(lines))


def _stage_section(r: dict, run_dir: Path) -> list[str]:
    res = r.get("result") or {}
    verb = r["verb"]
    if verb == "tokenizer" and isinstance(res, dict):
        h = res.get("heldout") or {}
        out = [f"- vocabulary: {res.get('vocab_size')} tokens, trained on {res['train']['documents']} documents "
               f"({res['train']['chars'] / 1e6:.2f} M characters) in {res['train']['seconds']:.1f} s"]
        if h:
            out.append(f"- held-out compression: **{h['bytes_per_token']:.3f} bytes/token** "
                       f"({h['documents']} documents, {h['tokens']} tokens)")
        return out
    if verb == "prepare" and isinstance(res, dict):
        s = res.get("splits", {})
        return [f"- {res.get('n_docs')} documents, {res.get('n_tokens')} tokens ({res.get('dtype')}): "
                f"train {s.get('train', {}).get('n_tokens')} / val {s.get('val', {}).get('n_tokens')} tokens",
                f"- skipped records: {res.get('skipped', {}).get('total', 0)}"]
    if verb == "pretrain" and isinstance(res, dict):
        out = [f"- {res.get('params', 0) / 1e6:.2f} M parameters, {res.get('step')} steps of "
               f"{res.get('tokens_per_step')} tokens in {res.get('wall_s', 0):.0f} s"]
        if res.get("val_loss") is not None:
            out.append(f"- validation loss **{res['val_loss']:.4f}** nats/token ({res.get('val_bpb', float('nan')):.3f} "
                       f"bits/byte); unigram entropy of the data {res.get('unigram_entropy', float('nan')):.4f}")
        if res.get("tokens_per_s"):
            mfu = f", MFU {100 * res['mfu']:.1f}%" if res.get("mfu") else ""
            out.append(f"- throughput {res['tokens_per_s']:.0f} tokens/s{mfu}")
        plot = plot_losses(Path(r["run_dir"]), run_dir / f"{r['name']}-loss.png", res.get("unigram_entropy"))
        if plot:
            out += ["", f"![loss curve]({plot.name})"]
        return out
    if verb == "sft" and isinstance(res, dict):
        out = [f"- {res.get('train_examples')} training examples, {res.get('step')} steps in {res.get('wall_s', 0):.0f} s"
               f"{' (LoRA)' if res.get('lora') else ''}; model in `{res.get('final_checkpoint')}`"]
        skipped = (res.get("skipped") or {}).get("by_reason") or {}
        out.append(f"- examples skipped or truncated: {sum(skipped.values())} {skipped if skipped else ''}".rstrip())
        if res.get("val_loss") is not None:
            out.append(f"- validation loss **{res['val_loss']:.4f}** nats/token (assistant tokens)")
        before, after = res.get("exact_match_before"), res.get("exact_match_after")
        if before and after:
            out.append(f"- exact match on {after['examples']} validation tasks: **{100 * before['exact_match']:.1f}% before, "
                       f"{100 * after['exact_match']:.1f}% after**")
        plot = plot_losses(Path(r["run_dir"]), run_dir / f"{r['name']}-loss.png")
        if plot:
            out += ["", f"![loss curve]({plot.name})"]
        return out
    if verb == "generate" and isinstance(res, list):
        out = []
        for g in res:
            if isinstance(g, dict):
                out += [f"- prompt: `{g.get('prompt', '')!s}`", "", "  ```", *("  " + t for t in str(g.get("text", "")).splitlines()), "  ```"]
        return out
    return ["```json", json.dumps(res, indent=2)[:4000], "```"]


def plot_losses(stage_dir: Path, out: Path, unigram_entropy: float | None = None) -> Path | None:
    """Training and validation loss against step, from the stage's metrics.jsonl."""
    from lmforge.train.metrics import read_metrics

    records = read_metrics(stage_dir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss", linewidth=1)
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    if unigram_entropy:
        ax.axhline(unigram_entropy, color="gray", linestyle="--", linewidth=1, label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


RECIPE = LifecycleRecipe
run = run_lifecycle
