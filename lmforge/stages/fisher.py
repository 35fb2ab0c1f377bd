"""The diagonal Fisher of a checkpoint on a dataset, for EWC: ``fisher.safetensors`` beside the
checkpoint with F (per target token) and the anchor θ* (the checkpoint's weights), which a
training recipe's ``ewc: {fisher: ..., lambda_: ...}`` reads (``objectives.ewc``).

The data is token shards written by ``lmforge prepare`` (``data.shards``: windows of
``data.seq_len`` tokens, every next token a target) or chat files in TRL's formats
(``data.chat``: the assistant's tokens the targets, as SFT trains them). ``labels: sampled`` (the
default) draws each target from the model's own distribution, the true Fisher;
``empirical`` uses the data's tokens (the empirical Fisher); ``exact`` enumerates the
vocabulary (tiny models only). It stops after the sequence that reaches ``max_tokens`` targets.

Online EWC / EWC++ over a sequence of tasks keeps one Fisher and one anchor: ``fold_into`` names
the stored Fisher file, and the one written holds γ·F_stored + (1 − γ)·F_new (``online_gamma`` = γ)
with this checkpoint's weights as the anchor.

  lmforge fisher recipes/continual/fisher.yaml
  lmforge fisher checkpoint=runs/pretrain data.shards=runs/prepare max_tokens=65536
  lmforge fisher checkpoint=runs/sft/final data.chat=[data/sft/train.jsonl] fold_into=runs/pretrain/final/fisher.safetensors
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.load import load_model, resolve_checkpoint
from lmforge.core.config import ConfigError, option, positive, seed_field, unit_interval
from lmforge.core.io import InputError, check_output_file
from lmforge.core.run import log
from lmforge.data.chat import read_sft_examples
from lmforge.data.loader import DatasetSource, LoaderConfig, TokenLoader
from lmforge.data.shards import read_manifest
from lmforge.data.tokenizer import Tokenizer
from lmforge.objectives.ewc import (
    FISHER_FILE,
    check_fisher_shapes,
    fisher_path,
    online_fisher,
    read_fisher,
    write_fisher,
)
from lmforge.objectives.fisher import diagonal_fisher


@dataclass
class FisherDataConfig:
    shards: str | None = option(None, help="a directory written by `lmforge prepare`: windows of seq_len tokens")
    split: Literal["train", "val"] = option("train", help="shards: the split read")
    seq_len: int = positive(256, help="shards: tokens per window")
    chat: list[str] = option(default_factory=list, help="chat JSONL/Parquet files or globs (TRL's messages or "
                             "prompt/completion): the assistant's tokens are the targets")
    max_length: int = positive(512, help="chat: tokens per example (longer ones are truncated)")


@dataclass
class FisherRecipe:
    checkpoint: str = option("runs/pretrain", help="the model: a checkpoint, a run directory or a run's final/")
    data: FisherDataConfig = field(default_factory=FisherDataConfig)
    labels: Literal["sampled", "empirical", "exact"] = option(
        "sampled", help="sampled: targets drawn from the model (the true Fisher); empirical: the data's tokens (the empirical "
        "Fisher); exact: every vocabulary entry weighted by its probability (tiny vocabularies only)")
    max_tokens: int = positive(16384, help="target tokens to average over (whole sequences: the last may pass it)")
    seed: int = seed_field(0, help="the seed of the sampled labels")
    out: str | None = option(None, help=f"the file to write; None: {FISHER_FILE} in the checkpoint's directory")
    fold_into: str | None = option(
        None, help="online EWC / EWC++: a stored Fisher file; the one written holds online_gamma·F_stored + "
        "(1 − online_gamma)·F_new, anchored at this checkpoint")
    online_gamma: float | None = unit_interval(
        None, help="fold_into: γ, the stored Fisher's weight in the moving average (None: 0.5)")
    device: str = option("cpu", help="auto | cpu | cuda | cuda:N")


def window_sequences(d: FisherDataConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, targets) of each window of the shards, in order."""
    cfg = LoaderConfig(datasets=[DatasetSource(d.shards)], seq_len=d.seq_len, shuffle=False)
    for batch in TokenLoader(cfg, 1, split=d.split, loop=False):
        yield batch[0, :-1], batch[0, 1:]


def chat_sequences(examples: list) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, targets) of each chat example: the next token where it is trained, IGNORE_INDEX elsewhere."""
    for e in examples:
        ids, labels = torch.tensor(e.input_ids), torch.tensor(e.labels)
        yield ids[:-1], labels[1:]


def check_recipe(recipe: FisherRecipe) -> None:
    if (recipe.data.shards is None) == (not recipe.data.chat):
        raise ConfigError("data: give data.shards (token shards) or data.chat (chat files), one of them")
    if recipe.fold_into is None and recipe.online_gamma is not None:
        raise ConfigError(f"online_gamma: it weighs a stored Fisher (fold_into), which is not set; online_gamma="
                          f"{recipe.online_gamma} would be ignored")


def run_fisher(recipe: FisherRecipe) -> dict:
    """Compute and write the Fisher file; everything read is checked before anything is written."""
    check_recipe(recipe)
    directory = resolve_checkpoint(recipe.checkpoint)
    out = Path(recipe.out) if recipe.out is not None else directory / FISHER_FILE
    check_output_file(out, "out")
    model, _ = load_model(directory, device=resolve_device(recipe.device))
    if recipe.labels == "exact" and model.cfg.vocab_size > 1024:
        raise ConfigError(f"labels: exact takes one backward per token and vocabulary entry; {directory} has "
                          f"{model.cfg.vocab_size} entries: use labels=sampled")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    stored, gamma = None, None
    if recipe.fold_into is not None:
        stored, _, stored_meta = read_fisher(recipe.fold_into, key="fold_into")
        check_fisher_shapes(shapes, stored, fisher_path(recipe.fold_into), key="fold_into")
    if recipe.data.shards is not None:
        if recipe.data.seq_len > model.cfg.max_seq_len:
            raise InputError(f"data.seq_len {recipe.data.seq_len} exceeds the model's max_seq_len {model.cfg.max_seq_len}")
        if read_manifest(recipe.data.shards)["tokenizer_sha256"] != Tokenizer.load(directory).sha256:
            raise InputError(f"data.shards: {recipe.data.shards} was tokenized with another tokenizer than {directory}'s")
        sequences = window_sequences(recipe.data)
    else:
        tok = Tokenizer.load(directory)
        examples = list(read_sft_examples(recipe.data.chat, tok, recipe.data.max_length, on_too_long="truncate"))
        if not examples:
            raise InputError(f"data.chat: no examples in {recipe.data.chat}")
        sequences = chat_sequences(examples)
    t0 = time.perf_counter()
    try:
        fisher, tokens, count = diagonal_fisher(model, sequences, recipe.labels, recipe.max_tokens, recipe.seed)
    except ValueError as exc:
        raise InputError(f"data: {exc} (a window needs seq_len + 1 tokens of the split; chat examples an assistant turn)") from exc
    fisher = {n: f for n, f in fisher.items() if n in shapes}
    folds = 0
    if stored is not None:
        gamma = recipe.online_gamma if recipe.online_gamma is not None else 0.5
        fisher = online_fisher({n: stored[n] for n in fisher}, fisher, gamma)
        folds = int(stored_meta.get("folds", 0)) + 1
    anchor = {n: p.detach() for n, p in model.named_parameters()}
    result = {"checkpoint": str(directory), "labels": recipe.labels, "tokens": tokens, "sequences": count,
              "seed": recipe.seed, "folds": folds, "online_gamma": gamma if stored is not None else None,
              "fold_into": recipe.fold_into, "mean_fisher": float(sum(f.sum() for f in fisher.values())
                                                                   / sum(f.numel() for f in fisher.values()))}
    write_fisher(out, fisher, anchor, {k: v for k, v in result.items() if v is not None})
    result.update(out=str(out), wall_s=time.perf_counter() - t0)
    log.info("fisher: %s Fisher of %s over %d tokens (%d sequences)%s in %.1f s -> %s", recipe.labels, directory, tokens,
             count, f", folded into {recipe.fold_into} with γ={gamma}" if stored is not None else "",
             result["wall_s"], out)
    return result


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: which Fisher, over what, where."""
    folded = (f", folded into `{res['fold_into']}` with γ = {res['online_gamma']} (EWC++, {res['folds']} folds)"
              if res.get("fold_into") else "")
    return [f"- {res.get('labels')} Fisher of `{res.get('checkpoint')}` over {res.get('tokens')} target tokens "
            f"({res.get('sequences')} sequences){folded}, mean {res.get('mean_fisher', float('nan')):.3g}; "
            f"in `{res.get('out')}`"]


RECIPE = FisherRecipe
run = run_fisher
