"""Train a reward model on preference pairs, through the one training loop: the checkpoint's
transformer plus a scalar head on the last real token, with the Bradley-Terry loss (optional
per-pair `margin` field, optional centring term). Reads TRL's `prompt`/`chosen`/`rejected`
format (plain or conversational, JSONL or Parquet). Full fine-tuning or LoRA (the head is
always trained). Reports pairwise accuracy on the held-out pairs before and after; the
result in `final/` is the backbone checkpoint plus `reward_head.safetensors`.

  lmforge reward recipes/demo/reward.yaml
  lmforge reward recipes/demo/reward.yaml objective.center_coef=0.01 lora.r=16

Under torchrun it trains data-parallel with FSDP2, as `lmforge sft` does (its `parallel:`
section; see docs/distributed.md); the head is sharded with the backbone's root:

  torchrun --standalone --nproc_per_node=2 -m lmforge reward recipes/demo/reward.yaml train.micro_batch_size=4
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lmforge.core.config import option
from lmforge.data.preference import pair_rows, read_preference_pairs
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext
from lmforge.model.reward import RewardModel
from lmforge.objectives.reward import RewardLossConfig, RewardObjective
from lmforge.peft.lora import LoraConfig
from lmforge.stages.finetune import FinetuneStage, PreferenceDataConfig, run_finetune
from lmforge.train.loop import TrainConfig, precision_line
from lmforge.train.metrics import loss_curve_lines


@dataclass
class RewardDataConfig(PreferenceDataConfig):
    on_too_long: Literal["error", "truncate", "skip"] = option(
        "skip",
        help="an over-long pair is skipped and counted, as TRL's RewardTrainer drops it: truncated, "
        "its reward would be read at a cut-off token with no EOS; `truncate` keeps it anyway",
    )


@dataclass
class RewardRecipe:
    run_dir: str = option(
        "runs/reward",
        help="the run directory: config.yaml, metrics.jsonl, checkpoints/, final/ (the trained model), summary.json",
    )
    checkpoint: str = option("runs/sft", help="the backbone: usually the SFT model")
    data: RewardDataConfig = field(default_factory=RewardDataConfig)
    objective: RewardLossConfig = option(default_factory=RewardLossConfig, help="center_coef, use_margin")
    lora: LoraConfig | None = option(None, help="adapters on the backbone; the head is always trained")
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-4, warmup_steps=10, eval_every=50,
                                                                   micro_batch_size=8))
    parallel: ParallelConfig = option(
        default_factory=ParallelConfig, help="read under torchrun: dp_shard, dp_replicate"
    )


def reward_stage(recipe: RewardRecipe, parallel: ParallelContext | None = None) -> FinetuneStage:
    """Pairs through the backbone and a new scalar head (built on every rank from ``train.seed``),
    the Bradley-Terry loss; scored by the held-out pairs' validation figures alone."""
    return FinetuneStage("reward", read_preference_pairs, rows=lambda examples, tok: pair_rows(examples, tok.pad_id),
                         objective=lambda _reference: RewardObjective(recipe.objective),
                         rows_per_example=2, head=RewardModel)  # chosen and rejected


def run_reward(recipe: RewardRecipe) -> dict:
    return run_finetune(recipe, "reward", reward_stage)


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: data, held-out pairwise accuracy and margin."""
    before, after = res.get("before") or {}, res.get("after") or {}
    out = [f"- {res.get('train_examples')} training pairs, {res.get('step')} steps in {res.get('wall_s', 0):.0f} s"
           f"{' (LoRA)' if res.get('lora') else ''}; reward model in `{res.get('final_checkpoint')}`"]
    skipped = (res.get("skipped") or {}).get("by_reason") or {}
    if skipped:
        out.append(f"- pairs skipped or truncated: {sum(skipped.values())} {skipped}")
    if after:
        out.append(f"- held-out pairwise accuracy on {res.get('val_examples')} pairs: "
                   f"**{100 * before.get('val_accuracy', 0):.1f}% → {100 * after['val_accuracy']:.1f}%**, "
                   f"mean margin {before.get('val_margin', 0):.3f} → {after['val_margin']:.3f}")
    out += precision_line(res)
    return out + loss_curve_lines(stage_dir, plot_path, ylabel="Bradley-Terry loss (nats/pair)")


RECIPE = RewardRecipe
run = run_reward
