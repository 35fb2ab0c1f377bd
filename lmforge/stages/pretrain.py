"""Pre-train a decoder-only transformer on token shards with the one training loop:
AdamW, warm-up + cosine (or WSD) schedule, gradient accumulation to batch_tokens,
clipping, bf16/fp16/fp32, activation checkpointing, torch.compile, periodic validation
(loss and bits per byte, per dataset of a mixture), metrics.jsonl + TensorBoard with MFU, and atomic checkpoints
that resume exactly (train.resume=auto). With ``init`` a run starts from another run's weights
(continued pre-training, such as a context extension) with its own optimizer, schedule and data.

  lmforge pretrain recipes/demo/pretrain.yaml model.n_layers=4 train.max_steps=200
  lmforge pretrain recipes/long_context/extend_yarn.yaml     # init: the 256-token model, at 1024

The same recipe runs distributed under torchrun (gloo on CPUs, NCCL on GPUs), with the
layout set in its `parallel:` section (FSDP2/HSDP, tensor and pipeline parallel; see
docs/distributed.md):

  torchrun --nproc_per_node=8 -m lmforge pretrain recipes/distributed/gpu_fsdp_tp.yaml

``objective`` chooses the loss: the causal LM (default), or masked LM, span corruption or the
prefix LM (``data.noising`` corrupts the windows, ``objectives.denoising`` scores them):

  lmforge pretrain recipes/encoder/pretrain.yaml objective=span
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.files import load_model_config, load_weights
from lmforge.checkpoints.load import checkpoint_dirs, read_checkpoint_weights, resolve_checkpoint
from lmforge.core.config import ConfigError, option
from lmforge.core.io import InputError, atomic_write_json
from lmforge.core.run import completed_summary, format_count, log, run_dir_lock, start_run
from lmforge.data.doremi import apply_domain_weights
from lmforge.data.loader import DatasetSource, LoaderConfig, TokenDataset, TokenLoader, check_curriculum
from lmforge.data.noising import MaskingConfig, Noise, NoisedLoader, SpanConfig, build_noise
from lmforge.data.shards import count_tokens, entropy_of_counts, open_shards, read_manifest
from lmforge.data.tokenizer import Tokenizer, token_byte_lengths
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.memory import check_memory_fits
from lmforge.distributed.mesh import (
    ParallelContext,
    check_layout,
    data_parallel_rank,
    launched_world_size,
    parallel_session,
    resolve_layout,
)
from lmforge.distributed.pipeline import PipelineRunner, split_into_stage
from lmforge.model import families
from lmforge.model.config import ModelConfig
from lmforge.model.mtp import check_depth
from lmforge.model.transformer import Transformer
from lmforge.objectives.base import Objective
from lmforge.objectives.clm import CausalLMObjective, causal_lm_loss
from lmforge.objectives.denoising import DenoisingObjective
from lmforge.objectives.distill import DistillConfig
from lmforge.objectives.distill_teacher import check_teacher, teacher_objective
from lmforge.objectives.ewc import EWCConfig, check_ewc, ewc_objective, model_shapes
from lmforge.stages.scoring import Scorer, eval_tasks_scorer
from lmforge.train.ema import check_average
from lmforge.train.loop import TrainConfig, ValidationSet, accumulation_steps, precision_line, run_precision, train
from lmforge.train.metrics import is_domain_loss, loss_curve_lines
from lmforge.train.optim import check_mup_optimizer
from lmforge.train.prepare import prepare_model


@dataclass
class PretrainRecipe:
    run_dir: str = option(
        "runs/pretrain", help="the run directory: config.yaml, metrics.jsonl, tensorboard/, checkpoints/"
    )
    tokenizer: str = option("runs/tokenizer", help="copied into every checkpoint; gives bytes per token for bpb")
    init: str | None = option(
        None,
        help="start from this checkpoint's weights (a checkpoint or run directory) with a fresh optimizer, schedule "
        "and data order: continued pre-training. model: must be the checkpoint's but for its context keys "
        "(max_seq_len, rope_*), which a context extension changes. Unused when the run resumes its own checkpoints",
    )
    objective: Literal["clm", "mlm", "span", "prefix_lm"] = option(
        "clm",
        help="clm: next-token prediction; mlm: BERT's masked LM (keys mlm.*, bidirectional attention, a tokenizer "
        "with a mask token); span: T5's span corruption as a decoder-only prefix LM (keys span.*, a tokenizer with "
        "sentinels); prefix_lm: bidirectional over a random prefix, causal after it, loss after it",
    )
    mlm: MaskingConfig = field(default_factory=MaskingConfig)
    span: SpanConfig = field(default_factory=SpanConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: LoaderConfig = field(default_factory=LoaderConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ewc: EWCConfig | None = option(None, help="set to add EWC's (λ/2)·Σ F(θ − θ*)² to the loss, F and θ* from "
                                   "`lmforge fisher` on the init checkpoint (docs/continual-learning.md)")
    distill: DistillConfig | None = option(None, help="set to mix a teacher's softened next-token distribution into the "
                                           "loss (Hinton et al. 2015; docs/distillation.md)")


def unigram_entropy(directory: str | Path, vocab_size: int) -> float:
    """Entropy (nats per token) of the training split's token frequencies: a model that
    ignores context can do no better, so a trained model's loss should fall well below it.
    ``lmforge prepare`` records it in the manifest; shards prepared before it did are counted here."""
    recorded = read_manifest(directory)["splits"]["train"].get("unigram_entropy")
    if recorded is not None:
        return recorded
    counts = np.zeros(vocab_size, dtype=np.int64)
    for shard in open_shards(directory, "train"):
        count_tokens(counts, shard.tokens)
    return entropy_of_counts(counts)


def unigram_baseline(datasets: list[DatasetSource], vocab_size: int, summary: dict) -> dict:
    """The unigram entropy that ``val_loss`` is compared with, as ``unigram_entropy``: the one
    dataset's; for a mixture, each dataset's own (``unigram_entropies``, by name) and their mean
    weighted by the mixture weights over the datasets that ``val_loss`` averages (those with a
    ``val/<name>/loss``; all of them when none has), as ``val_loss`` weights their losses. The
    gap to it is then the weighted mean of each dataset's gap to its own entropy; the first
    dataset's entropy alone would compare the mixture's loss with one domain's floor."""
    if len(datasets) == 1:
        return {"unigram_entropy": unigram_entropy(datasets[0].path, vocab_size)}
    own = {d.label: unigram_entropy(d.path, vocab_size) for d in datasets}
    averaged = [d for d in datasets if f"val/{d.label}/loss" in summary] or datasets
    mean = sum(d.weight * own[d.label] for d in averaged) / sum(d.weight for d in averaged)
    return {"unigram_entropy": mean, "unigram_entropies": own}


def validation_loader(data: LoaderConfig, manifest: dict, batch_size: int, rank: int = 0,
                      world_size: int = 1, dataset: DatasetSource | None = None,
                      noise: Noise | None = None) -> TokenLoader | NoisedLoader | None:
    """The validation split of ``dataset`` (default: the first; ``manifest`` is its manifest) in
    order, built once per run and restarted for each evaluation, its windows corrupted by ``noise``
    when given; None when it is shorter than one window."""
    if manifest["splits"]["val"]["n_tokens"] <= data.seq_len:
        return None
    cfg = LoaderConfig(datasets=[dataset or data.datasets[0]], seq_len=data.seq_len, bos_aligned=data.bos_aligned,
                       shuffle=False, seed=data.seed, verify_shards=data.verify_shards)
    loader = TokenLoader(cfg, batch_size, split="val", loop=False, rank=rank, world_size=world_size)
    return loader if noise is None else NoisedLoader(loader, noise)


def validation_sets(data: LoaderConfig, manifests: list[dict], batch_size: int, rank: int = 0,
                    world_size: int = 1, noise: Noise | None = None) -> Callable[[], Iterator] | list[ValidationSet] | None:
    """What the loop validates on: one dataset's validation batches (its metrics keep the names
    ``val_loss``, ``val_bpb``), or for a mixture one ``ValidationSet`` per dataset with a
    validation split of at least one window (``val/<name>/loss``, and ``val_loss`` their mean
    weighted by the mixture weights); None when there is nothing to validate on."""
    sources = data.sources()  # the replay sets too: what a continued run keeps of the earlier data
    if len(sources) == 1:
        loader = validation_loader(data, manifests[0], batch_size, rank, world_size, noise=noise)
        return loader.restart if loader is not None else None
    sets = []
    for dataset, manifest in zip(sources, manifests):
        loader = validation_loader(data, manifest, batch_size, rank, world_size, dataset, noise)
        if loader is None:
            log.warning("dataset %s (%s) has no validation split of one window of %d tokens: it has no val/%s metrics "
                        "and is left out of val_loss", dataset.label, dataset.path, data.seq_len + 1, dataset.label)
            continue
        sets.append(ValidationSet(dataset.label, loader.restart, dataset.weight))
    return sets or None


def check_dataset_names(datasets: list[DatasetSource]) -> None:
    """The datasets of a mixture name their validation metrics (``val/<name>/loss``): two alike would
    write into the same metric."""
    if len(datasets) < 2:
        return
    seen: dict[str, str] = {}
    for d in datasets:
        if d.label in seen:
            raise InputError(f"data.datasets: {seen[d.label]} and {d.path} are both named {d.label!r}, the name of "
                             "their validation metrics (val/<name>/loss); give one a `name:`")
        seen[d.label] = d.path


def is_context_key(name: str) -> bool:
    """A model key that changes how far positions reach, not the weights: what ``init`` lets a run change."""
    return name == "max_seq_len" or name.startswith("rope_")


def init_checkpoint(recipe: PretrainRecipe) -> Path | None:
    """The checkpoint ``recipe.init`` names, verified, after checking that ``recipe.model`` is its
    model apart from the context keys (a norm, width or vocabulary that differs would load or
    fail to load silently wrong); None without ``init``."""
    if recipe.init is None:
        return None
    directory = resolve_checkpoint(recipe.init)
    saved = dataclasses.asdict(load_model_config(directory))
    wanted = dataclasses.asdict(recipe.model)
    differ = [k for k in sorted(saved.keys() | wanted.keys())
              if k != "preset" and not is_context_key(k) and saved.get(k) != wanted.get(k)]
    if differ:
        shown = ", ".join(f"model.{k}={saved.get(k)!r} (this recipe: {wanted.get(k)!r})" for k in differ[:4])
        raise InputError(f"init: {directory} was trained with {shown}{' and more' if len(differ) > 4 else ''}; a run "
                         "from its weights may change only max_seq_len and the rope_* keys: set the others as it had them")
    return directory


def load_init(model: torch.nn.Module, directory: Path | None, run_dir: Path, cfg: TrainConfig,
              device: torch.device) -> None:
    """``init``'s weights into the freshly built ``model``, unless the run resumes its own checkpoint
    (whose weights are newer). RoPE's tables are not weights: the model keeps its own config's."""
    if directory is None:
        return
    if will_resume(cfg, run_dir):
        log.info("init: %s not loaded: the run resumes from its own checkpoints (train.resume=%s)", directory, cfg.resume)
        return
    load_weights(model, read_checkpoint_weights(directory, device), where=str(directory))
    log.info("init: weights of %s (optimizer, schedule and data start fresh)", directory)


def pretrain_noise(recipe: PretrainRecipe, tok: Tokenizer, pipeline_stages: int) -> Noise | None:
    """The corruption of ``recipe.objective`` (None for the causal LM), checked before any work:
    the tokenizer has the tokens it needs and the model can attend bidirectionally."""
    if recipe.objective == "clm":
        return None
    if pipeline_stages > 1:
        raise ConfigError(f"objective={recipe.objective} runs without pipeline parallelism so far (parallel.pp="
                          f"{pipeline_stages}); set parallel.pp=1 or objective=clm")
    if recipe.objective == "mlm" and recipe.train.eval_tasks:
        raise ConfigError("train.eval_tasks scores a causal LM, which objective=mlm does not train: set "
                          "train.eval_tasks=[] and score the checkpoint with `lmforge eval` (masked-token accuracy)")
    model = recipe.model
    if model.sliding_window is not None or model.positions == "alibi":
        key = "model.sliding_window" if model.sliding_window is not None else "model.positions=alibi"
        raise ConfigError(f"objective={recipe.objective} attends both ways over its prefix, but {key} builds causal "
                          "masks of its own; use full attention with rope or learned positions, or objective=clm")
    return build_noise(recipe.objective, recipe.mlm, recipe.span, tok, recipe.data.seq_len, recipe.tokenizer)


def check_pretrain_teacher(recipe: PretrainRecipe, world_size: int) -> None:
    """``distill:`` is possible here and its teacher fits the student, before anything is written."""
    d = recipe.distill
    if d is None:
        return
    if recipe.objective != "clm":
        raise ConfigError(f"distill: the teacher's next-token distribution is a causal LM's, objective="
                          f"{recipe.objective} is not; set objective=clm or remove distill")
    if world_size > 1:
        raise ConfigError(f"distill: runs in one process only so far ({world_size} processes launched); launch it "
                          "without torchrun or remove distill")
    if d.replay:
        raise ConfigError("distill.replay is sft's; in pretrain the teacher distils every window the loader draws, "
                          "data.replay's included: list the replayed shards there")
    if d.top_k and recipe.data.seq_len_warmup is not None:
        raise ConfigError("distill.top_k stores the teacher's logits of whole windows, and data.seq_len_warmup cuts them "
                          "into shorter rows it does not hold; set distill.top_k=0 (a live teacher) or remove the warm-up")
    check_teacher(d.teacher, recipe.tokenizer, recipe.model.vocab_size, recipe.data.seq_len, d.top_k)


def training_windows(data: LoaderConfig, batch_size: int) -> Iterator[torch.Tensor]:
    """Every training window of every dataset in file order, as batches like the loader's (the rows whose teacher
    top-k ``distill.top_k`` stores)."""
    for source in data.sources():  # the replay sets too
        windows = TokenDataset(source.path, "train", data.seq_len, data.bos_aligned)
        for start in range(0, len(windows), batch_size):
            stop = min(start + batch_size, len(windows))
            yield torch.from_numpy(np.stack([windows.window(i) for i in range(start, stop)]).astype(np.int64))


def pretrain_objective(recipe: PretrainRecipe, token_bytes: torch.Tensor, bos_id: int | None = None) -> Objective:
    """The loss of ``recipe.objective`` (multi-token prediction's documents start at ``bos_id``)."""
    if recipe.objective == "clm":
        return CausalLMObjective(token_bytes, bos_id)
    return DenoisingObjective(recipe.objective, token_bytes)


def check_mtp(recipe: PretrainRecipe) -> None:
    """``model.mtp`` trains with the causal LM's windows, and its deepest depth needs a target in each."""
    depth = recipe.model.mtp.depth
    if depth and recipe.objective != "clm":
        raise ConfigError(f"model.mtp.depth = {depth} trains with objective=clm only (its depths predict the tokens "
                          f"ahead of a causal window); objective={recipe.objective}: set model.mtp.depth = 0")
    if depth and recipe.distill is not None:
        raise ConfigError(f"model.mtp.depth = {depth} with distill: the distillation loss reads the main head only, "
                          "so the MTP modules would not train; remove distill or set model.mtp.depth = 0")
    problem = check_depth(depth, recipe.data.seq_len)
    if problem:
        raise ConfigError(problem)


def build_model(cfg: ModelConfig, device: torch.device) -> Transformer:
    with torch.device(device):
        return families.build(cfg)


def run_pretrain(recipe: PretrainRecipe) -> dict:
    recipe = dataclasses.replace(recipe, data=apply_domain_weights(recipe.data))  # data.weights_from (lmforge doremi)
    layout = resolve_layout(recipe.parallel, launched_world_size())  # an impossible layout fails before any work
    check_layout(layout, recipe.parallel, recipe.model, recipe.train.micro_batch_size)
    check_mup_optimizer(recipe.model.width_mult(), recipe.train.optimizer)
    check_memory_fits(recipe.model, recipe.parallel, layout, resolve_device(recipe.train.device),
                      micro_batch_size=recipe.train.micro_batch_size, seq_len=recipe.data.seq_len,
                      precision=recipe.train.precision, activation_checkpointing=recipe.train.activation_checkpointing,
                      optimizer=recipe.train.optimizer)
    if not recipe.data.datasets:
        raise InputError("data.datasets is empty: list at least one directory written by `lmforge prepare`")
    tok = Tokenizer.load(recipe.tokenizer)
    check_curriculum(recipe.data, recipe.train.max_steps)
    check_dataset_names(recipe.data.sources())
    manifests = [read_manifest(d.path) for d in recipe.data.sources()]
    for d, m in zip(recipe.data.sources(), manifests):
        if m["tokenizer_sha256"] != tok.sha256:
            raise InputError(f"{d.path} was tokenized with a different tokenizer than {recipe.tokenizer}")
    if recipe.model.vocab_size < tok.vocab_size:
        raise InputError(f"model.vocab_size {recipe.model.vocab_size} is smaller than the tokenizer's {tok.vocab_size}")
    if recipe.data.seq_len > recipe.model.max_seq_len:
        raise InputError(f"data.seq_len {recipe.data.seq_len} exceeds model.max_seq_len {recipe.model.max_seq_len}")
    check_mtp(recipe)

    noise = pretrain_noise(recipe, tok, layout.pp)
    if recipe.data.seq_len_warmup is not None and (noise is not None or layout.pp > 1):
        raise ConfigError("data.seq_len_warmup cuts the causal LM's windows into shorter rows; "
                          f"{'objective=' + recipe.objective if noise is not None else f'parallel.pp={layout.pp}'} "
                          "takes whole windows: unset data.seq_len_warmup")
    init = init_checkpoint(recipe)
    if recipe.ewc is not None and layout.pp > 1:
        raise ConfigError(f"ewc: the penalty is added by the objective, which a pipeline's schedule does not call "
                          f"(parallel.pp={layout.pp}); set parallel.pp=1")
    check_ewc(recipe.ewc, lambda: model_shapes(recipe.model))
    check_pretrain_teacher(recipe, layout.world_size)

    if layout.world_size > 1:
        if recipe.train.eval_tasks:
            raise ConfigError("train.eval_tasks scores in one process only so far; launch it without torchrun or set "
                              "train.eval_tasks=[]")
        check_average(recipe.train.average, distributed=True)  # before any work
        return run_pretrain_distributed(recipe, tok, manifests, init, noise)
    with run_dir_lock(recipe.run_dir):  # a second run into it fails at once, naming this one
        return run_pretrain_local(recipe, tok, manifests, init, noise)


def run_pretrain_local(recipe: PretrainRecipe, tok: Tokenizer, manifests: list[dict], init: Path | None = None,
                       noise: Noise | None = None) -> dict:
    """``run_pretrain`` in one process; ``init``: the checkpoint whose weights it starts from;
    ``noise``: the corruption of the windows (``pretrain_noise``)."""
    run_dir = start_run(recipe, recipe.run_dir)
    cfg = recipe.train
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = build_model(recipe.model, device)
    load_init(model, init, run_dir, cfg, device)
    n_params = recipe.model.num_params()
    flops_per_token = recipe.model.flops_per_token(recipe.data.seq_len)
    log.info("model: %s parameters (%s in matmuls), %.1f MFLOP per token at seq_len %d, on %s", format_count(n_params),
             format_count(recipe.model.matmul_params()), flops_per_token / 1e6, recipe.data.seq_len, device)
    model = prepare_model(model, cfg, stage="pretrain")

    token_bytes = torch.tensor(token_byte_lengths(tok) + [0] * (recipe.model.vocab_size - tok.vocab_size))
    scorer = eval_tasks_scorer(cfg.eval_tasks, tok, 2 * cfg.micro_batch_size)  # its tasks read before training
    return train_on_shards(recipe, manifests, model, cfg, run_dir, token_bytes, scorer=scorer, noise=noise)


def will_resume(cfg: TrainConfig, run_dir: Path) -> bool:
    """Whether the loop will resume from a checkpoint (``train.resume`` names one, or is auto and
    ``run_dir`` has some), so that the shards it reads are verified first."""
    return cfg.resume != "never" and (cfg.resume != "auto" or bool(checkpoint_dirs(run_dir)))


def train_on_shards(recipe: PretrainRecipe, manifests: list[dict], model: torch.nn.Module, cfg: TrainConfig,
                    run_dir: Path, token_bytes: torch.Tensor, ctx: ParallelContext | None = None,
                    pipeline: PipelineRunner | None = None, precision_reason: str | None = None,
                    scorer: Scorer | None = None, noise: Noise | None = None) -> dict:
    """The loop over the token shards (this rank's share under ``ctx``), then ``summary.json``.
    ``precision_reason``: why ``cfg.precision`` was chosen, when it was chosen before the loop;
    ``scorer``: of ``train.eval_tasks``, run with each validation; ``noise``: the corruption of
    every window (training and validation) for a denoising objective."""
    rank, dp = data_parallel_rank(ctx)
    flops_per_token = recipe.model.flops_per_token(recipe.data.seq_len)
    data = recipe.data
    if will_resume(cfg, run_dir) and not data.verify_shards:  # a changed shard would silently break exact resume
        data = dataclasses.replace(data, verify_shards=True)
    grad_accum = accumulation_steps(cfg, cfg.micro_batch_size * recipe.data.seq_len, world_size=dp)
    loader = TokenLoader(data, cfg.micro_batch_size, split="train", rank=rank, world_size=dp,
                         samples_per_step=grad_accum * cfg.micro_batch_size * dp)
    val_batches = validation_sets(data, manifests, cfg.micro_batch_size, rank, dp, noise)
    objective = pretrain_objective(recipe, token_bytes, manifests[0].get("bos_id"))  # documents start at BOS
    if recipe.distill is not None:
        objective = teacher_objective(objective, recipe.distill, next(model.parameters()).device, run_dir,
                                      lambda: training_windows(data, 2 * cfg.micro_batch_size))
    summary = train(
        model=model,
        objective=ewc_objective(objective, recipe.ewc, model, ctx),
        train_batches=loader if noise is None else NoisedLoader(loader, noise),
        cfg=cfg,
        run_dir=run_dir,
        recipe=recipe,
        grad_accum=grad_accum,
        val_batches=val_batches,
        flops_per_token=flops_per_token,
        tokenizer_dir=recipe.tokenizer,
        parallel=ctx,
        pipeline=pipeline,
        precision_reason=precision_reason,
        scorer=scorer,
    )
    if (stored := completed_summary(run_dir, summary)) is not None:  # a rerun: the run's own summary stands
        return {**stored, **summary}
    summary.update(params=recipe.model.num_params(), flops_per_token=flops_per_token,
                   tokens_per_step=grad_accum * cfg.micro_batch_size * recipe.data.seq_len * dp)
    if ctx is not None:
        summary.update(world_size=ctx.layout.world_size, layout=str(ctx.layout))
    if ctx is None or ctx.is_logging_rank:
        summary.update(unigram_baseline(recipe.data.sources(), recipe.model.vocab_size, summary))
        atomic_write_json(run_dir / "summary.json", summary)
        if "val_loss" in summary:
            log.info("pretrain: val loss %.4f nats/token (%.3f bits/byte) vs unigram entropy %.4f%s; perplexity %.1f",
                     summary["val_loss"], summary.get("val_bpb", float("nan")), summary["unigram_entropy"],
                     MIXED_ENTROPY if "unigram_entropies" in summary else "", math.exp(summary["val_loss"]))
        for line in domain_lines(summary):
            log.info("pretrain: %s", line)
    return summary


def run_pretrain_distributed(recipe: PretrainRecipe, tok: Tokenizer, manifests: list[dict],
                             init: Path | None = None, noise: Noise | None = None) -> dict:
    """``run_pretrain`` on one rank of a ``torchrun`` job: the model is built whole on every
    rank from the same seed (or ``init``'s weights), split into this rank's pipeline stage, then parallelized."""
    with (parallel_session(recipe.parallel, recipe.train.device) as ctx,
          run_dir_lock(recipe.run_dir, enabled=ctx.is_logging_rank)):  # rank 0 holds it for the job
        layout = ctx.layout
        if ctx.is_logging_rank:
            start_run(recipe, recipe.run_dir)
        dist.barrier()
        run_dir = Path(recipe.run_dir)
        precision, reason = run_precision(recipe.train, run_dir, ctx.device, ctx)
        cfg = dataclasses.replace(recipe.train, precision=precision)
        torch.manual_seed(cfg.seed)
        model = build_model(recipe.model, ctx.device)
        load_init(model, init, run_dir, cfg, ctx.device)
        flops_per_token = recipe.model.flops_per_token(recipe.data.seq_len)
        log.info("model: %s parameters, %.1f MFLOP per token; layout %s over %d processes (%s)",
                 format_count(recipe.model.num_params()), flops_per_token / 1e6, layout, layout.world_size, ctx.device.type)
        token_bytes = torch.tensor(token_byte_lengths(tok) + [0] * (recipe.model.vocab_size - tok.vocab_size))
        if layout.pp > 1:
            model = split_into_stage(model, ctx.pp_rank, layout.pp)
        model = prepare_model(model, cfg, ctx, stage="pretrain")
        pipeline = None
        if layout.pp > 1:
            pipeline = PipelineRunner(model, ctx, recipe.parallel.pp_microbatches or layout.pp,
                                      split=lambda b: (b[:, :-1], b[:, 1:]), loss_sum=causal_lm_loss,
                                      count_bytes=lambda targets: int(token_bytes[targets.cpu()].sum()))

        return train_on_shards(recipe, manifests, model, cfg, run_dir, token_bytes, ctx, pipeline, reason, noise=noise)


MIXED_ENTROPY = " (the datasets' own, weighted as val_loss weights their losses)"


def domain_lines(summary: dict) -> list[str]:
    """One line per dataset of a mixture with its validation loss (``val/<name>/loss``), bits per
    byte and its own unigram entropy."""
    names = [k.removeprefix("val/").removesuffix("/loss") for k in summary if is_domain_loss(k)]
    own = summary.get("unigram_entropies", {})
    return [f"validation loss of {name}: {summary[f'val/{name}/loss']:.4f} nats/token"
            + (f" ({summary[f'val/{name}/bpb']:.3f} bits/byte)" if f"val/{name}/bpb" in summary else "")
            + (f" vs its unigram entropy {own[name]:.4f}" if name in own else "")
            for name in names]


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report, with the loss curve against the unigram entropy."""
    out = [f"- {res.get('params', 0) / 1e6:.2f} M parameters, {res.get('step')} steps of "
           f"{res.get('tokens_per_step')} tokens in {res.get('wall_s', 0):.0f} s"]
    if res.get("val_loss") is not None:
        out.append(f"- validation loss **{res['val_loss']:.4f}** nats/token ({res.get('val_bpb', float('nan')):.3f} "
                   f"bits/byte); unigram entropy of the data {res.get('unigram_entropy', float('nan')):.4f}"
                   + (MIXED_ENTROPY if "unigram_entropies" in res else ""))
    out += [f"- {line}" for line in domain_lines(res)]
    if res.get("tokens_per_s"):
        mfu = f", MFU {100 * res['mfu']:.1f}%" if res.get("mfu") else ""
        out.append(f"- throughput {res['tokens_per_s']:.0f} tokens/s{mfu}")
    if res.get("noise_scale") is not None:
        out.append(f"- gradient noise scale B_simple {res['noise_scale']:.3g} tokens (McCandlish et al. 2018; "
                   f"{res.get('noise_scale_measurements')} measurements), against {res.get('tokens_per_step')} tokens a step")
    return out + precision_line(res) + loss_curve_lines(stage_dir, plot_path, res.get("unigram_entropy"))


RECIPE = PretrainRecipe
run = run_pretrain
