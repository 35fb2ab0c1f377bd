"""Import a local Hugging Face model folder (config.json plus model.safetensors, or shards listed
in model.safetensors.index.json) as an lmforge checkpoint directory: model.safetensors (our
parameter names, the stored dtype kept), model.json, the folder's tokenizer.json +
tokenizer_config.json, and checksums.json. load_model(out_dir) then computes the same logits as
the HF model. Nothing is downloaded. The config.json's model_type picks the model family (the
table below). RoPE scaling of type linear, dynamic, yarn, longrope and llama3 is kept, and so is
a sliding window (Mistral's on every layer, Qwen2/Qwen3's with use_sliding_window on the layers
layer_types or max_window_layers name). A config.json key that lmforge would compute differently
(other RoPE types, partial rotary, quantized weights, custom modelling code;
lmforge.model.hf.HF_CONFIG_KEYS lists them), or a key it does not know, is refused with one line
naming the file and the key, and nothing is written.

  lmforge import ~/models/SmolLM2-135M runs/smollm2-135m
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from safetensors.torch import save_file

from lmforge.checkpoints.files import MODEL_CONFIG, TOKENIZER_FILES, WEIGHTS, write_checksums
from lmforge.core.config import load_config, option
from lmforge.core.io import InputError, atomic_directory, atomic_write_json, read_json
from lmforge.core.run import format_count, log
from lmforge.data.tokenizer import Tokenizer
from lmforge.model.families import families_table
from lmforge.model.hf import (
    SUPPORTED_ARCHITECTURES,
    cast_weights,
    check_weights,
    model_config_from_hf,
    read_hf_weights,
    state_dict_from_hf,
)

__doc__ += f"\nmodel families (lmforge.model.families; the registry writes this table):\n\n{families_table()}\n"


@dataclass
class ImportRecipe:
    hf_dir: str | None = option(None, help="local Hugging Face model folder (config.json + safetensors weights)")
    run_dir: str = option(
        "runs/import", help="the lmforge checkpoint directory to write (an earlier one there is replaced)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option("auto", help="auto = as stored in the HF folder")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="local Hugging Face model folder (config.json + model*.safetensors)")
    parser.add_argument("out_dir", help="lmforge checkpoint directory to write (recipe key run_dir)")


def recipe_from_args(args: argparse.Namespace) -> ImportRecipe:
    recipe = load_config(ImportRecipe, None, list(args.overrides))
    return dataclasses.replace(recipe, hf_dir=args.hf_dir, run_dir=args.out_dir)


def run_import(recipe: ImportRecipe) -> Path:
    """Write the checkpoint ``recipe.run_dir`` atomically and return its path."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES.values())
    if recipe.hf_dir is None:
        raise InputError("hf_dir is not set: give the Hugging Face model folder to import")
    src, out = Path(recipe.hf_dir), Path(recipe.run_dir)
    if not src.is_dir():
        raise InputError(f"{src}: not a directory; expected a local Hugging Face model folder ({supported}) with config.json")
    config_path = src / "config.json"
    hf_config = read_json(config_path, f"expected a Hugging Face model folder: {supported}")
    cfg = model_config_from_hf(hf_config, where=str(config_path))
    _check_output_dir(out, src)

    try:
        state = state_dict_from_hf(read_hf_weights(src), cfg)
    except KeyError as exc:
        raise InputError(f"{src}: {exc.args[0]}; is this a {supported} folder?") from exc
    check_weights(state, cfg, where=str(src))
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")  # the checkpoint stores a tied matrix once, as embed.weight
    state = cast_weights(state, recipe.dtype)

    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    with atomic_directory(out) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS), metadata={"format": "pt"})
        atomic_write_json(tmp / MODEL_CONFIG, dataclasses.asdict(cfg))
        for name in copied:
            shutil.copyfile(src / name, tmp / name)
        write_checksums(tmp)
    if not copied:
        log.warning("import: %s has no tokenizer.json/tokenizer_config.json; the checkpoint has no tokenizer", src)
    elif len(copied) < len(TOKENIZER_FILES):
        log.warning("import: %s has only %s; the checkpoint's tokenizer is incomplete", src, copied[0])
    else:
        _warn_about_special_tokens(src)
    n_params = sum(v.numel() for v in state.values())
    dtype = str(state["embed.weight"].dtype).removeprefix("torch.")
    log.info("import: %s (%s) -> %s (%s parameters, %s)", src, SUPPORTED_ARCHITECTURES[hf_config["model_type"]], out,
             format_count(n_params), dtype)
    return out


def _warn_about_special_tokens(directory: Path) -> None:
    """Warn, with ``Tokenizer.load``'s own one-line error, when lmforge's stages could not load the
    folder's tokenizer (many HF folders name no BOS or pad token): one rule, the loader's."""
    try:
        Tokenizer.load(directory)
    except InputError as exc:
        log.warning("import: %s; lmforge stages that load the tokenizer stop there until it is fixed", exc)


def _check_output_dir(out: Path, src: Path) -> None:
    """Refuse to replace the source folder, or a folder that is not an earlier checkpoint."""
    out_abs, src_abs = out.resolve(), src.resolve()
    if out_abs == src_abs or out_abs in src_abs.parents:
        raise InputError(f"{out}: the output folder would replace the Hugging Face folder {src}; choose another folder")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MODEL_CONFIG).is_file())):
        raise InputError(f"{out}: exists and is not an lmforge checkpoint; choose a new folder or remove it")


RECIPE = ImportRecipe
run = run_import
