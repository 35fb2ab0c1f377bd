"""Preference optimisation of a fine-tuned checkpoint on paired data, through the one training
loop: DPO and its variants (`loss: dpo | ipo | cdpo | rdpo | hinge`, against a frozen
reference) or the reference-free SimPO, ORPO and CPO (`loss: simpo | orpo | cpo`). Reads TRL's
preference format, `prompt`/`chosen`/`rejected` (plain strings or conversational, from JSONL
or Parquet). Full fine-tuning, or LoRA/DoRA/QLoRA with `lora:`, where the reference is the
model with its adapters disabled. Reference log-probs are computed once before training
(`precompute_reference: true`) or on the fly. Logs rewards of chosen and rejected, margins,
preference accuracy and KL, and reports validation margins, the model's own pairwise
preference (log-likelihood of chosen above rejected) and greedy exact-match accuracy,
before and after training.

  lmforge dpo recipes/demo/dpo.yaml
  lmforge dpo recipes/demo/dpo.yaml loss=ipo beta=0.5
  lmforge dpo recipes/demo/dpo.yaml loss=cdpo label_smoothing=0.1 lora.r=16

Under torchrun it trains data-parallel with FSDP2 (full fine-tuning or LoRA/DoRA), laid out
by its `parallel:` section (dp_shard, dp_replicate; see docs/distributed.md). Each rank
precomputes the reference log-probs of its share of the rows, and a live full fine-tuning
reference is sharded as the policy is:

  torchrun --standalone --nproc_per_node=2 -m lmforge dpo recipes/distributed/cpu_fsdp_dpo.yaml
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from lmforge.core.config import positive, seed_field
from lmforge.core.io import atomic_write_json
from lmforge.core.run import completed_summary, log
from lmforge.data.preference import pair_rows, read_preference_pairs
from lmforge.data.rows import RowLoader
from lmforge.data.tokenizer import Tokenizer
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext, data_parallel_rank
from lmforge.distributed.parallelize import parallelize_model, reshard
from lmforge.objectives.dpo import PreferenceLossConfig, PreferenceObjective
from lmforge.objectives.reference import (
    Reference,
    completion_logprobs,
    policy_reference,
    precompute_logprobs,
    untrained_policy_reference,
)
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
from lmforge.train.loop import TrainConfig, autocast_context, evaluate, train
from lmforge.train.metrics import loss_curve_lines


@dataclass
class PreferenceDataConfig:
    train: list[str] = field(default_factory=list)  # JSONL/Parquet files or globs
    val: list[str] = field(default_factory=list)  # held-out pairs: validation margins and accuracy
    max_length: int = positive(512)  # tokens of prompt + completion
    on_bad: Literal["error", "skip"] = "error"  # a bad record (identical pair, empty completion, prompt too long...)
    # a completion past max_length: truncated (TRL's DPO/KTO keep_start), skipped and counted, or an error;
    # the reward stage skips by default (RewardDataConfig), as a reward read at a cut-off token is meaningless
    on_too_long: Literal["error", "truncate", "skip"] = "truncate"
    seed: int = seed_field(0)


@dataclass
class DPORecipe(PreferenceLossConfig):
    run_dir: str = "runs/dpo"
    checkpoint: str = "runs/sft"  # the policy to start from (and the reference): usually the SFT model
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    lora: LoraConfig | None = None  # adapters only; the reference is then the model with adapters disabled
    precompute_reference: bool = True  # reference log-probs in one pass before training (no reference in memory after)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=5e-6, warmup_steps=10, eval_every=50,
                                                                   micro_batch_size=4, batch_tokens=4096))
    eval: ExactMatchConfig = field(default_factory=ExactMatchConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # read under torchrun: dp_shard, dp_replicate


def equal_share(n: int, rank: int, world: int) -> tuple[slice, int]:
    """Rank ``rank``'s contiguous share of ``n`` rows split ``world`` ways, and how many rows of
    padding bring it to the size of every other share (ceil(n / world)), so all run the same batches."""
    per = -(-n // world)
    start, stop = min(rank * per, n), min((rank + 1) * per, n)
    return slice(start, stop), per - (stop - start)


def attach_reference(reference: Reference, rows: dict[str, torch.Tensor], names: dict[str, str],
                     batch_size: int, device: torch.device, precision: str,
                     parallel: ParallelContext | None = None) -> None:
    """Add the reference's log-probs to ``rows``: ``names`` maps row prefix -> new column.

    Under ``parallel`` the reference is the sharded policy, whose every forward all ranks take
    part in: each data-parallel rank scores an equal share of the rows (the last share padded
    with copies of the first row, whose scores are dropped), and the shares are gathered, so
    every rank ends with every column."""
    rank, world = data_parallel_rank(parallel)
    share, pad = equal_share(len(next(iter(rows.values()))), rank, world)
    mine = {key: torch.cat([value[share], value[:1].expand(pad, *value.shape[1:])]) if pad else value[share]
            for key, value in rows.items()}
    for prefix, column in names.items():
        logps = precompute_logprobs(reference, mine, prefix, batch_size, device,
                                    lambda: autocast_context(device, precision))[: share.stop - share.start]
        if parallel is not None:
            shares: list[torch.Tensor | None] = [None] * world
            dist.all_gather_object(shares, logps, group=parallel.dp_flat.get_group())
            logps = torch.cat(shares)
        rows[column] = logps


@torch.no_grad()
def pairwise_preference(model: torch.nn.Module, rows: dict[str, torch.Tensor], batch_size: int,
                        device: torch.device, precision: str) -> dict:
    """How often the model itself prefers chosen: logπ(chosen) > logπ(rejected), summed and
    length-averaged, and the mean summed log-prob margin. Comparable across every loss."""
    was_training = model.training
    model.eval()
    scores = {}
    try:
        for side in ("chosen", "rejected"):
            sums, counts = [], []
            for start in range(0, len(rows[f"{side}_input_ids"]), batch_size):
                cols = slice(start, start + batch_size)
                with autocast_context(device, precision):
                    s, n = completion_logprobs(model, rows[f"{side}_input_ids"][cols].to(device),
                                               rows[f"{side}_labels"][cols].to(device),
                                               rows[f"{side}_attention_mask"][cols].to(device))[:2]
                sums.append(s.float().cpu())
                counts.append(n.cpu())
            scores[side] = (torch.cat(sums), torch.cat(counts).clamp(min=1))
    finally:
        model.train(was_training)
    (c, nc), (r, nr) = scores["chosen"], scores["rejected"]
    return {"pairs": len(c), "logp_accuracy": float((c > r).float().mean()),
            "avg_logp_accuracy": float((c / nc > r / nr).float().mean()), "logp_margin": float((c - r).mean())}


def run_preference_training(recipe, objective_for: Callable[[Reference | None], object], rows_for: Callable,
                            reference_columns: dict[str, str], needs_reference: bool, stage: str,
                            read_examples: Callable, rows_per_example: int, loss_name: str,
                            measure_for: Callable[[Tokenizer], Callable | None] | None = None,
                            check_examples: Callable | None = None, parallel: ParallelContext | None = None) -> dict:
    """The shared body of ``lmforge dpo`` and ``lmforge kto``: data, reference, loop, result.

    ``measure_for(tok)`` reads what the stage scores the model on (so its input errors stop
    every rank alike) and returns ``measure(model, val_rows, batch_size, device, precision)``,
    which scores the model before and after training; ``check_examples(train_examples)``
    runs once the data is read (KTO's weight balance).

    Under ``parallel`` (a data-parallel ``torchrun`` job) every rank loads the whole base;
    rank 0 alone scores it (exact match, ``measure``) before anything is sharded. The policy
    (and a live frozen reference) is then sharded with FSDP2; the reference log-probs are
    precomputed by the sharded policy, each rank its share, so they come from the forward
    the policy trains with (FSDP's mixed precision included); each rank trains on its rows of
    every global batch, and rank 0 scores the gathered model after training and writes the result.
    """
    run = start_finetune_run(recipe, stage, read_examples, parallel=parallel)
    logging_rank = parallel is None or parallel.is_logging_rank
    if check_examples is not None and logging_rank:
        check_examples(run.train_examples)
    run_dir, device, precision, model, tok = run.run_dir, run.device, run.precision, run.model, run.tok
    train_examples, val_examples, skipped = run.train_examples, run.val_examples, run.skipped
    cfg, d = run.train_config(recipe.train), recipe.data
    rank, dp = data_parallel_rank(parallel)
    train_rows = rows_for(train_examples, tok.pad_id, d.max_length, d.seed)
    val_rows = rows_for(val_examples, tok.pad_id, d.max_length, d.seed) if val_examples else None
    tasks = exact_match_tasks(tok, task_files(recipe.eval, d.val), recipe.eval.max_examples)
    measure = measure_for(tok) if measure_for is not None else None

    def score(model) -> dict:
        """Exact match and ``measure`` of the whole model, by rank 0 (greedy decoding draws no
        random numbers, so the ranks' LoRA initialisations stay the same)."""
        if not logging_rank:
            return {}
        result = {"exact_match": exact_match_accuracy(model, tok, *tasks, recipe.eval)}
        if measure is not None:
            result.update(measure(model, val_rows, cfg.micro_batch_size, device, precision))
        return result

    before = score(model)
    if logging_rank:
        log.info("%s: before training %s", stage, before)
    if recipe.lora is not None:
        wrap_lora(model, recipe.lora, stage)

    def shard_reference(module: torch.nn.Module) -> None:
        """A frozen copy sharded as the policy; it never runs backward, so every group, the root
        too, frees its gathered weights after each forward."""
        parallelize_model(module, parallel, precision=cfg.precision, activation_checkpointing=False, compile=False)
        module.set_reshard_after_forward(True)

    reference = None
    if needs_reference and not recipe.precompute_reference:  # adapters disabled with LoRA, else a frozen copy
        reference = policy_reference(model, prepare=shard_reference if parallel is not None else None)
    if parallel is not None:
        parallelize_model(model, parallel, precision=cfg.precision, activation_checkpointing=cfg.activation_checkpointing,
                          compile=cfg.compile)
    if needs_reference and recipe.precompute_reference:
        t0 = time.perf_counter()
        scorer = untrained_policy_reference(model)  # not yet updated, so the policy is its own reference: no copy
        for rows in (train_rows, val_rows):
            if rows is not None:
                attach_reference(scorer, rows, reference_columns, 2 * cfg.micro_batch_size, device, precision, parallel)
        if parallel is not None:
            reshard(model)
        log.info("%s: reference log-probs precomputed in %.1f s", stage, time.perf_counter() - t0)
    objective = objective_for(reference)
    val_batches = validation_batches(val_rows, cfg.micro_batch_size, rank, dp)
    if val_batches:
        before.update(evaluate(model, objective, val_batches(), device, precision, cfg.eval_batches, parallel))
    per_token = model.cfg.flops_per_token(d.max_length)
    summary = train(
        model=model,
        objective=objective,
        train_batches=RowLoader(train_rows, cfg.micro_batch_size, seed=d.seed, rank=rank, world_size=dp),
        cfg=cfg,
        run_dir=run_dir,
        recipe=recipe,
        grad_accum=row_accumulation_steps(cfg, d.max_length, rows_per_example, world_size=dp),
        val_batches=val_batches,
        # a live reference adds a forward (2N) to the policy's forward and backward (6N) per token
        flops_per_token=per_token * (4 / 3 if reference is not None else 1),
        tokenizer_dir=run.tok_dir,
        parallel=parallel,
    )
    if (stored := completed_summary(run_dir, summary)) is not None:  # a rerun: the run's own summary stands
        return {**stored, **summary}
    objective = reference = None  # a live reference's sharded copy goes with them
    model = gathered_for_saving(run, model, summary, recipe.lora, parallel)
    if model is None:
        return summary
    model.to(device)  # a no-op in one process; rank 0's gathered copy, once the shards are gone
    final = save_finetuned(model, run_dir, run.tok_dir, run.base_dir, recipe.lora)
    after = score(model)
    after.update({k: v for k, v in summary.items() if k.startswith("val_")})
    summary.update(train_examples=len(train_examples), val_examples=len(val_examples), skipped=skipped.to_dict(),
                   before=before, after=after, final_checkpoint=str(final), lora=recipe.lora is not None,
                   loss=loss_name)
    atomic_write_json(run_dir / "summary.json", summary)
    log.info("%s: after training %s; model in %s", stage, after, final)
    return summary


def run_dpo(recipe: DPORecipe) -> dict:
    return run_data_parallel(recipe, "dpo", lambda ctx: train_dpo(recipe, ctx))


def train_dpo(recipe: DPORecipe, parallel: ParallelContext | None = None) -> dict:
    """The DPO run in one process, or on one rank of a data-parallel ``torchrun`` job."""
    loss_cfg = PreferenceLossConfig(recipe.loss, recipe.beta, recipe.label_smoothing, recipe.simpo_gamma,
                                    recipe.cpo_alpha, recipe.sft_weight)
    return run_preference_training(
        recipe,
        objective_for=lambda reference: PreferenceObjective(loss_cfg, reference),
        rows_for=lambda examples, pad_id, max_length, seed: pair_rows(examples, pad_id),
        reference_columns={"chosen_": "ref_chosen_logps", "rejected_": "ref_rejected_logps"},
        needs_reference=loss_cfg.needs_reference,
        stage="dpo",
        read_examples=read_preference_pairs,
        rows_per_example=2,  # chosen and rejected
        loss_name=recipe.loss,
        measure_for=lambda _tok: lambda model, rows, *args: pairwise_preference(model, rows, *args) if rows else {},
        parallel=parallel,
    )


def _pct(result: dict | None, key: str = "exact_match") -> str:
    value = (result or {}).get(key)
    if isinstance(value, dict):
        value = value.get("exact_match")
    return "n/a" if value is None else f"{100 * value:.1f}%"


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: data, margins, preference and exact-match accuracy before and after."""
    before, after = res.get("before") or {}, res.get("after") or {}
    out = [f"- loss `{res.get('loss')}`: {res.get('train_examples')} training pairs, {res.get('step')} steps in "
           f"{res.get('wall_s', 0):.0f} s{' (LoRA)' if res.get('lora') else ''}; model in `{res.get('final_checkpoint')}`"]
    skipped = (res.get("skipped") or {}).get("by_reason") or {}
    if skipped:
        out.append(f"- examples skipped or truncated: {sum(skipped.values())} {skipped}")
    if "val_margin" in after:
        start = round(before.get("val_margin", 0.0), 3) + 0.0  # no "-0.000" at policy == reference
        out.append(f"- validation reward margin **{start:.3f} → {after['val_margin']:.3f}**, implicit-reward "
                   f"preference accuracy {_pct(before, 'val_accuracy')} → {_pct(after, 'val_accuracy')}")
    if "logp_accuracy" in after:
        out.append(f"- the model's own preference (log-prob of chosen > rejected) on {after['pairs']} held-out pairs: "
                   f"{_pct(before, 'logp_accuracy')} → **{_pct(after, 'logp_accuracy')}**")
    if after.get("exact_match"):
        out.append(f"- exact match on {after['exact_match']['examples']} tasks: **{_pct(before)} before, "
                   f"{_pct(after)} after**")
    return out + loss_curve_lines(stage_dir, plot_path)


RECIPE = DPORecipe
run = run_dpo
