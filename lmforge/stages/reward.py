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

from lmforge.core.io import atomic_write_json
from lmforge.core.run import completed_summary, log
from lmforge.data.preference import pair_rows, read_preference_pairs
from lmforge.data.rows import RowLoader
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext, data_parallel_rank
from lmforge.distributed.parallelize import parallelize_model
from lmforge.model.reward import RewardModel
from lmforge.objectives.reward import RewardLossConfig, RewardObjective
from lmforge.peft.lora import LoraConfig
from lmforge.stages.dpo import PreferenceDataConfig
from lmforge.train.finetune import (
    gathered_for_saving,
    row_accumulation_steps,
    run_data_parallel,
    save_finetuned,
    start_finetune_run,
    validation_batches,
    wrap_lora,
)
from lmforge.train.loop import TrainConfig, evaluate, train
from lmforge.train.metrics import loss_curve_lines


@dataclass
class RewardDataConfig(PreferenceDataConfig):
    # an over-long pair is skipped and counted, as TRL's RewardTrainer drops it: truncated, its
    # reward would be read at a cut-off token with no EOS; `truncate` keeps it anyway
    on_too_long: Literal["error", "truncate", "skip"] = "skip"


@dataclass
class RewardRecipe:
    run_dir: str = "runs/reward"
    checkpoint: str = "runs/sft"  # the backbone: usually the SFT model
    data: RewardDataConfig = field(default_factory=RewardDataConfig)
    objective: RewardLossConfig = field(default_factory=RewardLossConfig)
    lora: LoraConfig | None = None  # adapters on the backbone; the head is always trained
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-4, warmup_steps=10, eval_every=50,
                                                                   micro_batch_size=8))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # read under torchrun: dp_shard, dp_replicate


def run_reward(recipe: RewardRecipe) -> dict:
    return run_data_parallel(recipe, "reward", lambda ctx: train_reward(recipe, ctx))


def train_reward(recipe: RewardRecipe, parallel: ParallelContext | None = None) -> dict:
    """The reward run in one process, or on one rank of a data-parallel ``torchrun`` job: there
    every rank builds the whole model (the same head from ``train.seed``) and shards it, and
    rank 0 alone writes the gathered result."""
    run = start_finetune_run(recipe, "reward", read_preference_pairs, parallel=parallel)
    run_dir, device, precision, backbone, tok = run.run_dir, run.device, run.precision, run.model, run.tok
    train_pairs, val_pairs, cfg, d = run.train_examples, run.val_examples, run.train_config(recipe.train), recipe.data
    rank, dp = data_parallel_rank(parallel)
    if recipe.lora is not None:
        wrap_lora(backbone, recipe.lora, "reward")
    model = RewardModel(backbone)  # the head is new, so always trainable
    if parallel is not None:
        parallelize_model(model, parallel, precision=cfg.precision, activation_checkpointing=cfg.activation_checkpointing,
                          compile=cfg.compile)
    objective = RewardObjective(recipe.objective)
    train_rows = pair_rows(train_pairs, tok.pad_id)
    val_rows = pair_rows(val_pairs, tok.pad_id) if val_pairs else None
    val_batches = validation_batches(val_rows, cfg.micro_batch_size, rank, dp)

    def held_out() -> dict:
        return evaluate(model, objective, val_batches(), device, precision, None, parallel) if val_batches else {}

    before = held_out()
    summary = train(
        model=model,
        objective=objective,
        train_batches=RowLoader(train_rows, cfg.micro_batch_size, seed=d.seed, rank=rank, world_size=dp),
        cfg=cfg,
        run_dir=run_dir,
        recipe=recipe,
        grad_accum=row_accumulation_steps(cfg, d.max_length, rows_per_example=2, world_size=dp),  # chosen, rejected
        val_batches=val_batches,
        flops_per_token=backbone.cfg.flops_per_token(d.max_length),
        tokenizer_dir=run.tok_dir,
        parallel=parallel,
    )
    if (stored := completed_summary(run_dir, summary)) is not None:  # a rerun: the run's own summary stands
        return {**stored, **summary}
    after = held_out()
    backbone = None  # the sharded backbone's last reference here: freed once gathered
    model = gathered_for_saving(run, model, summary, recipe.lora, parallel, wrap=RewardModel)
    if model is None:
        return summary
    final = save_finetuned(model.backbone, run_dir, run.tok_dir, run.base_dir, recipe.lora, write_extra=model.save_head)
    summary.update(train_pairs=len(train_pairs), val_pairs=len(val_pairs), skipped=run.skipped.to_dict(),
                   before=before, after=after, final_checkpoint=str(final), lora=recipe.lora is not None)
    atomic_write_json(run_dir / "summary.json", summary)
    if after:
        log.info("reward: held-out pairwise accuracy %.1f%% (before %.1f%%), margin %.3f; model in %s",
                 100 * after["val_accuracy"], 100 * before["val_accuracy"], after["val_margin"], final)
    return summary


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: data, held-out pairwise accuracy and margin."""
    before, after = res.get("before") or {}, res.get("after") or {}
    out = [f"- {res.get('train_pairs')} training pairs, {res.get('step')} steps in {res.get('wall_s', 0):.0f} s"
           f"{' (LoRA)' if res.get('lora') else ''}; reward model in `{res.get('final_checkpoint')}`"]
    skipped = (res.get("skipped") or {}).get("by_reason") or {}
    if skipped:
        out.append(f"- pairs skipped or truncated: {sum(skipped.values())} {skipped}")
    if after:
        out.append(f"- held-out pairwise accuracy on {res.get('val_pairs')} pairs: "
                   f"**{100 * before.get('val_accuracy', 0):.1f}% → {100 * after['val_accuracy']:.1f}%**, "
                   f"mean margin {before.get('val_margin', 0):.3f} → {after['val_margin']:.3f}")
    return out + loss_curve_lines(stage_dir, plot_path)


RECIPE = RewardRecipe
run = run_reward
