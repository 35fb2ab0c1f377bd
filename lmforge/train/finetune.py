"""Generic training machinery of the fine-tuning stages (sft, reward, dpo, kto; their skeleton is
``stages.finetune``): sizing an optimizer step of rows, serving validation rows to the loop, and
saving a fine-tuned model as a plain checkpoint plus a PEFT adapter (gathered first when sharded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lmforge.checkpoints.files import load_weights, write_checksums, write_model_files
from lmforge.core.io import atomic_directory
from lmforge.core.run import log
from lmforge.data.packing import IGNORE_INDEX
from lmforge.data.rows import RowLoader
from lmforge.distributed.mesh import ParallelContext
from lmforge.distributed.parallelize import remove_activation_checkpointing
from lmforge.model.families import build as build_model
from lmforge.model.transformer import Transformer
from lmforge.peft.adapters import peft_unsupported, save_adapter
from lmforge.peft.lora import LoraConfig, apply_lora, merge_lora
from lmforge.train.loop import TrainConfig, accumulation_steps


def row_accumulation_steps(cfg: TrainConfig, max_length: int, rows_per_example: int = 1, world_size: int = 1) -> int:
    """Micro-batches per optimizer step of a fine-tuning run. ``train.batch_tokens`` counts each
    example as ``rows_per_example`` rows (a preference pair is two) of ``data.max_length``
    tokens, whatever their real length, so the step does not change with the data. A round
    is one micro-batch on each of ``world_size`` data-parallel ranks; a target that is not a
    whole number of rounds is rounded to the nearest (at least one) and logged, as in pre-training."""
    return accumulation_steps(cfg, rows_per_example * max_length * cfg.micro_batch_size, world_size)


def validation_batches(rows: dict[str, torch.Tensor] | None, batch_size: int, rank: int = 0,
                       world_size: int = 1) -> Callable[[], Iterator] | None:
    """The loop's ``val_batches``: the validation rows once, in order, from the first each time
    (this rank's share of each global batch; None without rows).

    Under torchrun every rank must run the same forwards, so the rows are padded to whole global
    batches with copies of the first row whose targets are all ignored (every ``*labels``
    column: SFT's ``labels``, a pair's ``chosen_labels`` and ``rejected_labels``). The
    objectives count no targets in them (a preference pair without targets weighs zero), so
    they add nothing to the sums, and the validation figures are the one process's, every
    row counted."""
    if not rows:
        return None
    n, per_batch = len(next(iter(rows.values()))), batch_size * world_size
    if world_size > 1 and n % per_batch:
        pad = per_batch - n % per_batch
        filler = {key: value[:1].expand(pad, *value.shape[1:]) for key, value in rows.items()}
        for key in [k for k in filler if k.endswith("labels")]:
            filler[key] = torch.full_like(filler[key], IGNORE_INDEX)
        rows = {key: torch.cat([value, filler[key]]) for key, value in rows.items()}
    return lambda: RowLoader(rows, batch_size, shuffle=False, loop=False, rank=rank, world_size=world_size)


def save_finetuned(model: Transformer, run_dir: Path, tok_dir: Path, adapter_base: Path | None, lora: LoraConfig | None,
                   write_extra: Callable[[Path], None] | None = None) -> Path:
    """The fine-tuned model as a plain checkpoint in ``run_dir/final`` (LoRA merged) that
    generate/export read, plus, for LoRA, the adapter in PEFT's format in ``run_dir/adapter``
    whose ``base_model_name_or_path`` is ``adapter_base`` (absolute): a Hugging Face folder of the
    base, so ``AutoPeftModelForCausalLM.from_pretrained(adapter)`` loads it.
    ``write_extra(directory)`` adds files (a reward head) before the checksums are written. Where the
    family's Hugging Face class has no module for a wrapped one (Phi-3's joined q/k/v), no PEFT
    adapter can name it: a note says so and ``final`` (merged) is the result."""
    if lora is not None:
        if adapter_base is None:
            raise ValueError("save_finetuned: a LoRA run needs adapter_base, the Hugging Face export of its base")
        reason = peft_unsupported(model)
        if reason is None:
            save_adapter(model, lora, run_dir / "adapter", base_model_name_or_path=str(Path(adapter_base).resolve()))
        else:
            log.warning("no PEFT adapter written (%s); %s holds the merged model", reason, run_dir / "final")
        merge_lora(model)
    final = run_dir / "final"
    with atomic_directory(final) as tmp:  # a rerun's final/ is replaced whole, never left half new
        write_model_files(tmp, model, tok_dir)
        if write_extra is not None:
            write_extra(tmp)
        write_checksums(tmp)
    return final


def gathered_for_saving(model: nn.Module, summary: dict, lora: LoraConfig | None, parallel: ParallelContext | None,
                        wrap: Callable[[Transformer], nn.Module] | None = None) -> nn.Module | None:
    """The trained model to save and score: ``model`` itself in one process (its blocks without
    activation checkpointing's wrappers, so its names are the checkpoint's). After a distributed
    run, every rank must call it: the shards are gathered once, to rank 0, into a plain model in
    CPU memory (None on the other ranks; ``wrap`` rebuilds a model around the transformer, as
    ``RewardModel`` the backbone and its head), and the layout is recorded in ``summary``. A
    caller holds no other reference to the sharded model, so its shards are freed once gathered, and
    moves the result to the device to score it."""
    if parallel is None:
        remove_activation_checkpointing(model)
        return model
    summary.update(world_size=parallel.layout.world_size, layout=str(parallel.layout))
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not parallel.is_logging_rank:
        return None
    with torch.device("meta"):  # the architecture alone; the gathered weights fill it
        plain = build_model(model.cfg)
        if lora is not None:
            apply_lora(plain, lora)
        if wrap is not None:
            plain = wrap(plain)
    plain.to_empty(device="cpu")
    load_weights(plain, state, where="the gathered shards")
    return plain
