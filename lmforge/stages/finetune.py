"""The one fine-tuning skeleton: what sft, reward, dpo and kto do around the training loop, in
order, once. A stage hands ``train_finetune`` a ``FinetuneStage`` (how its rows are read and
built, its objective, its scorer, its reference) and writes only its recipe and report lines.

The order, in one process and on every rank of a data-parallel ``torchrun`` job:
data paths checked -> run started -> seeded -> base loaded -> examples read -> precision chosen
-> rows built -> scored before (rank 0, the whole base) -> ``prepare_model`` (adapters, a head,
activation checkpointing, compile, FSDP2) -> reference (precomputed by the untrained policy, or
live) -> validation figures before -> ``train()`` -> gathered on rank 0 -> ``final/`` (+
``adapter/``) -> scored after -> ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

import lmforge.objectives.reference as references
from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.files import TOKENIZER_FILES, load_model_config
from lmforge.checkpoints.load import load_model, resolve_checkpoint
from lmforge.core.config import ConfigError, option, positive, seed_field
from lmforge.core.io import InputError, atomic_write_json, expand_paths
from lmforge.core.run import completed_summary, log, run_dir_lock, start_run
from lmforge.data.chat import add_chat_template, read_sft_records
from lmforge.data.documents import SkipLog
from lmforge.data.poisson import PoissonRowLoader
from lmforge.data.replay import RowGroups
from lmforge.data.rows import RowLoader
from lmforge.data.tokenizer import Tokenizer
from lmforge.distributed.memory import check_memory_fits
from lmforge.distributed.mesh import (
    Layout,
    ParallelContext,
    data_parallel_rank,
    launched_world_size,
    parallel_session,
    resolve_layout,
)
from lmforge.distributed.parallelize import reshard
from lmforge.model.mtp import check_depth
from lmforge.model.transformer import Transformer
from lmforge.objectives.distill_teacher import check_replay, check_teacher, teacher_objective
from lmforge.objectives.ewc import check_ewc, checkpoint_shapes, ewc_objective
from lmforge.objectives.reference import Reference, precompute_logprobs
from lmforge.stages.export import ExportRecipe, run_export
from lmforge.stages.scoring import Scorer, eval_tasks_scorer
from lmforge.train.dp import PrivacyPlan, check_dp_recipe
from lmforge.train.finetune import gathered_for_saving, row_accumulation_steps, save_finetuned, validation_batches
from lmforge.train.loop import TrainConfig, autocast_context, evaluate, run_precision, train
from lmforge.train.prepare import check_lora_shapes, prepare_model

BASE_EXPORT = "base-hf"  # a LoRA run's base as a Hugging Face folder, the base its adapter names


@dataclass
class PreferenceDataConfig:
    """The ``data:`` section of the preference stages (dpo, kto, reward)."""

    train: list[str] = option(default_factory=list, help="JSONL/Parquet files or globs")
    val: list[str] = option(default_factory=list, help="held-out pairs: validation margins and accuracy")
    max_length: int = positive(512, help="tokens of prompt + completion")
    on_bad: Literal["error", "skip"] = option(
        "error", help="a bad record (identical pair, empty completion, prompt too long...)"
    )
    on_too_long: Literal["error", "truncate", "skip"] = option(
        "truncate",
        help="a completion past max_length: truncated (TRL's DPO/KTO keep_start), skipped and counted, or an error; "
        "the reward stage skips by default (RewardDataConfig), as a reward read at a cut-off token is meaningless",
    )
    seed: int = seed_field(0, help="the seed of the training rows' order")


@dataclass
class FinetuneStage:
    """What one fine-tuning stage brings to the skeleton; everything else is the same for all.

    ``read_examples(paths, tok, max_length, on_bad=, on_too_long=, skipped=)`` returns a list;
    ``rows(examples, tok)`` the tensors the ``RowLoader`` serves; ``objective(reference)`` the
    loss (``reference`` is None unless ``reference_columns`` asks for a live one);
    ``scorer(run, val_rows)`` reads what the model is scored on before and after training (on
    every rank, so input errors stop all alike) and returns the ``Scorer`` or None.
    """

    name: str
    read_examples: Callable[..., list]
    rows: Callable[[list, Tokenizer], dict[str, torch.Tensor]]
    objective: Callable[[Reference | None], Any]
    scorer: Callable[[FinetuneRun, dict[str, torch.Tensor] | None], Scorer | None] | None = None
    rows_per_example: int = 1  # rows ``train.batch_tokens`` counts per example (a pair: chosen and rejected)
    # a reference model: row prefix -> the column of its log-probs (None: the objective needs none)
    reference_columns: dict[str, str] | None = None
    precompute_reference: bool = True  # its log-probs in one pass before training, else a live reference
    head: Callable[[Transformer], nn.Module] | None = None  # a module trained around the base (RewardModel)
    check_examples: Callable[[list], None] | None = None  # on rank 0, once the training examples are read
    # rows mixed into the training rows, and each row's group (sft's replay of pre-training windows)
    replay: Callable[[dict[str, torch.Tensor]], tuple[dict[str, torch.Tensor], RowGroups]] | None = None
    data_paths: dict[str, list[str]] = field(default_factory=dict)  # more recipe keys naming files (kto's `pairs`)
    summary: dict = field(default_factory=dict)  # fixed entries of the summary (dpo's `loss`)
    # a batch source in place of the RowLoader over ``rows`` (RL: rollouts of the policy being trained),
    # built from the prepared model: ``batches(run, model, cfg)`` -> (loader, micro-batches per step)
    batches: Callable[[FinetuneRun, nn.Module, TrainConfig], tuple[Any, int]] | None = None


@dataclass
class FinetuneRun:
    """What the skeleton has set up before the model is prepared."""

    run_dir: Path
    device: torch.device
    precision: str  # chosen once, before the stage evaluates or scores anything
    model: Transformer | None  # the base; handed to ``prepare_model`` (then None here)
    tok: Tokenizer
    tok_dir: Path
    base_dir: Path
    train_examples: list
    val_examples: list
    skipped: SkipLog
    precision_reason: str = ""  # why, for the summary and the report

    def train_config(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` with the precision chosen here, so the loop trains in the one the stage evaluated in."""
        return dataclasses.replace(cfg, precision=self.precision)


def run_data_parallel(recipe, stage: str, body: Callable[[ParallelContext | None], dict]) -> dict:
    """``body(None)`` in one process, or ``body(ctx)`` on every rank of a ``torchrun`` launch laid
    out by ``recipe.parallel``: data-parallel only (FSDP2 / HSDP). Any other layout, and QLoRA,
    are refused before any work."""
    layout = resolve_layout(recipe.parallel, launched_world_size())  # an impossible layout fails before any work
    if layout.world_size == 1:
        with run_dir_lock(recipe.run_dir):  # a second run into it fails at once, naming this one
            return body(None)
    problems = []
    if layout.tp > 1 or layout.pp > 1:
        problems.append(f"parallel.tp={layout.tp} and parallel.pp={layout.pp}: {stage} shards data-parallel only "
                        f"(parallel.dp_shard, parallel.dp_replicate); set parallel.tp=1 and parallel.pp=1")
    if recipe.train.eval_tasks:
        problems.append("train.eval_tasks scores in one process only so far; launch it without torchrun or set "
                        "train.eval_tasks=[]")
    if getattr(recipe, "distill", None) is not None:
        problems.append("distill runs in one process only so far; launch it without torchrun or remove distill")
    if recipe.lora is not None and recipe.lora.quantize_base:
        problems.append(f"lora.quantize_base={recipe.lora.base_format.name} (QLoRA) runs in one process only so far; "
                        "launch it without torchrun or set lora.quantize_base=false")
    if problems:
        raise ConfigError(f"{stage} under torchrun ({layout}):\n  - " + "\n  - ".join(problems))
    with (parallel_session(recipe.parallel, recipe.train.device) as ctx,
          run_dir_lock(recipe.run_dir, enabled=ctx.is_logging_rank)):  # rank 0 holds it for the job
        return body(ctx)


def run_finetune(recipe, name: str, stage: Callable[[Any, ParallelContext | None], FinetuneStage]) -> dict:
    """A fine-tuning stage's ``run(recipe)``: ``train_finetune`` with ``stage(recipe, ctx)`` in one
    process (``ctx`` None) or on every rank of a data-parallel torchrun job."""
    return run_data_parallel(recipe, name, lambda ctx: train_finetune(recipe, stage(recipe, ctx), ctx))


def train_finetune(recipe, stage: FinetuneStage, parallel: ParallelContext | None = None) -> dict:
    """The fine-tuning run of ``recipe`` (``run_dir``, ``checkpoint``, ``data``, ``lora``, ``train``,
    ``parallel``) in one process, or on one rank of a data-parallel ``torchrun`` job (``parallel``).

    There every rank loads the whole base and reads every example; rank 0 alone scores the whole
    base before anything is sharded, and the gathered model after training, and writes the run.
    The model is sharded with FSDP2; a precomputed reference is scored by the sharded policy, each
    rank its share, so it comes from the forward the policy trains with (FSDP's mixed precision
    included); a live frozen reference is sharded as the policy is; each rank trains on its rows
    of every global batch."""
    run = start_finetune_run(recipe, stage, parallel)
    logging_rank = parallel is None or parallel.is_logging_rank
    if stage.check_examples is not None and logging_rank:
        stage.check_examples(run.train_examples)
    cfg, d, device, precision = run.train_config(recipe.train), recipe.data, run.device, run.precision
    rank, dp = data_parallel_rank(parallel)
    train_rows, groups = stage.rows(run.train_examples, run.tok), None
    if stage.replay is not None:
        train_rows, groups = stage.replay(train_rows)
    val_rows = stage.rows(run.val_examples, run.tok) if run.val_examples else None
    scorer = stage.scorer(run, val_rows) if stage.scorer is not None else None
    in_loop = in_loop_scorer(cfg, run.tok, stage)
    before = scorer(run.model) if scorer is not None and logging_rank else {}

    model, run.model = run.model, None
    live = stage.reference_columns is not None and not stage.precompute_reference
    reference = None
    if live and recipe.lora is None:  # a frozen copy of the base, prepared as the policy is but never trained
        reference = references.frozen_copy_reference(
            model, prepare=lambda copy: prepare_model(copy, cfg, parallel, frozen=True))
    # DP-SGD's per-example gradients need every weight on each rank: its model is replicated, not sharded
    private = getattr(recipe, "dp", None) is not None
    model = prepare_model(model, cfg, None if private else parallel, lora=recipe.lora, head=stage.head, stage=stage.name)
    if live and recipe.lora is not None:  # the policy with its adapters disabled: no second copy
        reference = references.policy_reference(model)
    if stage.reference_columns is not None and stage.precompute_reference:
        precompute_reference(model, [train_rows, val_rows], stage.reference_columns, cfg, device, parallel, stage.name)
    objective = teacher_objective(stage.objective(reference), getattr(recipe, "distill", None), device, run.run_dir,
                                  lambda: RowLoader(train_rows, 2 * cfg.micro_batch_size, shuffle=False, loop=False))
    objective = ewc_objective(objective, getattr(recipe, "ewc", None), model, parallel)
    val_batches = validation_batches(val_rows, cfg.micro_batch_size, rank, dp)
    if val_batches:
        before.update(evaluate(model, objective, val_batches(), device, precision, cfg.eval_batches, parallel))
    if logging_rank:
        log.info("%s: before training: %s", stage.name, format_results(before))
    privacy = None
    if stage.batches is not None:
        train_batches, grad_accum = stage.batches(run, model, cfg)
    else:
        grad_accum = row_accumulation_steps(cfg, d.max_length, stage.rows_per_example, world_size=dp)
        train_batches = RowLoader(train_rows, cfg.micro_batch_size, seed=d.seed, rank=rank, world_size=dp, groups=groups)
    if getattr(recipe, "dp", None) is not None:  # DP-SGD: a Poisson sample of the rows, the recipe's batch on average
        privacy = PrivacyPlan(recipe.dp, len(run.train_examples), grad_accum * cfg.micro_batch_size * dp, cfg.max_steps)
        train_batches = PoissonRowLoader(train_rows, privacy.sample_rate, seed=recipe.dp.seed, rank=rank, world_size=dp)
        grad_accum = 1  # the step's one batch, which the DP runner splits into micro-batches
    summary = train(
        model=model,
        objective=objective,
        train_batches=train_batches,
        cfg=cfg,
        run_dir=run.run_dir,
        recipe=recipe,
        grad_accum=grad_accum,
        val_batches=val_batches,
        # a live reference adds a forward (2N) to the policy's forward and backward (6N) per token
        flops_per_token=model.cfg.flops_per_token(d.max_length) * (4 / 3 if reference is not None else 1),
        tokenizer_dir=run.tok_dir,
        parallel=parallel,
        precision_reason=run.precision_reason,
        scorer=in_loop,
        privacy=privacy,
    )
    if (stored := completed_summary(run.run_dir, summary)) is not None:  # a rerun: the run's own summary stands
        return {**stored, **summary}
    summary["tokens_per_step"] = grad_accum * cfg.micro_batch_size * stage.rows_per_example * d.max_length * dp
    objective = reference = None  # a live reference's sharded copy goes with them
    model = gathered_for_saving(model, summary, recipe.lora, parallel, wrap=stage.head)
    if model is None:
        return summary
    model.to(device)  # a no-op in one process; rank 0's gathered copy, once the shards are gone
    backbone = model.backbone if stage.head is not None else model
    adapter_base = export_adapter_base(run.base_dir, run.run_dir) if recipe.lora is not None else None
    final = save_finetuned(backbone, run.run_dir, run.tok_dir, adapter_base, recipe.lora,
                           write_extra=model.save_head if stage.head is not None else None)
    after = scorer(model) if scorer is not None else {}
    after.update({k: v for k, v in summary.items() if k.startswith("val_")})
    summary.update(train_examples=len(run.train_examples), val_examples=len(run.val_examples),
                   skipped=run.skipped.to_dict(), before=before, after=after, final_checkpoint=str(final),
                   lora=recipe.lora is not None, **stage.summary)
    atomic_write_json(run.run_dir / "summary.json", summary)
    log.info("%s: after training: %s; model in %s", stage.name, format_results(after), final)
    return summary


def in_loop_scorer(cfg: TrainConfig, tok: Tokenizer, stage: FinetuneStage) -> Scorer | None:
    """The scorer of ``train.eval_tasks`` the loop runs every ``eval_every`` steps (None without
    tasks); a stage that trains a head (the reward model) has no language model to score."""
    if cfg.eval_tasks and stage.head is not None:
        raise ConfigError(f"train.eval_tasks: {stage.name} trains a {stage.name} head, not a language model that tasks "
                          "could score; set train.eval_tasks=[]")
    return eval_tasks_scorer(cfg.eval_tasks, tok, 2 * cfg.micro_batch_size)


def format_results(results: dict) -> str:
    """Scores and validation figures for the console: ``val_loss 0.6931, exact_match {exact_match
    0.1067, examples 150}`` (4 significant digits), not a Python dict's 17."""
    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + format_results(v) + "}"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return ", ".join(f"{k} {value(v)}" for k, v in results.items()) or "nothing scored"


def adapter_line(res: dict, verb: str, recipe: str) -> str:
    """The report's line on the run's adapter: where it and its base are (LoRA), or how to get one
    (full fine-tuning writes none), so a user of a full fine-tuning lifecycle learns where adapters come from."""
    run_dir = Path(res.get("final_checkpoint") or "run").parent
    if res.get("lora"):
        return (f"- LoRA adapter (PEFT format) in `{run_dir / 'adapter'}`, its base as a Hugging Face folder in "
                f"`{run_dir / BASE_EXPORT}`: `peft.AutoPeftModelForCausalLM.from_pretrained` loads both")
    return (f"- full fine-tuning, so no adapter: the same stage with `lora.r=16 lora.alpha=32` writes a PEFT-format "
            f"one to its `adapter/` (e.g. `lmforge {verb} {recipe} lora.r=16 lora.alpha=32 train.lr=3e-3 "
            f"run_dir={run_dir}-lora`)")


def export_adapter_base(base_dir: Path, run_dir: Path) -> Path:
    """``run_dir/base-hf``: the Hugging Face export of the base a LoRA run's adapter applies to
    (with the ChatML template the adapter was trained on), which the adapter's
    ``adapter_config.json`` names, as TRL's adapters name their hub base. It holds a full copy of
    the base's weights (the demo's: a few MB). A base with no Hugging Face equivalent (LayerNorm,
    GELU) is not exported: the adapter then names the lmforge checkpoint, and a warning says so."""
    out = run_dir / BASE_EXPORT
    try:
        run_export(ExportRecipe(checkpoint=str(base_dir), run_dir=str(out)), chat=True)
    except InputError as exc:
        log.warning("the adapter names the lmforge checkpoint %s, which transformers cannot load: %s", base_dir, exc)
        return base_dir
    return out


def start_finetune_run(recipe, stage: FinetuneStage, parallel: ParallelContext | None = None) -> FinetuneRun:
    """The run directory, device and precision, the base model with its chat tokenizer, and the
    recipe's training and validation examples (bad ones counted in ``skipped``).

    Under ``parallel`` every rank reads all examples and loads the whole base, rank 0 alone
    writes the run directory and chooses the precision for all."""
    check_data_paths(recipe, stage)
    dp = getattr(recipe, "dp", None)
    check_dp_recipe(dp, getattr(recipe.data, "packing", False), count_records(recipe.data.train) if dp else None,
                    getattr(recipe, "ewc", None), recipe.lora)
    check_ewc(getattr(recipe, "ewc", None), lambda: checkpoint_shapes(recipe.checkpoint))  # before anything is written
    check_lora_shapes(recipe.lora, lambda: checkpoint_shapes(recipe.checkpoint))
    check_finetune_teacher(recipe)
    check_finetune_mtp(recipe, stage)
    device = parallel.device if parallel is not None else resolve_device(recipe.train.device)
    check_finetune_memory(recipe, device, parallel)
    logging_rank = parallel is None or parallel.is_logging_rank
    run_dir = start_run(recipe, recipe.run_dir) if logging_rank else Path(recipe.run_dir)
    precision, precision_reason = run_precision(recipe.train, run_dir, device, parallel)  # rank 0 chooses for every rank
    torch.manual_seed(recipe.train.seed)
    model, tok, tok_dir, base_dir = load_base(recipe.checkpoint, run_dir, device, recipe.data.max_length, parallel)
    d = recipe.data
    skipped = SkipLog()
    read = dict(on_bad=d.on_bad, on_too_long=d.on_too_long, skipped=skipped)
    train_examples = stage.read_examples(d.train, tok, d.max_length, **read)
    if not train_examples:
        raise InputError(f"no usable training examples in {d.train} ({skipped.total} skipped: {dict(skipped.by_reason)})")
    val_examples = stage.read_examples(d.val, tok, d.max_length, **read) if d.val else []
    log.info("%s: %d training and %d validation examples; %d skipped or truncated %s", stage.name, len(train_examples),
             len(val_examples), skipped.total, dict(skipped.by_reason) if skipped.total else "")
    return FinetuneRun(run_dir, device, precision, model, tok, tok_dir, base_dir, train_examples, val_examples,
                       skipped, precision_reason)


def count_records(paths: list[str]) -> int:
    """Records in a recipe's data files (before any is tokenized or skipped): DP's N, checked early."""
    return sum(1 for _ in read_sft_records(paths))


def check_finetune_mtp(recipe, stage: FinetuneStage) -> None:
    """A base with multi-token prediction modules (``model.mtp``): SFT trains them, so its rows must leave the
    deepest depth a target, and DP-SGD and distillation, whose losses read the main head only, are refused."""
    try:
        depth = load_model_config(resolve_checkpoint(recipe.checkpoint, verify=False)).mtp.depth
    except InputError:
        return  # no checkpoint there: load_base says so
    if not depth or stage.name != "sft":
        return  # the preference and reward stages leave the modules as they are (no gradient reaches them)
    problem = check_depth(depth, recipe.data.max_length, "data.max_length")
    for key in ("dp", "distill"):
        if getattr(recipe, key, None) is not None:
            problem = (f"{key}: the base {recipe.checkpoint} has model.mtp.depth = {depth} modules, which {key}'s loss "
                       "(the main head's only) would leave untrained; remove it, or fine-tune a base without them")
    if problem:
        raise ConfigError(problem)


def check_finetune_teacher(recipe) -> None:
    """A recipe's ``distill:`` teacher fits its base (tokenizer, vocabulary, context), before anything is written."""
    distill = getattr(recipe, "distill", None)
    if distill is not None:
        base = resolve_checkpoint(recipe.checkpoint, verify=False)
        model = load_model_config(base)
        check_teacher(distill.teacher, base, model.vocab_size, max(recipe.data.max_length, distill.replay_seq_len)
                      if distill.replay else recipe.data.max_length, distill.top_k)
        check_replay(distill, base)
        if distill.replay and distill.replay_seq_len > model.max_seq_len:
            raise InputError(f"distill.replay_seq_len {distill.replay_seq_len} exceeds the model's max_seq_len "
                             f"{model.max_seq_len}")


def check_data_paths(recipe, stage: FinetuneStage) -> None:
    """Every data path a fine-tuning recipe names matches a file, checked before any model is
    loaded; an error names the stage and the recipe key (``data.train``, ``data.val``,
    ``score.tasks``, a stage's own such as ``pairs``)."""
    if not recipe.data.train:
        raise InputError(f"{stage.name} data.train is empty: list the JSONL/Parquet files to train on")
    keys = {"data.train": recipe.data.train, "data.val": recipe.data.val, **stage.data_paths}
    score = getattr(recipe, "score", None)
    if score is not None and score.name != "none":
        keys["score.tasks"] = score.tasks
    for key, paths in keys.items():
        if paths:
            expand_paths(paths, what=f"{stage.name} {key}")


def check_finetune_memory(recipe, device: torch.device, parallel: ParallelContext | None) -> None:
    """Refuse a micro-batch of ``data.max_length`` rows the device cannot hold, from the base's
    config alone, before the base is loaded (``check_memory_fits``)."""
    model = load_model_config(resolve_checkpoint(recipe.checkpoint, verify=False))
    layout = parallel.layout if parallel is not None else Layout()
    check_memory_fits(model, recipe.parallel, layout, device, micro_batch_size=recipe.train.micro_batch_size,
                      seq_len=recipe.data.max_length, precision=recipe.train.precision,
                      activation_checkpointing=recipe.train.activation_checkpointing, seq_key="data.max_length",
                      adapters_only=recipe.lora is not None, optimizer=recipe.train.optimizer)


def load_base(checkpoint: str, run_dir: Path, device: torch.device, max_length: int,
              parallel: ParallelContext | None = None) -> tuple[Transformer, Tokenizer, Path, Path]:
    """The base model, and the run's tokenizer (the base's, with the ChatML template that HF's
    ``apply_chat_template`` uses): (model, tokenizer, tokenizer_dir, base_dir).

    Under ``parallel`` every rank loads the whole model (to be sharded after) and rank 0
    alone writes the run's tokenizer, which the others read once it is there."""
    model, base_dir = load_model(checkpoint, device=device)
    if max_length > model.cfg.max_seq_len:
        raise InputError(f"data.max_length {max_length} exceeds the model's max_seq_len {model.cfg.max_seq_len}")
    tok_dir = run_dir / "tokenizer"
    if parallel is None or parallel.is_logging_rank:
        tok_dir.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(base_dir / name, tok_dir / name)
        add_chat_template(tok_dir)
    if parallel is not None:
        dist.barrier()
    return model, Tokenizer.load(tok_dir), tok_dir, base_dir


def precompute_reference(model: nn.Module, row_sets: list[dict[str, torch.Tensor] | None], columns: dict[str, str],
                         cfg: TrainConfig, device: torch.device, parallel: ParallelContext | None, stage: str) -> None:
    """The reference's log-probs added to each set of rows, scored by the policy itself before any
    update (it is still the reference, so no copy is made)."""
    t0 = time.perf_counter()
    scorer = references.untrained_policy_reference(model)
    for rows in row_sets:
        if rows is not None:
            attach_reference(scorer, rows, columns, 2 * cfg.micro_batch_size, device, cfg.precision, parallel)
    if parallel is not None:
        reshard(model)
    log.info("%s: reference log-probs precomputed in %.1f s", stage, time.perf_counter() - t0)


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
