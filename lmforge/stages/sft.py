"""Supervised fine-tuning of a checkpoint on chat data, through the same training loop as
pre-training with a masked objective. Reads TRL's formats from JSONL or Parquet:
conversational `messages` (system/user/assistant turns) or `prompt`/`completion`, renders
ChatML, trains on assistant tokens only (end-of-turn included) and packs several
examples per row without cross-attention. Full fine-tuning, or LoRA/DoRA with `lora:`
(QLoRA with `lora.quantize_base=true`: the adapted linears are stored in NF4). Reports
validation loss and, for examples whose last turn is the assistant's answer, greedy
exact-match accuracy before and after training.

  lmforge sft recipes/demo/sft.yaml
  lmforge sft recipes/demo/sft.yaml lora.r=16 lora.alpha=32 train.lr=1e-3

Under torchrun it trains data-parallel with FSDP2 (full fine-tuning or LoRA/DoRA), laid out
by its `parallel:` section (dp_shard, dp_replicate; see docs/distributed.md):

  torchrun --standalone --nproc_per_node=2 -m lmforge sft recipes/distributed/cpu_fsdp_sft.yaml
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from lmforge.core.config import positive, seed_field
from lmforge.core.io import atomic_write_json
from lmforge.core.run import completed_summary, log
from lmforge.data.chat import read_sft_examples
from lmforge.data.packing import pack_examples, pad_examples
from lmforge.data.rows import RowLoader
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext, data_parallel_rank
from lmforge.distributed.parallelize import parallelize_model
from lmforge.objectives.sft import SFTObjective
from lmforge.peft.lora import LoraConfig
from lmforge.train.finetune import (
    ExactMatchConfig,
    exact_match_accuracy,
    exact_match_tasks,
    gathered_for_saving,
    row_accumulation_steps,
    run_data_parallel,
    save_finetuned,
    start_finetune_run,
    task_files,
    validation_batches,
    wrap_lora,
)
from lmforge.train.loop import TrainConfig, train
from lmforge.train.metrics import loss_curve_lines


@dataclass
class SFTDataConfig:
    train: list[str] = field(default_factory=list)  # JSONL/Parquet files or globs
    val: list[str] = field(default_factory=list)
    max_length: int = positive(512)  # tokens per example (and per packed row)
    packing: bool = True  # several examples per row, block-diagonal attention
    assistant_only: bool = True  # loss on assistant turns only (else on every token)
    on_bad: Literal["error", "skip"] = "error"  # an invalid example: stop, or skip and count
    on_too_long: Literal["error", "truncate", "skip"] = "error"
    seed: int = seed_field(0)


@dataclass
class SFTRecipe:
    run_dir: str = "runs/sft"
    checkpoint: str = "runs/pretrain"  # base model: a checkpoint, a run directory, or an imported HF model
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    lora: LoraConfig | None = None  # set to fine-tune adapters only (use_dora for DoRA)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-4, warmup_steps=10, eval_every=50))
    eval: ExactMatchConfig = field(default_factory=ExactMatchConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # read under torchrun: dp_shard, dp_replicate


def build_rows(examples: list, max_length: int, packing: bool, pad_id: int) -> dict[str, torch.Tensor]:
    pairs = [(e.input_ids, e.labels) for e in examples]
    return pack_examples(pairs, max_length, pad_id) if packing else pad_examples(pairs, pad_id, pad_to=max_length)


def run_sft(recipe: SFTRecipe) -> dict:
    return run_data_parallel(recipe, "sft", lambda ctx: train_sft(recipe, ctx))


def train_sft(recipe: SFTRecipe, ctx: ParallelContext | None = None) -> dict:
    """The SFT run in one process, or on one rank of a data-parallel ``torchrun`` job (``ctx``):
    there every rank loads the whole base and shards it with FSDP2, reads its own rows of
    each global batch, and rank 0 alone scores, logs and writes the final model and summary."""
    d = recipe.data
    logging_rank = ctx is None or ctx.is_logging_rank
    rank, dp = data_parallel_rank(ctx)

    def read_examples(paths: list[str], tok, max_length: int, **read) -> list:
        return list(read_sft_examples(paths, tok, max_length, assistant_only=d.assistant_only, **read))

    run = start_finetune_run(recipe, "sft", read_examples, parallel=ctx)
    run_dir, model, tok = run.run_dir, run.model, run.tok
    train_examples, val_examples, skipped = run.train_examples, run.val_examples, run.skipped
    train_rows = build_rows(train_examples, d.max_length, d.packing, tok.pad_id)
    log.info("sft: %d training examples in %d rows of %d tokens (%s)",
             len(train_examples), len(train_rows["input_ids"]), d.max_length, "packed" if d.packing else "padded")

    # read by every rank (an error in them stops all alike), scored by rank 0 alone; greedy decoding
    # draws no random numbers, so every rank's LoRA init stays the same
    tasks = exact_match_tasks(tok, task_files(recipe.eval, d.val), recipe.eval.max_examples)
    before = exact_match_accuracy(model, tok, *tasks, recipe.eval) if logging_rank else None
    if before:
        log.info("sft: exact match before training %.1f%% (%d examples)", 100 * before["exact_match"], before["examples"])
    if recipe.lora is not None:
        wrap_lora(model, recipe.lora, "sft")

    cfg = run.train_config(recipe.train)
    if ctx is not None:
        parallelize_model(model, ctx, precision=cfg.precision, activation_checkpointing=cfg.activation_checkpointing,
                          compile=cfg.compile)
    loader = RowLoader(train_rows, cfg.micro_batch_size, seed=d.seed, rank=rank, world_size=dp)
    val_rows = build_rows(val_examples, d.max_length, d.packing, tok.pad_id) if val_examples else None
    grad_accum = row_accumulation_steps(cfg, d.max_length, world_size=dp)
    summary = train(
        model=model,
        objective=SFTObjective(),
        train_batches=loader,
        cfg=cfg,
        run_dir=run_dir,
        recipe=recipe,
        grad_accum=grad_accum,
        val_batches=validation_batches(val_rows, cfg.micro_batch_size, rank, dp),
        flops_per_token=model.cfg.flops_per_token(d.max_length),
        tokenizer_dir=run.tok_dir,
        parallel=ctx,
    )
    if (stored := completed_summary(run_dir, summary)) is not None:  # a rerun: the run's own summary stands
        return {**stored, **summary}
    summary["tokens_per_step"] = grad_accum * cfg.micro_batch_size * d.max_length * dp
    model = gathered_for_saving(run, model, summary, recipe.lora, ctx)
    if model is None:
        return summary
    model.to(run.device)  # a no-op in one process; rank 0's gathered copy, once the shards are gone
    final = save_finetuned(model, run_dir, run.tok_dir, run.base_dir, recipe.lora)
    after = exact_match_accuracy(model, tok, *tasks, recipe.eval)
    summary.update(train_examples=len(train_examples), val_examples=len(val_examples), skipped=skipped.to_dict(),
                   exact_match_before=before, exact_match_after=after, final_checkpoint=str(final),
                   lora=recipe.lora is not None)
    atomic_write_json(run_dir / "summary.json", summary)
    if after:
        log.info("sft: exact match after training %.1f%% (before %.1f%%); model in %s",
                 100 * after["exact_match"], 100 * (before or {}).get("exact_match", 0.0), final)
    return summary


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: data, validation loss, exact match before and after."""
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
    return out + loss_curve_lines(stage_dir, plot_path)


RECIPE = SFTRecipe
run = run_sft
