"""Rejection sampling (best-of-K, one round of ReST/RAFT): sample K responses per prompt from a
checkpoint, score them with a reward model or verifiers (`reward:`), and write the best as
SFT data (`output: sft`: TRL `messages`, or `prompt`/`completion` for plain prompts, which
`lmforge sft` reads) or best against worst as preference pairs (`output: pairs`:
`prompt`/`chosen`/`rejected`, which `lmforge dpo` reads).

Prompts are TRL-style JSONL/Parquet (`prompt` or `messages`, a final assistant turn being the
reference `answer`) with the fields the reward reads. K is `rollout.n`.

A prompt is kept when its best candidate's reward is at least `threshold` (and, for pairs,
above the worst's by more than `min_margin`, with a different text). Candidates are the
non-empty responses, without those cut at max_new_tokens when `reward.mask_truncated`.
Ties are broken deterministically: the best is the highest reward, then the shortest
response (tokens), then the first sampled; the worst is the lowest reward, then the longest,
then the first sampled. The counts of prompts kept and dropped (and why) are in
summary.json and the report.

Work is done in chunks of `prompts_per_chunk` prompts, each written atomically to
`run_dir/chunks/` with its samples and scores: an interrupted run resumes after the last
chunk written (those prompts are not sampled again; each prompt's samples are seeded by the
prompt, so the output is the uninterrupted run's). Selection reads every chunk, so changing
`output`, `threshold` or `min_margin` and rerunning samples nothing.

  lmforge rs recipes/demo/rs.yaml
  lmforge rs recipes/demo/rs.yaml output=pairs rollout.n=8 run_dir=runs/demo/rs-pairs

Iterated in a lifecycle: sft -> rs -> sft (the second sft reads `run_dir/sft.jsonl`), or
rs (`output: pairs`) -> dpo (`data.train: [run_dir/pairs.jsonl]`); see recipes/demo/rs.yaml.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.load import load_model
from lmforge.core.config import ConfigError, at_least, in_range, option, positive
from lmforge.core.io import InputError, atomic_write_json, atomic_write_text, read_json
from lmforge.core.run import log, progress_bar, record_config, run_dir_lock, start_run
from lmforge.data.documents import SkipLog
from lmforge.data.tokenizer import Tokenizer
from lmforge.rl.prompts import Prompt, read_prompts
from lmforge.rl.rewards import Reward, RewardConfig
from lmforge.rl.rollout import RolloutConfig, RolloutState, sample_rollouts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHUNKS = "chunks"
OUTPUTS = {"sft": "sft.jsonl", "pairs": "pairs.jsonl"}


@dataclass
class RSDataConfig:
    prompts: list[str] = option(default_factory=list, help="JSONL/Parquet prompt files or globs")
    max_prompts: int | None = positive(None, help="the first this many prompts; null = all")
    on_bad: Literal["error", "skip"] = option(
        "error", help="a bad record (no prompt, a field the reward needs missing...)"
    )


@dataclass
class RSRolloutConfig(RolloutConfig):
    """The rollout settings with rs's defaults: the prompts in file order, so the output follows them."""

    n: int = positive(8, help="K, samples per prompt")
    max_new_tokens: int = positive(64, help="the longest response; a response cut there counts as truncated")
    shuffle: bool = option(False, help="prompts in a seeded order per epoch, else in file order")


@dataclass
class RSRecipe:
    run_dir: str = option(
        "runs/rs", help="receives sft.jsonl or pairs.jsonl, chunks/ (what a resumed run reuses), summary.json"
    )
    checkpoint: str = option("runs/sft", help="the policy that samples: a checkpoint or a run directory")
    data: RSDataConfig = field(default_factory=RSDataConfig)
    rollout: RSRolloutConfig = field(default_factory=RSRolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    output: Literal["sft", "pairs"] = option("sft", help="the best as SFT data, or best vs worst as preference pairs")
    threshold: float | None = in_range(None, help="keep a prompt only when its best reward is >= this; null = always")
    min_margin: float = at_least(0, 0.0, help="pairs: best reward - worst reward must exceed this")
    prompts_per_chunk: int = positive(16, help="prompts sampled and written together (the unit of resuming)")
    dtype: Literal["float32", "bfloat16"] = option("float32", help="the policy's")
    device: str = option("auto", help="auto = cuda when available, else cpu")


# --------------------------------------------------------------------------- selection


def ranked(samples: list[dict], mask_truncated: bool) -> list[dict]:
    """The candidates, best first: highest reward, then fewest tokens, then first sampled."""
    candidates = [s for s in samples if s["text"].strip() and not (mask_truncated and s["finish_reason"] == "length")]
    return sorted(candidates, key=lambda s: (-s["reward"], s["tokens"], s["sample"]))


def worst_of(candidates: list[dict]) -> dict:
    """The lowest reward, then the most tokens, then the first sampled."""
    return min(candidates, key=lambda s: (s["reward"], -s["tokens"], s["sample"]))


def select(group: dict, recipe: RSRecipe) -> tuple[dict | None, str]:
    """The output record of one scored prompt, or None, and the reason (``kept`` or why dropped)."""
    candidates = ranked(group["samples"], recipe.reward.mask_truncated)
    if not candidates:
        return None, "no_candidate"  # every response empty (or cut at max_new_tokens, with mask_truncated)
    best = candidates[0]
    if recipe.threshold is not None and best["reward"] < recipe.threshold:
        return None, "below_threshold"
    prompt, fields = group["prompt"], group["fields"]
    meta = {"source": group["source"], "reward": best["reward"], "sample": best["sample"]}
    as_turn = isinstance(prompt, list)
    if recipe.output == "sft":
        body = ({"messages": [*prompt, {"role": "assistant", "content": best["text"]}]} if as_turn
                else {"prompt": prompt, "completion": best["text"]})
        return {**fields, **body, "rs": meta}, "kept"
    worst = worst_of(candidates)
    if best["reward"] - worst["reward"] <= recipe.min_margin:
        return None, "no_margin"  # also a group of one candidate, or all candidates scored alike
    if best["text"] == worst["text"]:
        return None, "identical_texts"

    def side(s: dict):
        return [{"role": "assistant", "content": s["text"]}] if as_turn else s["text"]

    meta.update(rejected_reward=worst["reward"], rejected_sample=worst["sample"])
    return {**fields, "prompt": prompt, "chosen": side(best), "rejected": side(worst), "rs": meta}, "kept"


# --------------------------------------------------------------------------- chunks


def fingerprint(recipe: RSRecipe, checkpoint: Path, prompts: list[Prompt]) -> str:
    """What the samples and scores depend on: the checkpoint (the one a run directory resolved to),
    the prompts, the rollout and the reward."""
    what = {"checkpoint": str(checkpoint.resolve()), "rollout": asdict(recipe.rollout),
            "reward": asdict(recipe.reward), "prompts": [(p.source, p.ids, p.fields) for p in prompts]}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def chunk_path(run_dir: Path, index: int) -> Path:
    return run_dir / CHUNKS / f"chunk-{index:05d}.json"


def read_chunks(run_dir: Path, digest: str) -> list[dict]:
    """The chunks an earlier run of this recipe wrote, in order (a gap ends them: later ones are redone)."""
    chunks = []
    while chunk_path(run_dir, len(chunks)).is_file():
        path = chunk_path(run_dir, len(chunks))
        chunk = read_json(path, "rs chunk")
        if not isinstance(chunk, dict) or chunk.get("fingerprint") != digest:
            raise InputError(f"{path}: written by rs with another checkpoint, prompts, rollout or reward; use a new "
                             f"run_dir (or remove {run_dir / CHUNKS} to sample again)")
        chunks.append(chunk)
    return chunks


def scored_groups(rollouts: list[list], reward: Reward) -> list[dict]:
    """Each prompt's samples with their rewards and reward terms, as a chunk stores them."""
    flat = [r for group in rollouts for r in group]
    scores = reward(flat)
    out, i = [], 0
    for group in rollouts:
        p = group[0].prompt
        samples = []
        for r in group:
            samples.append({"sample": r.sample, "text": r.text, "tokens": len(r.response_ids),
                            "finish_reason": r.finish_reason, "reward": scores.total[i],
                            "terms": {k: v[i] for k, v in scores.terms.items()}})
            i += 1
        out.append({"source": p.source, "prompt": p.prompt, "fields": p.fields, "samples": samples})
    return out


# --------------------------------------------------------------------------- the stage


def check_recipe(recipe: RSRecipe) -> None:
    if not recipe.data.prompts:
        raise ConfigError("data.prompts is empty: list the JSONL/Parquet prompt files to sample from")
    if recipe.output == "pairs" and recipe.rollout.n < 2:
        raise ConfigError(f"output: pairs needs at least two samples per prompt to pair best against worst; "
                          f"rollout.n is {recipe.rollout.n}")
    recipe.reward.check()


def run_rs(recipe: RSRecipe) -> dict:
    """Sample, score and select; returns the summary (also in run_dir/summary.json)."""
    check_recipe(recipe)
    with run_dir_lock(recipe.run_dir):
        run_dir = start_run(recipe, recipe.run_dir)
        device = resolve_device(recipe.device)
        model, ckpt = load_model(recipe.checkpoint, device=device)
        model.to(DTYPES[recipe.dtype]).eval()
        tok = Tokenizer.load(ckpt)
        cfg = recipe.rollout
        skipped = SkipLog()
        prompts = read_prompts(recipe.data.prompts, tok, required_fields=recipe.reward.required_fields(),
                               max_tokens=model.cfg.max_seq_len - cfg.max_new_tokens, on_bad=recipe.data.on_bad,
                               skipped=skipped)[: recipe.data.max_prompts]
        reward = Reward(recipe.reward, tok, cfg.max_new_tokens, device)  # a reward model's tokenizer checked here
        digest = fingerprint(recipe, ckpt, prompts)
        chunks = read_chunks(run_dir, digest)
        state = RolloutState(cfg.seed, len(prompts), cfg.shuffle)
        if chunks:
            state.load_state_dict(chunks[-1]["state"])
            log.info("rs: resuming after %d prompts already sampled and scored (%s)", state.cursor, run_dir / CHUNKS)
        sample_remaining(model, tok, prompts, recipe, state, reward, run_dir, digest, chunks)
        summary = write_output(recipe, run_dir, chunks, skipped, ckpt)
        record_config(recipe, run_dir)
    return summary


def sample_remaining(model, tok: Tokenizer, prompts: list[Prompt], recipe: RSRecipe, state: RolloutState,
                     reward: Reward, run_dir: Path, digest: str, chunks: list[dict]) -> None:
    """Sample and score the prompts after ``state``'s cursor, a chunk at a time, appending to ``chunks``."""
    total, start = len(prompts), state.cursor
    t0, tokens = time.perf_counter(), 0
    with progress_bar(total, "rs", unit="prompt", initial=start) as bar:
        while state.cursor < total and state.epoch == 0:
            k = min(recipe.prompts_per_chunk, total - state.cursor)
            groups = scored_groups(sample_rollouts(model, tok, prompts, recipe.rollout, state, k), reward)
            chunk = {"fingerprint": digest, "state": state.state_dict(), "groups": groups}
            atomic_write_json(chunk_path(run_dir, len(chunks)), chunk)
            chunks.append(chunk)
            bar.update(k)
            tokens += sum(s["tokens"] for g in groups for s in g["samples"])
            elapsed = time.perf_counter() - t0
            done = state.cursor - start
            eta = elapsed / done * (total - state.cursor)
            log.info("rs: %d/%d prompts, %.1f tokens/s, ETA %.0f s", state.cursor, total, tokens / elapsed, eta)


def write_output(recipe: RSRecipe, run_dir: Path, chunks: list[dict], skipped: SkipLog, checkpoint: Path) -> dict:
    """Select from every chunk, write the output file and summary.json (with the ``checkpoint`` that
    sampled: in a lifecycle's rounds, the previous round's model); returns the summary."""
    records, reasons = [], {}
    rewards, bests = [], []
    for chunk in chunks:
        for group in chunk["groups"]:
            record, why = select(group, recipe)
            reasons[why] = reasons.get(why, 0) + 1
            if record is not None:
                records.append(record)
            rewards += [s["reward"] for s in group["samples"]]
            bests.append(max(s["reward"] for s in group["samples"]))
    out = run_dir / OUTPUTS[recipe.output]
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    prompts = sum(len(c["groups"]) for c in chunks)
    kept = reasons.pop("kept", 0)
    summary = {"output": str(out), "format": recipe.output, "checkpoint": str(checkpoint), "prompts": prompts,
               "samples_per_prompt": recipe.rollout.n,
               "kept": kept, "dropped": dict(sorted(reasons.items())), "skipped_records": skipped.to_dict(),
               "mean_reward": sum(rewards) / len(rewards) if rewards else None,
               "mean_best_reward": sum(bests) / len(bests) if bests else None, "threshold": recipe.threshold}
    atomic_write_json(run_dir / "summary.json", summary)
    log.info("rs: kept %d of %d prompts (dropped %s); %s", kept, prompts, summary["dropped"] or "none", out)
    return summary


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: prompts kept and dropped, rewards, where the data went."""
    dropped = res.get("dropped") or {}
    lines = [f"- {res.get('prompts')} prompts x {res.get('samples_per_prompt')} samples: **{res.get('kept')} kept**, "
             f"{sum(dropped.values())} dropped {dropped if dropped else ''}".rstrip(),
             f"- {res.get('format')} data in `{res.get('output')}`"
             + (f", sampled by `{res['checkpoint']}`" if res.get("checkpoint") else "")]
    if res.get("mean_reward") is not None:
        lines.append(f"- mean reward {res['mean_reward']:.3f}, mean best-of-{res.get('samples_per_prompt')} "
                     f"{res['mean_best_reward']:.3f}")
    skipped = (res.get("skipped_records") or {}).get("total")
    if skipped:
        lines.append(f"- prompt records skipped: {skipped} {res['skipped_records']['by_reason']}")
    return lines


RECIPE = RSRecipe
run = run_rs
