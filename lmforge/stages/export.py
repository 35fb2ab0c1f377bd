"""Export a checkpoint as a Hugging Face model folder: config.json, model.safetensors
(HF parameter names; a tied output matrix stored once), generation_config.json, and the
checkpoint's tokenizer.json + tokenizer_config.json. transformers then loads it with
AutoModelForCausalLM.from_pretrained(dir), as the class of the model's family (the table
below) that computes it exactly, and AutoTokenizer.from_pretrained(dir). A model that no
class of its family computes exactly is refused, naming what differs. <checkpoint> is a
checkpoint directory or a run directory (its newest valid checkpoint).

A tokenizer with ChatML's <|im_end|> has it and end-of-text as stop tokens (eos_token_id
a list in generation_config.json), so transformers' generate on an apply_chat_template
prompt stops at the end of the turn; a chat model's (one with a chat_template)
tokenizer_config.json names <|im_end|> as eos_token. With --merge-lora the export keeps
the ChatML chat template the adapter was trained with.

  lmforge export runs/pretrain runs/hf dtype=bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from safetensors.torch import save_file

from lmforge.checkpoints.files import TOKENIZER_FILES, WEIGHTS, load_model_config
from lmforge.checkpoints.load import read_checkpoint_weights, resolve_checkpoint
from lmforge.core.config import load_config, option
from lmforge.core.io import InputError, atomic_write_json
from lmforge.core.run import HOLDER_FILE, LOCK_FILE, atomic_run_dir, format_count, log, run_dir_lock
from lmforge.data.chatml import CHATML_TEMPLATE
from lmforge.model.families import families_table
from lmforge.model.hf import (
    HF_WEIGHTS,
    cast_weights,
    chat_tokenizer_config,
    check_weights,
    generation_config_dict,
    hf_config_dict,
    read_tokenizer_files,
    special_token_ids,
    state_dict_to_hf,
)

__doc__ += f"\nmodel families (lmforge.model.families; the registry writes this table):\n\n{families_table()}\n"


@dataclass
class ExportRecipe:
    checkpoint: str = option(
        "runs/pretrain", help="a checkpoint directory, or a run directory (its newest valid checkpoint)"
    )
    run_dir: str = option(
        "runs/hf", help="the Hugging Face model folder to write (an earlier export there is replaced)"
    )
    format: Literal["hf"] = option("hf", help="hf: a transformers model folder (config.json, safetensors, tokenizer)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option("auto", help="auto = as stored in the checkpoint")
    merge_lora: str | None = option(None, help="a PEFT-format adapter folder to merge into the checkpoint's weights")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory, or a run directory (uses its newest valid checkpoint)")
    parser.add_argument("out_dir", help="output folder for the Hugging Face model (recipe key run_dir)")
    parser.add_argument("--format", choices=["hf"], default="hf", help="output format (default: hf)")
    parser.add_argument("--merge-lora", metavar="ADAPTER", default=None,
                        help="merge this LoRA/DoRA adapter (PEFT format, e.g. an sft run's adapter/) into the weights")


def recipe_from_args(args: argparse.Namespace) -> ExportRecipe:
    recipe = load_config(ExportRecipe, None, list(args.overrides))
    recipe = dataclasses.replace(recipe, checkpoint=args.checkpoint, run_dir=args.out_dir, format=args.format)
    return dataclasses.replace(recipe, merge_lora=args.merge_lora) if args.merge_lora else recipe


def run_export(recipe: ExportRecipe, chat: bool = False) -> Path:
    """Write ``recipe.run_dir`` atomically; return the checkpoint directory that was exported.
    ``chat``: the export gets the ChatML template when the checkpoint has none (the base of a
    fine-tuning run's adapter, which was trained on it), as ``merge_lora`` does."""
    ckpt = resolve_checkpoint(recipe.checkpoint)
    out = Path(recipe.run_dir)
    _check_output_dir(out, ckpt)
    # A folder with a run lock in it (a lifecycle's export stage: the lifecycle locks, and so makes,
    # the stage's folder first) is exported into under that lock, which the swap keeps; a held lock
    # of this process is used as it is, another process's is refused. Without one, the export takes
    # none, so a plain export's folder holds only the model's files.
    with run_dir_lock(out, enabled=(out / LOCK_FILE).is_file()):
        return _write_export(recipe, ckpt, out, chat)


def _write_export(recipe: ExportRecipe, ckpt: Path, out: Path, chat: bool) -> Path:
    """``run_export`` once its output folder is checked (and locked, where it has a lock)."""
    cfg = load_model_config(ckpt)
    if recipe.merge_lora:
        state = merged_state(ckpt, recipe.merge_lora)
    else:
        state = read_checkpoint_weights(ckpt)  # model.safetensors, or a distributed checkpoint's shards
    check_weights(state, cfg, where=str(ckpt / WEIGHTS))
    state = cast_weights(state, recipe.dtype)
    dtype = str(state["embed.weight"].dtype).removeprefix("torch.")
    tokenizer = export_tokenizer(ckpt, merging=bool(recipe.merge_lora) or chat)
    token_ids = special_token_ids(tokenizer.vocab, tokenizer.exported) if tokenizer else {}
    try:
        hf_config = hf_config_dict(cfg, dtype=dtype, **token_ids)
    except ValueError as exc:
        raise InputError(f"{ckpt}: cannot export to Hugging Face format: {exc}") from exc

    if cfg.mtp.enabled:
        log.warning("export: %s's %d multi-token prediction modules (model.mtp) are left out: %s does not run them, and "
                    "generation ignores them", ckpt, cfg.mtp.depth, hf_config["architectures"][0])
    with atomic_run_dir(out) as tmp:  # carries a held lock into the new folder
        hf_state = {k: v.contiguous() for k, v in state_dict_to_hf(state, cfg).items()}
        save_file(hf_state, str(tmp / HF_WEIGHTS), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", hf_config)
        copied = [name for name in TOKENIZER_FILES if (ckpt / name).is_file()]
        for name in copied:
            shutil.copyfile(ckpt / name, tmp / name)
        if tokenizer and token_ids:
            atomic_write_json(tmp / "generation_config.json", generation_config_dict(*tokenizer))
        if tokenizer and tokenizer.exported != tokenizer.stored:
            atomic_write_json(tmp / "tokenizer_config.json", tokenizer.exported)
    if len(copied) < len(TOKENIZER_FILES):
        log.warning("export: %s has no %s; AutoTokenizer.from_pretrained(%s) will not work", ckpt, " or ".join(sorted(set(TOKENIZER_FILES) - set(copied))), out)
    n_params = sum(v.numel() for v in hf_state.values())
    log.info("export: %s -> %s (%s, %s parameters, %s)", ckpt, out, hf_config["architectures"][0], format_count(n_params), dtype)
    return ckpt


class ExportTokenizer(NamedTuple):
    vocab: dict[str, int]  # every token -> its id
    stored: dict  # the checkpoint's tokenizer_config.json
    exported: dict  # the one the export writes


def export_tokenizer(ckpt: Path, merging: bool) -> ExportTokenizer | None:
    """The checkpoint's tokenizer and the tokenizer_config.json to export; None without a tokenizer.

    A chat model's eos_token becomes <|im_end|> (``chat_tokenizer_config``). A merged adapter was
    trained on ChatML (every lmforge fine-tuning stage adds the template to its run's tokenizer),
    so a base without a ``chat_template`` gets it, as the fine-tuning run's own tokenizer has it.
    """
    tokenizer = read_tokenizer_files(ckpt)
    if tokenizer is None:
        return None
    vocab, stored = tokenizer
    exported = stored
    if merging and not stored.get("chat_template"):
        log.info("export: %s has no chat_template; the merged adapter was trained on ChatML, so the export gets its template", ckpt)
        exported = {**stored, "chat_template": CHATML_TEMPLATE}
    return ExportTokenizer(vocab, stored, chat_tokenizer_config(vocab, exported))


def merged_state(ckpt: Path, adapter_dir: str) -> dict:
    """The checkpoint's weights with a PEFT-format adapter merged in: W + s·BA (DoRA: (m/n)(W + s·BA))."""
    from lmforge.checkpoints.files import model_state_for_saving
    from lmforge.checkpoints.load import load_model
    from lmforge.peft.adapters import load_adapter
    from lmforge.peft.lora import merge_lora

    if not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise InputError(f"{adapter_dir}: no adapter_config.json; give a PEFT-format adapter folder (an sft run's adapter/)")
    model, _ = load_model(ckpt)
    wrapped = load_adapter(model, adapter_dir)
    merge_lora(model)
    log.info("export: merged %d adapted linears from %s", len(wrapped), adapter_dir)
    return {k: v.detach() for k, v in model_state_for_saving(model).items()}


def _check_output_dir(out: Path, ckpt: Path) -> None:
    """Refuse to replace the checkpoint itself, or a folder that is not an earlier export: a folder
    holding nothing but a run lock (the one a lifecycle makes for its export stage) is empty."""
    out_abs, ckpt_abs = out.resolve(), ckpt.resolve()
    if out_abs == ckpt_abs or out_abs in ckpt_abs.parents:
        raise InputError(f"{out}: the output folder would replace the checkpoint {ckpt}; choose another folder")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a Hugging Face model folder; choose a new folder or remove it")
    held = {LOCK_FILE, HOLDER_FILE}
    if out.is_dir() and any(p.name not in held for p in out.iterdir()) and not (out / "config.json").is_file():
        raise InputError(f"{out}: exists and is not a Hugging Face model folder; choose a new folder or remove it")


RECIPE = ExportRecipe
run = run_export
