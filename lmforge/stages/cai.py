"""Constitutional AI (Bai et al. 2022): a critic or judge applies a written constitution.

`lmforge cai revise RECIPE.yaml` (SL-CAI): the policy (`checkpoint`) answers each prompt once,
then for `revise.rounds` rounds the critic (`judge`) critiques the response against a principle
drawn from the constitution and revises it. Writes `run_dir/sft.jsonl`, TRL `messages` of the
final revisions (or `prompt`/`completion` for plain prompts), which `lmforge sft` reads, and
`run_dir/trace.jsonl`, every round of every prompt (prompt, response, principle, critique,
revision) for audit.

`lmforge cai label RECIPE.yaml` (RL-CAI, RLAIF): the policy samples `rollout.n` >= 2 responses
per prompt; every pair of distinct non-empty responses is judged on a drawn principle's
comparison question in both orders (`lmforge.feedback.labels`: soft labels from the judge's
log-probs, averaged over the two orders). Writes `run_dir/pairs.jsonl`, `prompt`/`chosen`/
`rejected` with `confidence` (the balanced soft label, in [0.5, 1]) and `margin` (its log-odds),
which `lmforge dpo` and `lmforge reward` read; pairs below `label.threshold` are dropped and
counted. `run_dir/judgements.jsonl` keeps every sample and both orders' answers.

The judge is an lmforge checkpoint in process (`judge.checkpoint`), any OpenAI-compatible
endpoint (`judge.base_url`, `judge.model`, the key in the environment variable
`judge.api_key_env`; `lmforge serve` is one), or a Python callable (`judge.function`), see
`lmforge.feedback.judges`. Prompts are JSONL/Parquet with `prompt` or `messages` (a final
assistant turn, a reference answer, is dropped from the prompt), read as `lmforge rs` reads them.

**Resuming.** Work goes in chunks of `prompts_per_chunk` prompts: sampled through the engine in
one batch, judged in one batch, then appended (and fsync'd) to the trace or judgements file, one
line per prompt. A rerun skips the prompts already there (a line cut short by a kill is dropped
and that prompt done again): each prompt's samples and draws are seeded by its index, so the
result is the uninterrupted run's. The outputs (`sft.jsonl`, `pairs.jsonl`, `summary.json`)
are rebuilt from the whole file and written atomically; changing `label.threshold` and
rerunning judges nothing. An endpoint's answers are also cached in `run_dir/judge-cache`.

  lmforge cai revise recipes/demo/cai_revise.yaml
  lmforge cai label recipes/demo/cai_label.yaml
  lmforge cai label recipes/demo/cai_label.yaml judge.checkpoint=null \
      judge.base_url=https://api.openai.com/v1 judge.model=gpt-4o-mini run_dir=runs/demo/cai-label-api
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Literal

import torch

from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.load import load_model, resolve_checkpoint
from lmforge.core.config import ConfigError, load_config, option, positive, seed_field, unit_interval
from lmforge.core.io import InputError, atomic_write_json, atomic_write_text
from lmforge.core.run import log, progress_bar, record_config, run_dir_lock, start_run
from lmforge.data.documents import SkipLog
from lmforge.data.tokenizer import Tokenizer
from lmforge.feedback.constitution import Constitution, load_constitution
from lmforge.feedback.judges import Judge, JudgeConfig, build_judge
from lmforge.feedback.labels import PairToJudge, judge_pairs, pair_output
from lmforge.feedback.revise import ToRevise, draw_principle, revise
from lmforge.rl.prompts import Prompt, read_prompts
from lmforge.rl.rollout import Rollout, RolloutConfig, RolloutState, sample_rollouts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOGS = {"revise": "trace.jsonl", "label": "judgements.jsonl"}
OUTPUTS = {"revise": "sft.jsonl", "label": "pairs.jsonl"}
CACHE = "judge-cache"


@dataclass
class CAIDataConfig:
    prompts: list[str] = option(default_factory=list, help="JSONL/Parquet prompt files or globs")
    max_prompts: int | None = positive(None, help="the first this many prompts; null = all")
    on_bad: Literal["error", "skip"] = option("error", help="a bad prompt record (no prompt, too long...)")


@dataclass
class CAIRolloutConfig(RolloutConfig):
    """The policy's sampling: ``n`` responses per prompt (label: >= 2; revise: 1), in file order."""

    n: int = positive(2, help="samples per prompt: one group")
    max_new_tokens: int = positive(64, help="the longest response")
    shuffle: bool = option(False, help="prompts in a seeded order per epoch, else in file order")


@dataclass
class ReviseOptions:
    rounds: int = positive(1, help="critique -> revision rounds per prompt, each on a drawn principle")


@dataclass
class LabelOptions:
    threshold: float = unit_interval(0.5, help="keep a pair when its confidence max(P, 1 - P) is at least this")
    on_no_choice: Literal["error", "skip"] = option(
        "error", help="an answer naming neither (A) nor (B): stop, or skip and count"
    )


@dataclass
class CAIRecipe:
    what: Literal["revise", "label"] = option(
        "label", help="revise: critique -> revision SFT data; label: AI preference pairs"
    )
    run_dir: str = option(
        "runs/cai", help="receives sft.jsonl and trace.jsonl (revise), or pairs.jsonl and judgements.jsonl (label)"
    )
    checkpoint: str = option("runs/sft", help="the policy that answers the prompts: a checkpoint or a run directory")
    constitution: str = option(
        "data/constitutions/helpful_harmless.yaml", help="the YAML file of principles the critic or judge applies"
    )
    data: CAIDataConfig = field(default_factory=CAIDataConfig)
    rollout: CAIRolloutConfig = field(default_factory=CAIRolloutConfig)
    judge: JudgeConfig = option(default_factory=JudgeConfig, help="the critic (revise) or judge (label)")
    revise: ReviseOptions = field(default_factory=ReviseOptions)
    label: LabelOptions = field(default_factory=LabelOptions)
    seed: int = seed_field(0, help="the principle drawn for each round or pair")
    prompts_per_chunk: int = positive(8, help="prompts sampled, judged and appended together (the unit of resuming)")
    dtype: Literal["float32", "bfloat16"] = option("float32", help="the policy's")
    device: str = option("auto", help="the policy's: auto = cuda when available, else cpu")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["revise", "label"],
                        help="revise: critique -> revision SFT data; label: AI preference pairs")
    parser.add_argument("recipe", nargs="?", help="YAML recipe (optional: defaults plus overrides also work)")


def recipe_from_args(args: argparse.Namespace) -> CAIRecipe:
    path, overrides = args.recipe, list(args.overrides)
    if path is not None and "=" in path and not path.endswith((".yaml", ".yml")):
        path, overrides = None, [path, *overrides]
    return load_config(CAIRecipe, path, [*overrides, f"what={args.what}"], overrides_label="command-line override")


def check_recipe(recipe: CAIRecipe) -> None:
    if not recipe.data.prompts:
        raise ConfigError("data.prompts is empty: list the JSONL/Parquet prompt files to answer")
    if recipe.rollout.shuffle:
        raise ConfigError("rollout.shuffle must be false: cai answers the prompts in file order, so it can resume")
    if recipe.what == "label" and recipe.rollout.n < 2:
        raise ConfigError(f"cai label pairs the policy's responses: rollout.n must be at least 2, got {recipe.rollout.n}")
    if recipe.what == "revise" and recipe.rollout.n != 1:
        raise ConfigError(f"cai revise revises one response per prompt: set rollout.n=1 (got {recipe.rollout.n})")
    recipe.judge.kind()


# --------------------------------------------------------------------------- the append-only log


def fingerprint(recipe: CAIRecipe, checkpoint: Path, constitution: Constitution) -> str:
    """What a prompt's samples and judgements depend on; a log line of another recipe is refused."""
    judge = recipe.judge.fingerprint()
    if judge["checkpoint"]:
        judge["checkpoint"] = str(resolve_checkpoint(judge["checkpoint"]).resolve())
    what = {"what": recipe.what, "checkpoint": str(checkpoint.resolve()), "rollout": asdict(recipe.rollout),
            "judge": judge, "constitution": constitution.sha256, "seed": recipe.seed,
            "rounds": recipe.revise.rounds if recipe.what == "revise" else None}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_log(path: Path, digest: str, prompts: list[Prompt]) -> list[dict]:
    """The prompts an earlier run of this recipe finished, in order. A last line cut short (a
    kill during the append) is removed from the file, so that prompt is done again."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    end = raw.rfind(b"\n") + 1
    if end < len(raw):
        log.warning("cai: %s ends with a line cut short (%d bytes); that prompt is done again", path, len(raw) - end)
        with open(path, "r+b") as f:
            f.truncate(end)
    records = []
    for number, line in enumerate(raw[:end].decode("utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{path}:{number}: not a JSON line ({exc}); remove the file to start again") from exc
        if record.get("fingerprint") != digest:
            raise InputError(f"{path}:{number}: written by cai with another checkpoint, judge, constitution, rollout or "
                             f"seed; use a new run_dir (or remove {path} to start again)")
        i = len(records)
        if i < len(prompts) and (record.get("index") != i or record.get("source") != prompts[i].source
                                 or record.get("prompt") != prompts[i].prompt):
            raise InputError(f"{path}:{number}: is for prompt {record.get('index')} ({record.get('source')}), but "
                             f"prompt {i} is {prompts[i].source}: the prompt files changed; use a new run_dir")
        records.append(record)
    return records[: len(prompts)]


def append_lines(path: Path, records: list[dict]) -> None:
    """Append one JSON line per record and fsync: a kill leaves at most a last line cut short."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- one chunk


def revise_chunk(judge: Judge, recipe: CAIRecipe, constitution: Constitution, groups: list[list[Rollout]],
                 first: int) -> list[dict]:
    items = [ToRevise(g[0].prompt.source, first + i, g[0].prompt.prompt, g[0].text) for i, g in enumerate(groups)]
    done = revise(judge, items, constitution, recipe.revise.rounds, recipe.seed)
    return [{"index": item.index, "source": item.key, "prompt": item.prompt, "fields": g[0].prompt.fields,
             "response": item.response, "finish_reason": g[0].finish_reason, **result}
            for item, g, result in zip(items, groups, done)]


def candidates(group: list[Rollout]) -> tuple[list[Rollout], dict[str, int]]:
    """The responses worth comparing: non-empty, each text once (the first sample of it)."""
    seen, out, dropped = set(), [], {"empty": 0, "duplicate": 0}
    for r in group:
        if not r.text.strip():
            dropped["empty"] += 1
        elif r.text in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(r.text)
            out.append(r)
    return out, dropped


def label_chunk(judge: Judge, recipe: CAIRecipe, constitution: Constitution, groups: list[list[Rollout]],
                first: int) -> list[dict]:
    pairs, owners, records = [], [], []
    for i, group in enumerate(groups):
        prompt, index = group[0].prompt, first + i
        usable, dropped = candidates(group)
        records.append({"index": index, "source": prompt.source, "prompt": prompt.prompt, "fields": prompt.fields,
                        "samples": [{"text": r.text, "tokens": len(r.response_ids), "finish_reason": r.finish_reason}
                                    for r in group], "unpaired": dropped, "pairs": []})
        for number, (x, y) in enumerate(combinations(usable, 2)):
            p = constitution.principles[draw_principle(constitution, recipe.seed, index, number)]
            pairs.append(PairToJudge(f"{prompt.source} samples {x.sample},{y.sample}", prompt.prompt, x.text, y.text,
                                     x.sample, y.sample, p.name, p.comparison))
            owners.append(i)
    for owner, judged in zip(owners, judge_pairs(judge, pairs, recipe.label.on_no_choice)):
        records[owner]["pairs"].append(judged)
    return records


# --------------------------------------------------------------------------- outputs


def write_revise_output(recipe: CAIRecipe, run_dir: Path, records: list[dict], skipped: SkipLog) -> dict:
    out = []
    for r in records:
        if not r["final"].strip():
            continue  # an empty answer is no SFT example (sft refuses empty turns); counted below
        body = ({"messages": [*r["prompt"], {"role": "assistant", "content": r["final"]}]}
                if isinstance(r["prompt"], list) else {"prompt": r["prompt"], "completion": r["final"]})
        out.append({**r["fields"], **body})
    path = run_dir / OUTPUTS["revise"]
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    rounds = [t for r in records for t in r["rounds"]]
    principles: dict[str, int] = {}
    for t in rounds:
        principles[t["principle"]] = principles.get(t["principle"], 0) + 1
    summary = {"what": "revise", "output": str(path), "trace": str(run_dir / LOGS["revise"]), "prompts": len(records),
               "rounds": len(rounds), "revised": sum(r["final"] != r["response"] for r in records),
               "empty_revisions": sum(not t["kept"] and "skipped" not in t for t in rounds),
               "skipped_rounds": {why: sum(t.get("skipped") == why for t in rounds)
                                  for why in ("empty_response", "empty_critique")},
               "dropped_empty": len(records) - len(out), "principles": dict(sorted(principles.items())),
               "skipped_records": skipped.to_dict()}
    atomic_write_json(run_dir / "summary.json", summary)
    log.info("cai revise: %d prompts, %d rounds, %d final responses changed (%d empty revisions kept the response, "
             "rounds skipped %s); %d SFT examples in %s", summary["prompts"], summary["rounds"], summary["revised"],
             summary["empty_revisions"], summary["skipped_rounds"], len(out), path)
    return summary


def write_label_output(recipe: CAIRecipe, run_dir: Path, records: list[dict], skipped: SkipLog) -> dict:
    out, reasons, read = [], {}, {}
    disagree = p_first = judged = 0
    for r in records:
        for k, v in r["unpaired"].items():
            if v:
                reasons[f"unpaired_{k}"] = reasons.get(f"unpaired_{k}", 0) + v
        texts = [s["text"] for s in r["samples"]]
        for pair in r["pairs"]:
            ix, iy = pair["samples"]
            record, why = pair_output(r["prompt"], texts[ix], texts[iy], pair, recipe.label.threshold)
            reasons[why] = reasons.get(why, 0) + 1
            for how in pair["read"]:
                read[how] = read.get(how, 0) + 1
            if "p_x" in pair:
                judged += 1
                disagree += pair["disagree"]
                p_first += (pair["p_x"][0] + 1.0 - pair["p_x"][1]) / 2  # P(A) of the two orders
            if record is not None:
                meta = {"source": r["source"], "principle": pair["principle"], "samples": pair["samples"],
                        "p_x": pair["p_x"]}
                out.append({**r["fields"], **record, "cai": meta})
    path = run_dir / OUTPUTS["label"]
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    kept = reasons.pop("kept", 0)
    summary = {"what": "label", "output": str(path), "judgements": str(run_dir / LOGS["label"]),
               "prompts": len(records), "samples_per_prompt": recipe.rollout.n, "pairs_judged": judged,
               "kept": kept, "dropped": dict(sorted(reasons.items())), "threshold": recipe.label.threshold,
               "disagreement_rate": disagree / judged if judged else None,
               "mean_p_first_position": p_first / judged if judged else None,
               "answers_read_by": dict(sorted(read.items())), "skipped_records": skipped.to_dict()}
    atomic_write_json(run_dir / "summary.json", summary)
    rate = "n/a" if summary["disagreement_rate"] is None else f"{summary['disagreement_rate']:.1%}"
    log.info("cai label: %d pairs kept of %d judged (dropped %s), the two orders disagree on %s; %s",
             kept, judged, summary["dropped"] or "none", rate, path)
    return summary


# --------------------------------------------------------------------------- the stage


def run_cai(recipe: CAIRecipe) -> dict:
    """Answer, judge and write; returns the summary (also in run_dir/summary.json)."""
    check_recipe(recipe)
    constitution = load_constitution(recipe.constitution)
    with run_dir_lock(recipe.run_dir):
        run_dir = start_run(recipe, recipe.run_dir)
        model, ckpt = load_model(recipe.checkpoint, device=resolve_device(recipe.device))
        model.to(DTYPES[recipe.dtype]).eval()
        tok = Tokenizer.load(ckpt)
        cfg = recipe.rollout
        skipped = SkipLog()
        prompts = read_prompts(recipe.data.prompts, tok, max_tokens=model.cfg.max_seq_len - cfg.max_new_tokens,
                               on_bad=recipe.data.on_bad, skipped=skipped)[: recipe.data.max_prompts]
        judge = build_judge(recipe.judge, run_dir / CACHE)
        digest = fingerprint(recipe, ckpt, constitution)
        path = run_dir / LOGS[recipe.what]
        records = read_log(path, digest, prompts)
        if records:
            log.info("cai %s: resuming after %d prompts already done (%s)", recipe.what, len(records), path)
        chunk_of = revise_chunk if recipe.what == "revise" else label_chunk
        state = RolloutState(cfg.seed, len(prompts), shuffle=False, cursor=len(records))
        total, start, t0 = len(prompts), len(records), time.perf_counter()
        with progress_bar(total, f"cai {recipe.what}", unit="prompt", initial=start) as bar:
            while state.cursor < total:
                first, k = state.cursor, min(recipe.prompts_per_chunk, total - state.cursor)
                groups = sample_rollouts(model, tok, prompts, cfg, state, k)
                done = [{"fingerprint": digest, **r} for r in chunk_of(judge, recipe, constitution, groups, first)]
                append_lines(path, done)
                records += done
                bar.update(k)
                elapsed = time.perf_counter() - t0
                eta = elapsed / (state.cursor - start) * (total - state.cursor)
                log.info("cai %s: %d/%d prompts, %.1f s per prompt, ETA %.0f s", recipe.what, state.cursor, total,
                         elapsed / (state.cursor - start), eta)
        write = write_revise_output if recipe.what == "revise" else write_label_output
        summary = write(recipe, run_dir, records, skipped)
        record_config(recipe, run_dir)
    return summary


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report."""
    if res.get("what") == "revise":
        return [f"- {res.get('prompts')} prompts, {res.get('rounds')} critique -> revision rounds: "
                f"**{res.get('revised')} responses revised** ({res.get('empty_revisions')} empty revisions ignored)",
                f"- SFT data in `{res.get('output')}`, every round in `{res.get('trace')}`"]
    rate = res.get("disagreement_rate")
    return [f"- {res.get('prompts')} prompts x {res.get('samples_per_prompt')} samples: {res.get('pairs_judged')} pairs "
            f"judged in both orders, **{res.get('kept')} kept**, dropped {res.get('dropped') or 'none'}",
            f"- the two orders disagree on {'n/a' if rate is None else f'{rate:.1%}'} of pairs",
            f"- preference pairs in `{res.get('output')}`"]


RECIPE = CAIRecipe
run = run_cai
