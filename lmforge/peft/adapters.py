"""LoRA/DoRA adapters on disk in PEFT's format, so ``peft.PeftModel.from_pretrained`` loads them.

A folder holds ``adapter_config.json`` (PEFT ``LoraConfig`` fields, targets under HF names
such as ``q_proj``) and ``adapter_model.safetensors`` with PEFT's key names::

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight      (r, in)
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight      (out, r)
    base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector  (out,)  DoRA only

The base model is the ``lmforge export`` of the same checkpoint (``lmforge.model.hf`` names).
QLoRA adapters are the same tensors: the quantised base is not saved, and ``load_adapter`` fills a
model on which ``apply_lora(model, LoraConfig(quantize_base=..., ...))`` was already called. A LoftQ
adapter (``init: loftq``) is written as trained; peft's ``init_lora_weights`` says True (kaiming),
since the factors are in the file and peft's own LoftQ init needs bitsandbytes on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lmforge.core.io import InputError, atomic_directory, atomic_write_json
from lmforge.model.hf import from_hf_name, to_hf_name
from lmforge.peft.lora import LoraConfig, apply_lora, lora_modules
from lmforge.peft.quant import QuantizedLinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_SUFFIXES = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")


def hf_module_name(name: str, family: str = "llama") -> str:
    """``layers.0.attn.wq`` -> ``model.layers.0.self_attn.q_proj`` (a module, so no ``.weight``), in the
    Hugging Face class of model family ``family``; ``KeyError`` where that class has no such module."""
    return to_hf_name(f"{name}.weight", family).removesuffix(".weight")


def model_family(model: torch.nn.Module) -> str:
    return getattr(getattr(model, "cfg", None), "family", "llama")


def exported_adapters(model: torch.nn.Module) -> dict:
    """The adapters a PEFT folder holds: all but those of the multi-token prediction modules (``model.mtp``),
    which the Hugging Face class, like lmforge's export, does not have (they stay in the merged checkpoint)."""
    return {n: m for n, m in lora_modules(model).items() if not n.startswith("mtp.")}


def peft_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model``'s adapters cannot be saved in PEFT's format (a wrapped module the family's Hugging
    Face class lacks, e.g. Phi-3's joined q/k/v), or None when ``save_adapter`` can write them."""
    for name in exported_adapters(model):
        try:
            hf_module_name(name, model_family(model))
        except KeyError as exc:
            return str(exc.args[0])
    return None


def peft_target_modules(wrapped: list[str], all_linears: list[str], family: str = "llama") -> list[str]:
    """Short HF names (``q_proj``) when PEFT's suffix matching selects exactly ``wrapped``; else full names.
    A module of ``all_linears`` without a Hugging Face name (a head of our own) selects nothing."""
    def hf_names(names: list[str]) -> dict[str, str]:
        named = {}
        for n in names:
            try:
                named[n] = hf_module_name(n, family)
            except KeyError:
                pass
        return named

    wrapped_hf = set(hf_names(wrapped).values())
    short = sorted({n.rsplit(".", 1)[-1] for n in wrapped_hf})
    selected = {h for h in hf_names(all_linears).values() if h.rsplit(".", 1)[-1] in short}
    return short if selected == wrapped_hf else sorted(wrapped_hf)


def peft_config_dict(cfg: LoraConfig, target_modules: list[str], base_model_name_or_path: str | None = None) -> dict:
    """``adapter_config.json`` contents: the PEFT ``LoraConfig`` fields that describe our adapters."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": target_modules,
        "exclude_modules": None,
        "use_rslora": cfg.use_rslora,
        "use_dora": cfg.use_dora,
        "init_lora_weights": "gaussian" if cfg.init == "gaussian" else True,
        "bias": "none",
        "lora_bias": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_adapter(model: torch.nn.Module, cfg: LoraConfig, directory: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """Write ``model``'s adapters (applied with ``cfg``) as a PEFT adapter folder; replaces an earlier one
    (``exported_adapters``: the MTP modules' are left out)."""
    modules = exported_adapters(model)
    if not modules:
        raise ValueError("save_adapter: the model has no LoRA layers; call apply_lora(model, cfg) first")
    merged = [n for n, m in modules.items() if m.merged]
    if merged:
        raise ValueError(f"save_adapter: adapters {merged[:3]} are merged into the base weights; unmerge() them first")
    reason = peft_unsupported(model)
    if reason is not None:
        raise ValueError(f"save_adapter: {reason}")
    family = model_family(model)
    tensors = {}
    for name, module in modules.items():
        prefix = PEFT_PREFIX + hf_module_name(name, family)
        tensors[f"{prefix}.lora_A.weight"] = module.lora_A.weight
        tensors[f"{prefix}.lora_B.weight"] = module.lora_B.weight
        if module.lora_magnitude_vector is not None:
            tensors[f"{prefix}.lora_magnitude_vector"] = module.lora_magnitude_vector
    linears = [
        n for n, m in model.named_modules()
        if isinstance(m, (torch.nn.Linear, QuantizedLinear)) and ".lora_" not in n and not n.endswith(".base")
    ]
    targets = peft_target_modules(list(modules), linears + list(modules), family)
    directory = Path(directory)
    with atomic_directory(directory) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        atomic_write_json(tmp / ADAPTER_CONFIG, peft_config_dict(cfg, targets, base_model_name_or_path))
    return directory


def read_adapter_config(directory: str | Path) -> LoraConfig:
    """Our ``LoraConfig`` from a PEFT ``adapter_config.json`` (target names are resolved from the weights)."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise InputError(f"{path}: not found; not a PEFT adapter folder")
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("peft_type") != "LORA":
        raise InputError(f"{path}: peft_type {config.get('peft_type')!r} is not supported; lmforge loads LORA adapters")
    unsupported = {k: config[k] for k in ("fan_in_fan_out", "lora_bias", "rank_pattern", "alpha_pattern", "modules_to_save") if config.get(k)}
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if unsupported:
        raise InputError(f"{path}: unsupported PEFT options {unsupported}; lmforge loads plain LoRA/DoRA adapters")
    init = config.get("init_lora_weights", True)
    return LoraConfig(
        r=config["r"],
        alpha=config["lora_alpha"],
        dropout=config.get("lora_dropout", 0.0),
        use_rslora=bool(config.get("use_rslora", False)),
        use_dora=bool(config.get("use_dora", False)),
        init="gaussian" if init == "gaussian" else "kaiming",
    )


def load_adapter(model: torch.nn.Module, directory: str | Path) -> list[str]:
    """Apply and fill the adapters of a PEFT folder on our ``model``; returns the wrapped module names.

    A model that already has LoRA layers (from ``apply_lora`` with the same config) is filled in place.
    """
    directory = Path(directory)
    cfg = read_adapter_config(directory)
    weights_path = directory / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise InputError(f"{weights_path}: not found (lmforge reads safetensors adapters)")
    state = {}
    for key, value in load_file(str(weights_path)).items():
        module, _, suffix = next(((key[: -len(s) - 1], ".", s) for s in _SUFFIXES if key.endswith("." + s)), (None, "", ""))
        if module is None or not module.startswith(PEFT_PREFIX):
            raise InputError(f"{weights_path}: unexpected tensor {key!r}; expected {PEFT_PREFIX}<module>.{{{', '.join(_SUFFIXES)}}}")
        try:
            ours = from_hf_name(module.removeprefix(PEFT_PREFIX) + ".weight", model_family(model)).removesuffix(".weight")
        except KeyError as exc:
            raise InputError(f"{weights_path}: {exc.args[0]}") from exc
        state[f"{ours}.{suffix}"] = value
    names = sorted({k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in state})
    existing = lora_modules(model)
    if not existing:
        cfg.target_modules = names
        apply_lora(model, cfg)
    elif set(existing) != set(names):
        raise InputError(f"{directory}: adapters for {names[:3]}... do not match the model's LoRA layers {sorted(existing)[:3]}...")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in state.items():
            if key not in params:
                raise InputError(f"{weights_path}: {key} has no parameter in the model (use_dora={cfg.use_dora} in {ADAPTER_CONFIG}?)")
            if params[key].shape != value.shape:
                raise InputError(f"{weights_path}: {key} has shape {tuple(value.shape)}, the model expects {tuple(params[key].shape)} (r={cfg.r})")
            params[key].copy_(value)
    return names
