"""What every fine-tuning stage (SFT, reward model, DPO, KTO) does around the one training loop:
start the run (base model with a chat tokenizer, the recipe's examples), size the optimizer
step, wrap LoRA adapters, score greedy answers by exact match, and save the result as a
plain checkpoint plus a PEFT adapter.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lmforge.core.config import ConfigError, at_least, positive
from lmforge.core.io import InputError, atomic_directory, expand_paths
from lmforge.core.run import log, run_dir_lock, start_run
from lmforge.data.chat import add_chat_template, read_sft_records, render_chatml
from lmforge.data.documents import SkipLog
from lmforge.data.packing import IGNORE_INDEX
from lmforge.data.rows import RowLoader
from lmforge.data.sft_demo import exact_match
from lmforge.data.tokenizer import Tokenizer
from lmforge.distributed.memory import check_memory_fits
from lmforge.distributed.mesh import Layout, ParallelContext, launched_world_size, parallel_session, resolve_layout
from lmforge.inference.engine import GenerationConfig, generate, release_decoding_view
from lmforge.model.checkpoint import (
    TOKENIZER_FILES,
    load_model,
    load_model_config,
    load_weights,
    resolve_checkpoint,
    write_checksums,
    write_model_files,
)
from lmforge.model.transformer import Transformer
from lmforge.peft.adapters import save_adapter
from lmforge.peft.lora import LoraConfig, apply_lora, merge_lora
from lmforge.train.loop import TrainConfig, accumulation_steps, resolve_device, run_precision


@dataclass
class ExactMatchConfig:
    exact_match: bool = True  # greedy answers to validation prompts, compared to the reference
    tasks: list[str] = field(default_factory=list)  # files of tasks to score; empty: the validation data
    max_examples: int = at_least(0, 200)
    max_new_tokens: int = positive(32)


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
    if recipe.lora is not None and recipe.lora.quantize_base:
        problems.append("lora.quantize_base=true (QLoRA) runs in one process only so far; launch it without torchrun "
                        "or set lora.quantize_base=false")
    if problems:
        raise ConfigError(f"{stage} under torchrun ({layout}):\n  - " + "\n  - ".join(problems))
    with (parallel_session(recipe.parallel, recipe.train.device) as ctx,
          run_dir_lock(recipe.run_dir, enabled=ctx.is_logging_rank)):  # rank 0 holds it for the job
        return body(ctx)


@dataclass
class FinetuneRun:
    """What every fine-tuning stage (sft, reward, dpo, kto) sets up before its loop."""

    run_dir: Path
    device: torch.device
    precision: str  # chosen once, before the stage evaluates or scores anything
    model: Transformer
    tok: Tokenizer
    tok_dir: Path
    base_dir: Path
    train_examples: list
    val_examples: list
    skipped: SkipLog

    def train_config(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` with the precision chosen here, so the loop trains in the one the stage evaluated in."""
        return dataclasses.replace(cfg, precision=self.precision)


def start_finetune_run(recipe, stage: str, read_examples: Callable,
                       parallel: ParallelContext | None = None) -> FinetuneRun:
    """The run directory, device and precision, the base model with its chat tokenizer, and the
    recipe's training and validation examples (bad ones counted in ``skipped``).

    ``read_examples(paths, tok, max_length, on_bad=, on_too_long=, skipped=)`` returns a list.
    Under ``parallel`` (a data-parallel ``torchrun`` job, ``run_data_parallel``) every rank
    reads all examples and loads the whole base, rank 0 alone writes the run directory and
    chooses the precision for all."""
    check_data_paths(recipe, stage)
    device = parallel.device if parallel is not None else resolve_device(recipe.train.device)
    check_finetune_memory(recipe, device, parallel)
    logging_rank = parallel is None or parallel.is_logging_rank
    run_dir = start_run(recipe, recipe.run_dir) if logging_rank else Path(recipe.run_dir)
    precision = run_precision(recipe.train, run_dir, device, parallel)  # rank 0 chooses for every rank
    torch.manual_seed(recipe.train.seed)
    model, tok, tok_dir, base_dir = load_base(recipe.checkpoint, run_dir, device, recipe.data.max_length, parallel)
    d = recipe.data
    skipped = SkipLog()
    read = dict(on_bad=d.on_bad, on_too_long=d.on_too_long, skipped=skipped)
    train_examples = read_examples(d.train, tok, d.max_length, **read)
    if not train_examples:
        raise InputError(f"no usable training examples in {d.train} ({skipped.total} skipped: {dict(skipped.by_reason)})")
    val_examples = read_examples(d.val, tok, d.max_length, **read) if d.val else []
    log.info("%s: %d training and %d validation examples; %d skipped or truncated %s", stage, len(train_examples),
             len(val_examples), skipped.total, dict(skipped.by_reason) if skipped.total else "")
    return FinetuneRun(run_dir, device, precision, model, tok, tok_dir, base_dir, train_examples, val_examples,
                       skipped)


def check_finetune_memory(recipe, device: torch.device, parallel: ParallelContext | None) -> None:
    """Refuse a micro-batch of ``data.max_length`` rows the device cannot hold, from the base's
    config alone, before the base is loaded (``check_memory_fits``)."""
    model = load_model_config(resolve_checkpoint(recipe.checkpoint, verify=False))
    layout = parallel.layout if parallel is not None else Layout()
    check_memory_fits(model, recipe.parallel, layout, device, micro_batch_size=recipe.train.micro_batch_size,
                      seq_len=recipe.data.max_length, precision=recipe.train.precision,
                      activation_checkpointing=recipe.train.activation_checkpointing, seq_key="data.max_length",
                      adapters_only=getattr(recipe, "lora", None) is not None)


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


def wrap_lora(model: nn.Module, cfg: LoraConfig, stage: str) -> None:
    """Apply LoRA/DoRA/QLoRA adapters in place; configuration problems become ``ConfigError``."""
    try:
        wrapped = apply_lora(model, cfg)
    except ValueError as exc:  # no matching target, a tied target, a shape NF4 cannot block
        raise ConfigError(f"lora: {exc}") from exc
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("%s: LoRA r=%d on %d linears: %.3fM trainable parameters", stage, cfg.r, len(wrapped), trainable / 1e6)


def save_finetuned(model: Transformer, run_dir: Path, tok_dir: Path, base_dir: Path, lora: LoraConfig | None,
                   write_extra: Callable[[Path], None] | None = None) -> Path:
    """The fine-tuned model as a plain checkpoint in ``run_dir/final`` (LoRA merged) that
    generate/export read, plus, for LoRA, the adapter in PEFT's format in ``run_dir/adapter``.
    ``write_extra(directory)`` adds files (a reward head) before the checksums are written."""
    if lora is not None:
        save_adapter(model, lora, run_dir / "adapter", base_model_name_or_path=str(base_dir))
        merge_lora(model)
    final = run_dir / "final"
    with atomic_directory(final) as tmp:  # a rerun's final/ is replaced whole, never left half new
        write_model_files(tmp, model, tok_dir)
        if write_extra is not None:
            write_extra(tmp)
        write_checksums(tmp)
    return final


def gathered_for_saving(run: FinetuneRun, model: nn.Module, summary: dict, lora: LoraConfig | None,
                        parallel: ParallelContext | None,
                        wrap: Callable[[Transformer], nn.Module] | None = None) -> nn.Module | None:
    """The trained model to save and score: ``model`` itself in one process. After a distributed
    run, every rank must call it: the shards are gathered once, to rank 0, into a plain model in
    CPU memory (None on the other ranks; ``wrap`` rebuilds a model around the transformer, as
    ``RewardModel`` the backbone and its head), and the layout is recorded in ``summary``. A
    caller that scores it on the device moves it there once it has dropped its own references to
    the sharded model, so the shards are freed first."""
    if parallel is None:
        return model
    summary.update(world_size=parallel.layout.world_size, layout=str(parallel.layout))
    run.model = None
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not parallel.is_logging_rank:
        return None
    with torch.device("meta"):  # the architecture alone; the gathered weights fill it
        plain = Transformer(model.cfg)
        if lora is not None:
            apply_lora(plain, lora)
        if wrap is not None:
            plain = wrap(plain)
    plain.to_empty(device="cpu")
    load_weights(plain, state, where="the gathered shards")
    return plain


def exact_match_tasks(tok: Tokenizer, paths: list[str], max_examples: int) -> tuple[list[list[int]], list[str]]:
    """Prompts (ChatML up to the generation prompt) and reference answers of conversations ending
    with the assistant, of conversational ``prompt``/``chosen`` pairs (the chosen answer), or of
    desirable ``prompt``/``completion`` examples."""
    prompts: list[list[int]] = []
    answers: list[str] = []
    if not paths:
        return prompts, answers
    for _, record in read_sft_records(paths):
        if not isinstance(record, dict):
            continue
        if isinstance(record.get("messages"), list) and record["messages"]:
            context, answer = record["messages"][:-1], record["messages"][-1]
        elif isinstance(record.get("prompt"), list) and isinstance(record.get("chosen"), list) and record["chosen"]:
            context, answer = record["prompt"], record["chosen"][-1]
        elif (isinstance(record.get("prompt"), list) and isinstance(record.get("completion"), list)
              and record["completion"] and record.get("label", True) is True):
            context, answer = record["prompt"], record["completion"][-1]
        else:
            continue
        if not isinstance(answer, dict) or answer.get("role") != "assistant":
            continue
        text = "".join(seg for seg, _ in render_chatml(context, add_generation_prompt=True))
        prompts.append([tok.bos_id, *tok.encode(text)])
        answers.append(answer["content"])
        if len(prompts) >= max_examples:
            break
    return prompts, answers


def exact_match_accuracy(model: nn.Module, tok: Tokenizer, prompts: list[list[int]], answers: list[str],
                         cfg: ExactMatchConfig) -> dict | None:
    """Greedy answers to the prompts, scored by exact match against the references."""
    if not prompts:
        return None
    was_training = model.training
    model.eval()
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0,
                           stop_token_ids=[tok.token_to_id("<|im_end|>"), tok.eos_id])
    correct = 0
    for i in range(0, len(prompts), 32):
        results = generate(model, prompts[i : i + 32], gen, tok)
        correct += sum(exact_match(r.text, a) for r, a in zip(results, answers[i : i + 32]))
    release_decoding_view(model)  # training may follow: don't hold a second copy of the weights through it
    model.train(was_training)
    return {"exact_match": correct / len(prompts), "examples": len(prompts)}


def task_files(cfg: ExactMatchConfig, val: list[str]) -> list[str]:
    """The files exact match is scored on: ``eval.tasks``, else the validation data (none if disabled)."""
    return (cfg.tasks or val) if cfg.exact_match else []


def check_data_paths(recipe, stage: str) -> None:
    """Every data path a fine-tuning recipe names matches a file, checked before any model is
    loaded; an error names the stage and the recipe key (``data.train``, ``data.val``,
    ``pairs``, ``eval.tasks``)."""
    if not recipe.data.train:
        raise InputError(f"{stage} data.train is empty: list the JSONL/Parquet files to train on")
    keys = {"data.train": recipe.data.train, "data.val": recipe.data.val, "pairs": getattr(recipe, "pairs", None)}
    evaluation = getattr(recipe, "eval", None)
    if evaluation is not None and evaluation.exact_match:
        keys["eval.tasks"] = evaluation.tasks
    for key, paths in keys.items():
        if paths:
            expand_paths(paths, what=f"{stage} {key}")
