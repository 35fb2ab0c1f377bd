"""DoReMi (Xie et al. 2023): domain weights for a pre-training mixture from a small proxy model.

A reference model is first pre-trained on the mixture as given (uniform, or its weights: a plain
``lmforge pretrain``); this verb then trains a proxy of the same shape from scratch with Group DRO
over the mixture's datasets (``objectives.doremi``: each step moves the domain weights toward the
domains where the proxy's loss most exceeds the reference's) and writes the weights averaged over
its steps to ``run_dir/domain_weights.json``. A pre-training recipe trains the main model with them
by naming the file (``data.weights_from``), each dataset's weight read by its name.

  lmforge pretrain recipes/mixtures/reference.yaml
  lmforge doremi recipes/mixtures/doremi.yaml        # reference: runs/mixtures/reference
  lmforge pretrain recipes/mixtures/main.yaml        # data.weights_from: runs/mixtures/doremi/domain_weights.json
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.files import load_model_config
from lmforge.checkpoints.load import load_model, resolve_checkpoint
from lmforge.core.config import ConfigError, option
from lmforge.core.io import InputError, atomic_write_json
from lmforge.core.run import completed_summary, log, run_dir_lock, start_run
from lmforge.data.doremi import WEIGHTS_FILE, DomainBatches, check_weights, write_domain_weights
from lmforge.data.loader import LoaderConfig, TokenLoader
from lmforge.data.shards import read_manifest
from lmforge.data.tokenizer import Tokenizer, token_byte_lengths
from lmforge.model.config import ModelConfig
from lmforge.objectives.doremi import DoReMiConfig, DoReMiObjective
from lmforge.stages.pretrain import build_model, check_dataset_names, validation_sets, will_resume
from lmforge.train.loop import TrainConfig, accumulation_steps, train
from lmforge.train.prepare import prepare_model


@dataclass
class DoReMiRecipe:
    run_dir: str = option("runs/doremi", help="the proxy's run directory; domain_weights.json is written into it")
    tokenizer: str = option("runs/tokenizer", help="the tokenizer of the data and of the reference")
    reference: str = option(
        "runs/reference", help="the reference model: a checkpoint or run directory of `lmforge pretrain` on the mixture "
        "as given (data.datasets' weights: the mixture the proxy's rows are drawn from)"
    )
    model: ModelConfig | None = option(None, help="the proxy's shape; None: the reference's (the paper's choice)")
    data: LoaderConfig = field(default_factory=LoaderConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    doremi: DoReMiConfig = field(default_factory=DoReMiConfig)


def check_recipe(recipe: DoReMiRecipe, tok: Tokenizer) -> list[dict]:
    """Everything the run reads, checked before any work; the datasets' manifests."""
    data = recipe.data
    if len(data.datasets) < 2:
        raise InputError(f"data.datasets: DoReMi weighs the domains of a mixture, but {len(data.datasets)} dataset(s) "
                         "are listed; list at least two directories written by `lmforge prepare`")
    if data.weights_from is not None:
        raise ConfigError("data.weights_from: the proxy's rows are drawn by the datasets' own `weight:` (the "
                          "reference's mixture); remove data.weights_from")
    check_weights({d.label: d.weight for d in data.datasets}, "data.datasets")
    if recipe.train.compile:
        raise ConfigError("train.compile: DoReMi's proxy step updates the domain weights between forwards, which "
                          "the compiled graph does not; set train.compile=false")
    if recipe.train.average is not None:
        raise ConfigError("train.average: the proxy is thrown away after DoReMi; remove train.average")
    check_dataset_names(data.datasets)
    manifests = [read_manifest(d.path) for d in data.datasets]
    for d, m in zip(data.datasets, manifests):
        if m["tokenizer_sha256"] != tok.sha256:
            raise InputError(f"{d.path} was tokenized with a different tokenizer than {recipe.tokenizer}")
    return manifests


def proxy_config(recipe: DoReMiRecipe, reference_dir: Path, tok: Tokenizer) -> ModelConfig:
    """The proxy's model config (the reference's unless given), checked against the tokenizer and
    the reference's vocabulary (the excess loss compares the two models token by token)."""
    reference = load_model_config(reference_dir)
    cfg = recipe.model or reference
    if reference.vocab_size != cfg.vocab_size:
        raise InputError(f"reference: {reference_dir} has a vocabulary of {reference.vocab_size}, model.vocab_size is "
                         f"{cfg.vocab_size}; the excess loss compares the models token by token")
    if cfg.vocab_size < tok.vocab_size:
        raise InputError(f"model.vocab_size {cfg.vocab_size} is smaller than the tokenizer's {tok.vocab_size}")
    if recipe.data.seq_len > min(cfg.max_seq_len, reference.max_seq_len):
        raise InputError(f"data.seq_len {recipe.data.seq_len} exceeds the proxy's or the reference's max_seq_len "
                         f"({cfg.max_seq_len}, {reference.max_seq_len} in {reference_dir})")
    return cfg


def run_doremi(recipe: DoReMiRecipe) -> dict:
    tok = Tokenizer.load(recipe.tokenizer)
    manifests = check_recipe(recipe, tok)
    reference_dir = resolve_checkpoint(recipe.reference)
    model_cfg = proxy_config(recipe, reference_dir, tok)
    with run_dir_lock(recipe.run_dir):
        run_dir = start_run(recipe, recipe.run_dir)
        return train_proxy(recipe, dataclasses.replace(recipe, model=model_cfg), manifests, reference_dir, run_dir, tok)


def train_proxy(recipe: DoReMiRecipe, resolved: DoReMiRecipe, manifests: list[dict], reference_dir: Path,
                run_dir: Path, tok: Tokenizer) -> dict:
    """The proxy's run on the loop, then ``domain_weights.json`` and ``summary.json``."""
    cfg, data = recipe.train, recipe.data
    device = resolve_device(cfg.device)
    reference, _ = load_model(reference_dir, device)
    torch.manual_seed(cfg.seed)
    model = prepare_model(build_model(resolved.model, device), cfg, stage="doremi")
    if will_resume(cfg, run_dir) and not data.verify_shards:
        data = dataclasses.replace(data, verify_shards=True)
    names = [d.label for d in data.datasets]
    token_bytes = torch.tensor(token_byte_lengths(tok) + [0] * (resolved.model.vocab_size - tok.vocab_size))
    objective = DoReMiObjective(reference, names, [d.weight for d in data.datasets], recipe.doremi, token_bytes)
    loader = TokenLoader(data, cfg.micro_batch_size, split="train")
    summary = train(model=model, objective=objective, train_batches=DomainBatches(loader), cfg=cfg, run_dir=run_dir,
                    recipe=recipe, grad_accum=accumulation_steps(cfg, cfg.micro_batch_size * data.seq_len),
                    val_batches=validation_sets(data, manifests, cfg.micro_batch_size),
                    flops_per_token=resolved.model.flops_per_token(data.seq_len), tokenizer_dir=recipe.tokenizer)
    if (stored := completed_summary(run_dir, summary)) is not None:
        return {**stored, **summary}
    weights = objective.domain_weights()
    final = {name: float(w) for name, w in zip(names, objective.weights)}
    write_domain_weights(run_dir / WEIGHTS_FILE, weights, final=final, updates=objective.updates,
                         step_size=recipe.doremi.step_size, smoothing=recipe.doremi.smoothing,
                         reference=str(reference_dir), sampling={d.label: d.weight for d in data.datasets})
    summary.update(domain_weights=weights, final_domain_weights=final, weights_file=str(run_dir / WEIGHTS_FILE))
    atomic_write_json(run_dir / "summary.json", summary)
    log.info("doremi: domain weights (mean over %d updates) %s -> %s", objective.updates,
             ", ".join(f"{n} {w:.3f}" for n, w in weights.items()), run_dir / WEIGHTS_FILE)
    return summary


RECIPE = DoReMiRecipe
run = run_doremi
