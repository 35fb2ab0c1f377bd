"""Merge LoRA adapters or full checkpoints into one: linear averaging, task arithmetic
(Ilharco et al. 2023), TIES (Yadav et al. 2023: trim, elect sign, disjoint mean) and DARE
(Yu et al. 2024: drop and rescale, then linear or TIES).

Inputs are all PEFT-format adapter folders (an sft/dpo run's adapter/) or all lmforge
checkpoints (a checkpoint directory, a fine-tuning run's final/, or a run directory). With
checkpoints, task vectors are tau_i = theta_i - base:

  linear            sum_i w_i theta_i / sum_i w_i                      (no base)
  task_arithmetic   base + scale * sum_i w_i tau_i
  ties              base + scale * disjoint mean of the tau_i trimmed to `density`, agreeing with the elected sign
  dare_linear       base + scale * sum_i w_i m_i*tau_i/(1-p)             m_i ~ Bernoulli(1-p), p = drop_rate
  dare_ties         base + scale * TIES' sign election and disjoint mean of the m_i*tau_i/(1-p)
  magnitude_prune   base + scale * sum_i w_i tau_i trimmed to `density` (TIES without the election)

Adapters merge as peft's add_weighted_adapter merges them with the combination type of the same
name: linear, ties, dare_linear, dare_ties and magnitude_prune combine the A and B factors (weights
+-sqrt(|w_i s_i|)), cat joins them (rank sum r_i, exactly sum_i w_i s_i B_i A_i), and the svd
types (svd, ties_svd, ...) merge the whole updates s_i B_i A_i by the same rules and keep their
truncated SVD of rank svd_rank (default: the largest r_i); the result is a
PEFT adapter folder (output=adapter) or, with `base` (the lmforge checkpoint the adapters were
trained on) and output=checkpoint, that checkpoint with the merged update added. A checkpoint
written by merge holds checksums as every checkpoint does, so eval, generate, serve and export
read it; merge.json records the method and inputs. DARE's masks are seeded (`seed`).

  lmforge merge recipes/merge/ties.yaml
  lmforge merge runs/sft-a/final runs/sft-b/final --method ties --base runs/pretrain --out runs/merged density=0.5
  lmforge merge runs/sft-a/adapter runs/sft-b/adapter --method cat --weights 0.5 0.5 --out runs/merged-adapter
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file

from lmforge.checkpoints.files import MODEL_CONFIG, TOKENIZER_FILES, WEIGHTS, load_model_config
from lmforge.checkpoints.load import read_checkpoint_weights, resolve_checkpoint
from lmforge.checkpoints.merge import (
    CHECKPOINT_METHODS,
    add_deltas,
    merge_states,
    model_config_difference,
    tensor_shape,
    weights_view,
    write_checkpoint_files,
)
from lmforge.core.config import (
    ConfigError,
    check_ranges,
    in_range,
    load_config,
    option,
    positive,
    seed_field,
    unit_interval,
)
from lmforge.core.io import InputError, atomic_write_json, read_json, sha256_file
from lmforge.core.run import HOLDER_FILE, LOCK_FILE, atomic_run_dir, log, run_dir_lock
from lmforge.data.chatml import CHATML_TEMPLATE
from lmforge.model.hf import HF_WEIGHTS, from_hf_name, state_dict_to_hf
from lmforge.peft.adapters import ADAPTER_CONFIG, PEFT_PREFIX
from lmforge.peft.merge import (
    ADAPTER_METHODS,
    DROPS,
    SVD_METHODS,
    TRIMS,
    Adapter,
    delta_weights,
    merge_adapters,
    read_adapter,
    rule_of,
    write_adapter_files,
)

METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "magnitude_prune", "cat", *SVD_METHODS)
MERGE_RECORD = "merge.json"
# one input has nothing to average, join or elect a sign with
NEEDS_TWO = ("linear", "cat", "ties", "dare_ties", *SVD_METHODS)


@dataclass
class MergeInput:
    path: str = option(help="a PEFT adapter folder, or an lmforge checkpoint / fine-tuning run / run directory")
    weight: float = in_range(1.0, help="w_i, this input's weight (negative subtracts its task vector)")


@dataclass
class MergeRecipe:
    method: Literal["linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "magnitude_prune", "cat", "svd",
                    "ties_svd", "dare_linear_svd", "dare_ties_svd", "magnitude_prune_svd"] = option(
        "linear", help="linear | task_arithmetic | ties | dare_linear | dare_ties | magnitude_prune (checkpoints); "
        "linear | cat | ties | dare_linear | dare_ties | magnitude_prune and svd | ties_svd | dare_linear_svd | "
        "dare_ties_svd | magnitude_prune_svd (adapters: peft's add_weighted_adapter combination types)")
    inputs: list[MergeInput] = option(
        default_factory=list, help="the models to merge, each {path, weight}: all adapter folders or all checkpoints")
    base: str | None = option(None, help="checkpoints: the model the task vectors are taken from (every method but "
                              "linear); adapters: the lmforge checkpoint they were trained on, for output=checkpoint")
    output: Literal["auto", "adapter", "checkpoint"] = option(
        "auto", help="auto: an adapter folder from adapters, a checkpoint from checkpoints; checkpoint from adapters "
        "adds the merged update to base")
    scale: float = positive(1.0, help="λ: the merged task vector's scale (mergekit's lambda; a merged adapter's "
                            "lora_alpha is scale·r)")
    density: float = unit_interval(1.0, low_open=True, help="ties, magnitude_prune: the fraction of each task vector's entries kept, "
                                   "those of largest magnitude (1 keeps all)")
    drop_rate: float = unit_interval(0.0, high_open=True, help="dare_*: p, the probability of dropping each entry of a "
                                     "task vector; the kept are scaled by 1/(1-p) (peft's density is 1-p)")
    svd_rank: int | None = positive(None, help="*svd (adapters): the merged adapter's rank; None: the largest input rank")
    seed: int = seed_field(0, help="dare_*: the seed of the drop masks (each tensor's drawn from the seed and its name)")
    run_dir: str = option("runs/merge", help="the folder to write (an earlier merge there is replaced)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sources", nargs="*", metavar="RECIPE.yaml | INPUT",
                        help="a YAML recipe and/or the folders to merge (adapters or checkpoints; recipe key inputs), "
                             "then key=value overrides")
    parser.add_argument("--method", choices=METHODS, default=None, help="the merge method (recipe key method)")
    parser.add_argument("--weights", nargs="+", type=float, metavar="W", default=None,
                        help="one weight per input, in order (default 1 each)")
    parser.add_argument("--base", default=None, help="the base checkpoint (recipe key base)")
    parser.add_argument("--output", choices=["auto", "adapter", "checkpoint"], default=None,
                        help="what to write (recipe key output)")
    parser.add_argument("--out", default=None, metavar="DIR", help="the folder to write (recipe key run_dir)")


def recipe_from_args(args: argparse.Namespace) -> MergeRecipe:
    items = [*args.sources, *args.overrides]
    recipes = [s for s in items if s.endswith((".yaml", ".yml")) and "=" not in s]
    overrides = [s for s in items if "=" in s]
    folders = [s for s in items if s not in recipes and s not in overrides]
    if len(recipes) > 1:
        raise ConfigError(f"give one recipe, not {len(recipes)}: {', '.join(recipes)}")
    recipe = load_config(MergeRecipe, recipes[0] if recipes else None, overrides, overrides_label="command-line override")
    inputs = [MergeInput(path) for path in folders] or recipe.inputs
    if args.weights is not None:
        if len(args.weights) != len(inputs):
            raise ConfigError(f"--weights: {len(args.weights)} weights for {len(inputs)} inputs")
        inputs = [dataclasses.replace(item, weight=w) for item, w in zip(inputs, args.weights)]
    given = {"method": args.method, "base": args.base, "output": args.output, "run_dir": args.out}
    recipe = dataclasses.replace(recipe, inputs=inputs, **{k: v for k, v in given.items() if v is not None})
    check_ranges(recipe, source="command line")
    return recipe


def check_recipe(recipe: MergeRecipe) -> None:
    """The recipe's own errors, before any file is read: one line naming the key."""
    method, n = recipe.method, len(recipe.inputs)
    if n == 0:
        raise ConfigError("inputs: no inputs; give the folders to merge (inputs: [{path: ...}, ...] or on the command line)")
    if method in NEEDS_TWO and n < 2:
        raise ConfigError(f"inputs: {method} merges at least 2 inputs, got {n}")
    if recipe.density != 1.0 and rule_of(method) not in TRIMS:
        raise ConfigError(f"density: only ties and magnitude_prune (and their svd types) trim by magnitude; {method} "
                          f"would ignore density={recipe.density}")
    if recipe.drop_rate != 0.0 and rule_of(method) not in DROPS:
        raise ConfigError(f"drop_rate: only the dare_* methods drop; {method} would ignore drop_rate={recipe.drop_rate}")
    if recipe.svd_rank is not None and method not in SVD_METHODS:
        raise ConfigError(f"svd_rank: only the *svd methods reduce to a rank; {method} would ignore svd_rank={recipe.svd_rank}")


def run_merge(recipe: MergeRecipe) -> dict:
    """Merge ``recipe.inputs`` into ``recipe.run_dir`` (written atomically; nothing is written on an
    error) and return the record ``merge.json`` holds."""
    check_recipe(recipe)
    kinds = [input_kind(item.path, f"inputs[{i}].path") for i, item in enumerate(recipe.inputs)]
    if len(set(kinds)) > 1:
        i = kinds.index(next(k for k in kinds if k != kinds[0]))
        raise ConfigError(f"inputs[{i}].path: {recipe.inputs[i].path} is {'an adapter' if kinds[i] == 'adapter' else 'a checkpoint'}"
                          f", inputs[0] {'an adapter' if kinds[0] == 'adapter' else 'a checkpoint'}: merge adapters "
                          "with adapters and checkpoints with checkpoints")
    out = Path(recipe.run_dir)
    if kinds[0] == "adapter":
        return merge_adapter_inputs(recipe, out)
    return merge_checkpoint_inputs(recipe, out)


def input_kind(path: str, key: str) -> str:
    p = Path(path)
    if not p.exists():
        raise InputError(f"{key}: {path}: not found")
    return "adapter" if (p / ADAPTER_CONFIG).is_file() else "checkpoint"


def record(recipe: MergeRecipe, kind: str, output: str, paths: list[Path], base: Path | None, **extra) -> dict:
    return {"method": recipe.method, "kind": kind, "output": output,
            "inputs": [{"path": str(p.resolve()), "weight": item.weight} for p, item in zip(paths, recipe.inputs)],
            "base": str(base.resolve()) if base is not None else None, "scale": recipe.scale,
            "density": recipe.density, "drop_rate": recipe.drop_rate, "seed": recipe.seed, "svd_rank": recipe.svd_rank,
            "run_dir": recipe.run_dir, **extra}


# --------------------------------------------------------------------------- checkpoints


def merge_checkpoint_inputs(recipe: MergeRecipe, out: Path) -> dict:
    method = recipe.method
    if method not in CHECKPOINT_METHODS:
        raise ConfigError(f"method: {method} merges LoRA adapters' factors or updates; checkpoints merge by "
                          f"{', '.join(CHECKPOINT_METHODS)} (the sum of their task vectors: task_arithmetic)")
    if recipe.output == "adapter":
        raise ConfigError("output: checkpoints merge into a checkpoint; output=adapter is for adapter inputs")
    if method == "linear" and recipe.base is not None:
        raise ConfigError("base: linear averages the checkpoints themselves and reads no base; remove base, or "
                          "choose task_arithmetic, ties, dare_linear or dare_ties to merge task vectors")
    if method == "linear" and recipe.scale != 1.0:
        raise ConfigError("scale: linear averages the checkpoints themselves; scale multiplies task vectors "
                          "(task_arithmetic, ties, dare_linear, dare_ties)")
    if method != "linear" and recipe.base is None:
        raise ConfigError(f"base: {method} merges task vectors (input - base); give the checkpoint the inputs were "
                          "fine-tuned from")
    dirs = [checkpoint(item.path, f"inputs[{i}].path") for i, item in enumerate(recipe.inputs)]
    base_dir = checkpoint(recipe.base, "base") if recipe.base is not None else None
    check_output_dir(out, [*dirs, *([base_dir] if base_dir else [])])
    cfg = load_model_config(dirs[0])
    named = [(f"inputs[{i}].path", d) for i, d in enumerate(dirs)] + ([("base", base_dir)] if base_dir else [])
    for key, d in named[1:]:
        if (diff := model_config_difference(cfg, load_model_config(d))) is not None:
            raise InputError(f"{key}: {d / MODEL_CONFIG} differs from {dirs[0] / MODEL_CONFIG} in {diff}: only checkpoints "
                             "of one model shape and family merge")
        check_same_tokenizer(dirs[0], d, key)
    states = [weights_view(d) for d in dirs]
    base_state = weights_view(base_dir) if base_dir else None
    for (key, d), state in zip(named[1:], [*states[1:], *([base_state] if base_state is not None else [])]):
        check_same_tensors(states[0], state, key, d)
    if method == "linear" and sum(item.weight for item in recipe.inputs) == 0:
        raise ConfigError("inputs: linear divides by the sum of the weights, which is 0")
    merged = merge_states(states, [item.weight for item in recipe.inputs], method, base_state, recipe.scale,
                          recipe.density, recipe.drop_rate, recipe.seed)
    tokenizer = dirs[0] if all((dirs[0] / n).is_file() for n in TOKENIZER_FILES) else None
    result = record(recipe, "checkpoint", "checkpoint", dirs, base_dir)
    write_output(out, lambda tmp: write_checkpoint_files(tmp, merged, cfg, tokenizer), result)
    log.info("merge: %s of %d checkpoints -> %s", method, len(dirs), out)
    return result


def checkpoint(path: str, key: str) -> Path:
    try:
        return resolve_checkpoint(path)
    except InputError as exc:
        raise InputError(f"{key}: {exc}") from exc


def check_same_tokenizer(first: Path, other: Path, key: str) -> None:
    """Refuse a checkpoint whose ``tokenizer.json`` differs from the first input's: its embedding rows
    would mean other tokens (``tokenizer_config.json``, e.g. a chat template, may differ)."""
    a, b = first / TOKENIZER_FILES[0], other / TOKENIZER_FILES[0]
    if a.is_file() and b.is_file() and sha256_file(a) != sha256_file(b):
        raise InputError(f"{key}: {b} differs from {a}: the checkpoints' embeddings index other vocabularies")


def check_same_tensors(first: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor], key: str,
                       where: Path) -> None:
    """The same tensor names and shapes as inputs[0] (shapes read without reading the tensors)."""
    if set(first) != set(other):
        extra = sorted(set(first) ^ set(other))
        raise InputError(f"{key}: {where / WEIGHTS} holds other tensors than inputs[0] (e.g. {extra[0]})")
    for name in first:
        if tensor_shape(first, name) != tensor_shape(other, name):
            raise InputError(f"{key}: {where / WEIGHTS}: {name} has shape {tensor_shape(other, name)}, inputs[0]'s "
                             f"{tensor_shape(first, name)}")


# --------------------------------------------------------------------------- adapters


def merge_adapter_inputs(recipe: MergeRecipe, out: Path) -> dict:
    method = recipe.method
    if method not in ADAPTER_METHODS:
        raise ConfigError("method: task_arithmetic of LoRA adapters is method=cat, which sums the updates exactly "
                          "(sum_i w_i s_i B_i A_i, of rank sum r_i)")
    output = "adapter" if recipe.output == "auto" else recipe.output
    if output == "adapter" and recipe.base is not None:
        raise ConfigError("base: a merged adapter applies to the adapters' own base; set output=checkpoint to add it "
                          "to base, or remove base")
    if output == "checkpoint" and recipe.base is None:
        raise ConfigError("base: output=checkpoint adds the merged adapter to a base: give the lmforge checkpoint "
                          "the adapters were trained on")
    dirs = [Path(item.path) for item in recipe.inputs]
    read = [read_adapter(d, f"inputs[{i}].path") for i, d in enumerate(dirs)]
    configs, adapters = [c for c, _ in read], [a for _, a in read]
    check_adapters_agree(dirs, configs, adapters, method)
    if method in SVD_METHODS and recipe.svd_rank is not None:
        module, (A, B) = min(adapters[0].factors.items(), key=lambda kv: min(kv[1][0].shape[1], kv[1][1].shape[0]))
        if recipe.svd_rank > min(A.shape[1], B.shape[0]):
            raise ConfigError(f"svd_rank: {recipe.svd_rank} exceeds the rank {min(A.shape[1], B.shape[0])} of an update "
                              f"of {module.removeprefix(PEFT_PREFIX)} ({B.shape[0]} x {A.shape[1]})")
    base_dir = checkpoint(recipe.base, "base") if output == "checkpoint" else None
    check_output_dir(out, [*dirs, *([base_dir] if base_dir else [])])
    merged = merge_adapters(adapters, [item.weight for item in recipe.inputs], method, recipe.density,
                            recipe.drop_rate, recipe.seed, svd_rank=recipe.svd_rank)
    result = record(recipe, "adapter", output, dirs, base_dir, r=merged.r)
    if output == "adapter":
        write_output(out, lambda tmp: write_adapter_files(tmp, merged, configs[0], recipe.scale), result)
    else:
        cfg = load_model_config(base_dir)
        state = read_checkpoint_weights(base_dir)
        check_adapter_base(configs[0].get("base_model_name_or_path"), base_dir, state, cfg, dirs[0])
        deltas = {our_weight_name(m, cfg.family, dirs[0]): recipe.scale * d for m, d in delta_weights(merged).items()}
        state = add_deltas(state, deltas, f"inputs[0].path: {dirs[0]}")
        write_output(out, lambda tmp: write_adapted_checkpoint(tmp, state, cfg, base_dir), result)
    log.info("merge: %s of %d adapters -> %s (%s, r=%d)", method, len(dirs), out, output, merged.r)
    return result


def check_adapters_agree(dirs: list[Path], configs: list[dict], adapters: list[Adapter], method: str) -> None:
    """One module set, one rank (but for cat), factors of one shape, and one base for all."""
    first = adapters[0]
    for i, (d, config, adapter) in enumerate(zip(dirs, configs, adapters)):
        key = f"inputs[{i}].path"
        if set(adapter.factors) != set(first.factors):
            odd = sorted(set(adapter.factors) ^ set(first.factors))[0].removeprefix(PEFT_PREFIX)
            raise InputError(f"{key}: {d} adapts other modules than inputs[0] (e.g. {odd}): merged adapters must "
                             "target the same modules")
        if method not in ("cat", *SVD_METHODS) and adapter.r != first.r:
            raise InputError(f"{key}: {d} has rank r={adapter.r}, inputs[0] r={first.r}: {method} needs one rank (cat "
                             "and the *svd methods merge adapters of any ranks)")
        for module, (A, B) in adapter.factors.items():
            A0, B0 = first.factors[module]
            if A.shape[1] != A0.shape[1] or B.shape[0] != B0.shape[0]:
                raise InputError(f"{key}: {d}: {module.removeprefix(PEFT_PREFIX)} maps {A.shape[1]} -> {B.shape[0]}, "
                                 f"inputs[0]'s {A0.shape[1]} -> {B0.shape[0]}: the adapters are over other models")
        if i and not same_base(configs[0].get("base_model_name_or_path"), config.get("base_model_name_or_path")):
            raise InputError(f"{key}: {d / ADAPTER_CONFIG} names the base {config.get('base_model_name_or_path')}, whose "
                             f"weights differ from inputs[0]'s base {configs[0].get('base_model_name_or_path')}: "
                             "adapters over different bases do not merge")


def base_weights_file(path: str | None) -> Path | None:
    """The weights file of the base an adapter names (a Hugging Face folder, or an lmforge checkpoint); None
    where it is not on this machine."""
    if not path:
        return None
    for name in (HF_WEIGHTS, WEIGHTS):
        if (Path(path) / name).is_file():
            return Path(path) / name
    return None


def same_base(a: str | None, b: str | None) -> bool:
    """Whether two adapters' bases hold the same weights (two runs' base-hf/ exports of one checkpoint
    are byte for byte the same file); a base that is not on this machine cannot be told apart."""
    if a == b:
        return True
    fa, fb = base_weights_file(a), base_weights_file(b)
    if fa is None or fb is None:
        log.warning("merge: cannot compare the adapters' bases %s and %s (not found here); merging them as one", a, b)
        return True
    return fa.resolve() == fb.resolve() or sha256_file(fa) == sha256_file(fb)


def check_adapter_base(named: str | None, base_dir: Path, state: dict[str, torch.Tensor], cfg, adapter_dir: Path) -> None:
    """Refuse a ``base`` whose weights differ from those of the base the adapters name."""
    weights = base_weights_file(named)
    if weights is None:
        log.warning("merge: %s names the base %s, which is not here; adding the merge to %s unchecked", adapter_dir, named, base_dir)
        return
    ours = state if weights.name == WEIGHTS and (weights.parent / MODEL_CONFIG).is_file() else state_dict_to_hf(state, cfg)
    theirs = load_file(str(weights))
    if set(ours) != set(theirs) or any(not torch.equal(ours[k], theirs[k]) for k in ours):
        raise InputError(f"base: {base_dir} is not the base the adapters were trained on ({adapter_dir / ADAPTER_CONFIG} "
                         f"names {named}, whose weights differ)")


def our_weight_name(module: str, family: str, adapter_dir: Path) -> str:
    try:
        return from_hf_name(module.removeprefix(PEFT_PREFIX) + ".weight", family)
    except KeyError as exc:
        raise InputError(f"inputs[0].path: {adapter_dir}: {exc.args[0]}") from exc


def write_adapted_checkpoint(tmp: Path, state: dict[str, torch.Tensor], cfg, base_dir: Path) -> None:
    """The base plus the merged update, with the base's tokenizer and the ChatML template the adapters
    were trained on where the base has none (every lmforge fine-tuning run adds it, as its final/ has it)."""
    if not all((base_dir / n).is_file() for n in TOKENIZER_FILES):
        write_checkpoint_files(tmp, state, cfg, None)
        return
    stored = read_json(base_dir / TOKENIZER_FILES[1], "tokenizer config")
    write_checkpoint_files(tmp, state, cfg, base_dir, chat_template=None if stored.get("chat_template") else CHATML_TEMPLATE)


# --------------------------------------------------------------------------- output


def check_output_dir(out: Path, inputs: list[Path]) -> None:
    """Refuse to replace an input (or a folder holding one), or a folder that is not an earlier merge
    (a folder holding only a run lock, a lifecycle stage's, is empty)."""
    out_abs = out.resolve()
    for p in inputs:
        if out_abs == p.resolve() or out_abs in p.resolve().parents:
            raise InputError(f"run_dir: {out} would replace the input {p}; choose another folder")
    held = {LOCK_FILE, HOLDER_FILE}
    if out.exists() and (not out.is_dir() or (any(p.name not in held for p in out.iterdir())
                                              and not (out / MERGE_RECORD).is_file())):
        raise InputError(f"run_dir: {out} exists and is not an earlier merge; choose a new folder or remove it")


def write_output(out: Path, write, result: dict) -> None:
    """``write(tmp)`` and ``merge.json`` into a temporary sibling that replaces ``out`` whole (under the
    folder's run lock where it has one: a lifecycle stage's)."""
    def files(tmp: Path) -> None:
        atomic_write_json(tmp / MERGE_RECORD, result)
        write(tmp)

    with run_dir_lock(out, enabled=(out / LOCK_FILE).is_file()), atomic_run_dir(out) as tmp:
        files(tmp)


def report(res: dict, stage_dir: Path, plot_path: Path) -> list[str]:
    """Lines for the lifecycle report: what was merged, how, and where the result is."""
    inputs = ", ".join(f"`{i['path']}` ({i['weight']:g})" for i in res.get("inputs", []))
    knobs = {k: res[k] for k in ("scale", "density", "drop_rate", "seed", "svd_rank") if res.get(k) is not None}
    lines = [f"- {res.get('method')} of {len(res.get('inputs', []))} {res.get('kind')}s (weights in brackets): {inputs}",
             f"- into the {res.get('output')} `{stage_dir}`" + (f", over the base `{res['base']}`" if res.get("base") else ""),
             f"- {', '.join(f'{k} {v}' for k, v in knobs.items())}"]
    return lines


RECIPE = MergeRecipe
run = run_merge
