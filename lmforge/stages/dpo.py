"""Preference optimisation of a fine-tuned checkpoint on paired data, through the one training
loop: DPO and its variants (`objective.loss: dpo | ipo | cdpo | rdpo | hinge`, against a frozen
reference) or the reference-free SimPO, ORPO and CPO (`objective.loss: simpo | orpo | cpo`).
Reads TRL's preference format, `prompt`/`chosen`/`rejected` (plain strings or conversational,
from JSONL or Parquet). Full fine-tuning, or LoRA/DoRA/QLoRA with `lora:`, where the reference
is the model with its adapters disabled. Reference log-probs are computed once before training
(`precompute_reference: true`) or on the fly. Logs rewards of chosen and rejected, margins,
preference accuracy and KL, and reports validation margins, the model's own pairwise
preference (log-likelihood of chosen above rejected) and, with `score.name=exact_match`,
greedy exact-match accuracy, before and after training.

  lmforge dpo recipes/demo/dpo.yaml
  lmforge dpo recipes/demo/dpo.yaml objective.loss=ipo objective.beta=0.5
  lmforge dpo recipes/demo/dpo.yaml objective.loss=cdpo objective.label_smoothing=0.1 lora.r=16

Under torchrun it trains data-parallel with FSDP2 (full fine-tuning or LoRA/DoRA), laid out
by its `parallel:` section (dp_shard, dp_replicate; see docs/distributed.md). Each rank
precomputes the reference log-probs of its share of the rows, and a live full fine-tuning
reference is sharded as the policy is:

  torchrun --standalone --nproc_per_node=2 -m lmforge dpo recipes/distributed/cpu_fsdp_dpo.yaml
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from lmforge.core.config import Renamed, option
from lmforge.data.preference import pair_rows, read_preference_pairs
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext
from lmforge.objectives.dpo import PreferenceLossConfig, PreferenceObjective
from lmforge.objectives.ewc import EWCConfig
from lmforge.peft.lora import LoraConfig
from lmforge.stages.finetune import FinetuneStage, PreferenceDataConfig, adapter_line, run_finetune
from lmforge.stages.scoring import RENAMED_EVAL_KEYS, ScoreConfig, combined, named_scorer, preference_scorer
from lmforge.train.loop import TrainConfig, precision_line
from lmforge.train.metrics import loss_curve_lines

# the objective's keys, flat at the recipe's top before they were nested under `objective:`
RENAMED_OBJECTIVE_KEYS = {key: Renamed(f"objective.{key}") for key in
                          ("loss", "beta", "label_smoothing", "simpo_gamma", "cpo_alpha", "sft_weight")}


@dataclass
class DPORecipe:
    run_dir: str = option(
        "runs/dpo",
        help="the run directory: config.yaml, metrics.jsonl, checkpoints/, final/ (the trained model), summary.json",
    )
    checkpoint: str = option("runs/sft", help="the policy to start from (and the reference): usually the SFT model")
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    objective: PreferenceLossConfig = option(default_factory=PreferenceLossConfig, help="loss, beta, ...")
    lora: LoraConfig | None = option(None, help="adapters only; the reference is then the model with adapters disabled")
    ewc: EWCConfig | None = option(None, help="set to add EWC's (λ/2)·Σ F(θ − θ*)² to the loss, F and θ* from "
                                   "`lmforge fisher` (docs/continual-learning.md)")
    precompute_reference: bool = option(
        True, help="reference log-probs in one pass before training (no reference in memory after)"
    )
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=5e-6, warmup_steps=10, eval_every=50,
                                                                   micro_batch_size=4, batch_tokens=4096))
    score: ScoreConfig = option(default_factory=ScoreConfig, help="scored before and after training (none by default)")
    parallel: ParallelConfig = option(
        default_factory=ParallelConfig, help="read under torchrun: dp_shard, dp_replicate"
    )

    RENAMED_KEYS: ClassVar[dict[str, Renamed]] = {**RENAMED_OBJECTIVE_KEYS, **RENAMED_EVAL_KEYS}


def dpo_stage(recipe: DPORecipe, parallel: ParallelContext | None = None) -> FinetuneStage:
    """Pairs as ``[chosen; rejected]`` rows, the preference loss, and the model's own preference on
    the validation pairs (plus the recipe's scorer) before and after."""
    loss = recipe.objective

    def scorer(run, val_rows):
        own = preference_scorer(val_rows, recipe.train.micro_batch_size, run.device, run.precision) if val_rows else None
        return combined(named_scorer(recipe.score, run.tok, recipe.data.val), own)

    return FinetuneStage(
        "dpo", read_preference_pairs, rows=lambda examples, tok: pair_rows(examples, tok.pad_id),
        objective=lambda reference: PreferenceObjective(loss, reference), scorer=scorer,
        rows_per_example=2,  # chosen and rejected
        reference_columns={"chosen_": "ref_chosen_logps", "rejected_": "ref_rejected_logps"}
        if loss.needs_reference else None,
        precompute_reference=recipe.precompute_reference, summary={"loss": loss.loss})


def run_dpo(recipe: DPORecipe) -> dict:
    return run_finetune(recipe, "dpo", dpo_stage)


def _pct(result: dict | None, key: str = "exact_match") -> str:
    value = (result or {}).get(key)
    if isinstance(value, dict):
        value = value.get("exact_match")
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _accuracy(result: dict) -> str:
    """The implicit-reward accuracy (margin > 0) with its ties (margin 0 up to rounding) said as
    ties: while the policy is the reference every margin is 0, and "0.0%" would read as every pair wrong."""
    ties = result.get("val_ties") or 0.0
    if ties >= 1.0:
        return "n/a (every pair a tie: margin 0 at init)"
    return f"{_pct(result, 'val_accuracy')} ({100 * ties:.1f}% ties)" if ties > 0 else _pct(result, "val_accuracy")


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: data, margins, preference and exact-match accuracy before and after."""
    before, after = res.get("before") or {}, res.get("after") or {}
    out = [f"- loss `{res.get('loss')}`: {res.get('train_examples')} training pairs, {res.get('step')} steps in "
           f"{res.get('wall_s', 0):.0f} s{' (LoRA)' if res.get('lora') else ''}; model in `{res.get('final_checkpoint')}`",
           adapter_line(res, "dpo", "recipes/demo/dpo.yaml")]
    skipped = (res.get("skipped") or {}).get("by_reason") or {}
    if skipped:
        out.append(f"- examples skipped or truncated: {sum(skipped.values())} {skipped}")
    if "val_margin" in after:
        start = round(before.get("val_margin", 0.0), 3) + 0.0  # no "-0.000" at policy == reference
        out.append(f"- validation reward margin **{start:.3f} → {after['val_margin']:.3f}**, implicit-reward "
                   f"preference accuracy {_accuracy(before)} → {_accuracy(after)}")
    if "logp_accuracy" in after:
        out.append(f"- the model's own preference (log-prob of chosen > rejected) on {after['pairs']} held-out pairs: "
                   f"{_pct(before, 'logp_accuracy')} → **{_pct(after, 'logp_accuracy')}**")
    if after.get("exact_match"):
        out.append(f"- exact match on {after['exact_match']['examples']} tasks: **{_pct(before)} before, "
                   f"{_pct(after)} after**")
    out += precision_line(res)
    return out + loss_curve_lines(stage_dir, plot_path, ylabel=f"{res.get('loss')} loss per pair")


RECIPE = DPORecipe
run = run_dpo
