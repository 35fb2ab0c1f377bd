"""Supervised fine-tuning of a checkpoint on chat data, through the same training loop as
pre-training with a masked objective. Reads TRL's formats from JSONL or Parquet:
conversational `messages` (system/user/assistant turns) or `prompt`/`completion`, renders
ChatML, trains on assistant tokens only (`objective.assistant_only`; end-of-turn included) and
packs several examples per row without cross-attention. Full fine-tuning, or LoRA/DoRA with
`lora:` (QLoRA with `lora.quantize_base`: the adapted linears are stored in NF4, or in HQQ's
int4/int3/int2; `lora.init: loftq` starts the adapters from the quantisation residual). Reports
validation loss and, with `score.name=exact_match`, greedy exact-match accuracy before and
after training on examples whose last turn is the assistant's answer.

  lmforge sft recipes/demo/sft.yaml
  lmforge sft recipes/demo/sft.yaml lora.r=16 lora.alpha=32 train.lr=1e-3

Under torchrun it trains data-parallel with FSDP2 (full fine-tuning or LoRA/DoRA), laid out
by its `parallel:` section (dp_shard, dp_replicate; see docs/distributed.md):

  torchrun --standalone --nproc_per_node=2 -m lmforge sft recipes/distributed/cpu_fsdp_sft.yaml
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch

from lmforge.checkpoints.load import resolve_checkpoint
from lmforge.core.config import Renamed, option, positive, seed_field
from lmforge.core.run import log
from lmforge.data.chat import read_sft_examples
from lmforge.data.loader import ReplaySource
from lmforge.data.packing import pack_examples, pad_examples
from lmforge.data.replay import check_replay, replay_rows
from lmforge.data.tokenizer import Tokenizer
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext
from lmforge.objectives.distill import DistillConfig
from lmforge.objectives.ewc import EWCConfig
from lmforge.objectives.sft import SFTObjective
from lmforge.peft.lora import LoraConfig
from lmforge.stages.finetune import FinetuneStage, adapter_line, run_finetune
from lmforge.stages.scoring import RENAMED_EVAL_KEYS, ScoreConfig, named_scorer
from lmforge.train.dp import DPConfig, privacy_line
from lmforge.train.loop import TrainConfig, precision_line
from lmforge.train.metrics import loss_curve_lines


@dataclass
class SFTDataConfig:
    train: list[str] = option(default_factory=list, help="JSONL/Parquet files or globs")
    val: list[str] = option(default_factory=list, help="held-out JSONL/Parquet files or globs: validation loss")
    max_length: int = positive(512, help="tokens per example (and per packed row)")
    packing: bool = option(True, help="several examples per row, block-diagonal attention")
    on_bad: Literal["error", "skip"] = option("error", help="an invalid example: stop, or skip and count")
    on_too_long: Literal["error", "truncate", "skip"] = option(
        "error", help="an example past max_length: an error, its first max_length tokens kept, or skipped and counted"
    )
    seed: int = seed_field(0, help="the seed of the training rows' order")
    replay: list[ReplaySource] = option(
        default_factory=list,
        help="pre-training data (`lmforge prepare` directories) replayed at a share of the training rows, windows of "
        "max_length tokens trained with the plain LM loss on every token (docs/continual-learning.md)",
    )

    def __post_init__(self) -> None:
        if sum(r.share for r in self.replay) >= 1:
            raise ValueError(f"replay shares sum to {sum(r.share for r in self.replay):g}; they must leave the chat "
                             "examples a share (sum below 1)")


@dataclass
class SFTObjectiveConfig:
    """The masked causal LM loss has one option: which tokens carry it (the labels built from the chat)."""

    assistant_only: bool = option(True, help="loss on assistant turns only (else on every token)")


@dataclass
class SFTRecipe:
    run_dir: str = option(
        "runs/sft",
        help="the run directory: config.yaml, metrics.jsonl, checkpoints/, final/ (the trained model), summary.json",
    )
    checkpoint: str = option("runs/pretrain", help="base model: a checkpoint, a run directory, or an imported HF model")
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    objective: SFTObjectiveConfig = field(default_factory=SFTObjectiveConfig)
    lora: LoraConfig | None = option(None, help="set to fine-tune adapters only (use_dora for DoRA)")
    dp: DPConfig | None = option(None, help="set to train with DP-SGD (per-example clipping, Gaussian noise, Poisson "
                                 "sampling, an accountant's ε): docs/privacy.md; needs data.packing=false")
    ewc: EWCConfig | None = option(None, help="set to add EWC's (λ/2)·Σ F(θ − θ*)² to the loss, F and θ* from "
                                   "`lmforge fisher` (docs/continual-learning.md)")
    distill: DistillConfig | None = option(None, help="set to mix a teacher's softened next-token distribution into the "
                                           "loss (Hinton et al. 2015); the pre-trained model as teacher is "
                                           "self-distillation against forgetting (docs/distillation.md)")
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-4, warmup_steps=10, eval_every=50))
    score: ScoreConfig = option(default_factory=ScoreConfig, help="scored before and after training (none by default)")
    parallel: ParallelConfig = option(
        default_factory=ParallelConfig, help="read under torchrun: dp_shard, dp_replicate"
    )

    RENAMED_KEYS: ClassVar[dict[str, Renamed]] = {"data.assistant_only": Renamed("objective.assistant_only"),
                                                  **RENAMED_EVAL_KEYS}


def build_rows(examples: list, max_length: int, packing: bool, pad_id: int) -> dict[str, torch.Tensor]:
    pairs = [(e.input_ids, e.labels) for e in examples]
    return pack_examples(pairs, max_length, pad_id) if packing else pad_examples(pairs, pad_id, pad_to=max_length)


def sft_stage(recipe: SFTRecipe, parallel: ParallelContext | None = None) -> FinetuneStage:
    """Chat examples (labels on the assistant's tokens), packed or padded rows, the masked loss."""
    d = recipe.data

    def read_examples(paths: list[str], tok, max_length: int, **read) -> list:
        return list(read_sft_examples(paths, tok, max_length, assistant_only=recipe.objective.assistant_only, **read))

    def rows(examples: list, tok) -> dict[str, torch.Tensor]:
        built = build_rows(examples, d.max_length, d.packing, tok.pad_id)
        log.info("sft: %d examples in %d rows of %d tokens (%s)", len(examples), len(built["input_ids"]),
                 d.max_length, "packed" if d.packing else "padded")
        return built

    return FinetuneStage("sft", read_examples, rows, objective=lambda _reference: SFTObjective(),
                         scorer=lambda run, _val_rows: named_scorer(recipe.score, run.tok, d.val),
                         replay=(lambda built: replay_rows(built, d.replay, d.seed)) if d.replay else None)


def run_sft(recipe: SFTRecipe) -> dict:
    if recipe.data.replay:  # before anything is written: each set is there, of the model's tokenizer
        check_replay(recipe.data.replay, Tokenizer.load(resolve_checkpoint(recipe.checkpoint, verify=False)).sha256)
    return run_finetune(recipe, "sft", sft_stage)


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: data, validation loss, exact match before and after."""
    out = [f"- {res.get('train_examples')} training examples, {res.get('step')} steps in {res.get('wall_s', 0):.0f} s"
           f"{' (LoRA)' if res.get('lora') else ''}; model in `{res.get('final_checkpoint')}`",
           adapter_line(res, "sft", "recipes/demo/sft.yaml")]
    skipped = (res.get("skipped") or {}).get("by_reason") or {}
    out.append(f"- examples skipped or truncated: {sum(skipped.values())} {skipped if skipped else ''}".rstrip())
    if res.get("val_loss") is not None:
        out.append(f"- validation loss **{res['val_loss']:.4f}** nats/token (assistant tokens)")
    before, after = (res.get("before") or {}).get("exact_match"), (res.get("after") or {}).get("exact_match")
    if before and after:
        out.append(f"- exact match on {after['examples']} validation tasks: **{100 * before['exact_match']:.1f}% before, "
                   f"{100 * after['exact_match']:.1f}% after**")
    out += precision_line(res) + privacy_line(res)
    return out + loss_curve_lines(stage_dir, plot_path)


RECIPE = SFTRecipe
run = run_sft
