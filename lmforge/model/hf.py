"""Hugging Face interop: ``config.json``, parameter names and weight files, for every family.

Each family's folder maps its own classes (``model/families/<name>/hf.py``, registered in
``lmforge.model.families``); this module dispatches to them by the config's family or the
``config.json``'s ``model_type`` and reads and writes the files every family shares (safetensors
weights, the tokenizer's files). ``stages/export.py`` and ``stages/import_hf.py`` put them on
disk. Import refuses a ``model_type`` no family reads, a key it does not know and a value it
would compute differently, rather than drop it. It never imports ``transformers``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from lmforge.core.io import InputError
from lmforge.model.config import ModelConfig
from lmforge.model.families import FAMILIES, build, family_of, hf_classes, hf_family
from lmforge.model.family import HFMapping
from lmforge.model.hf_parts import HFKey

SUPPORTED_ARCHITECTURES = hf_classes()  # model_type -> the one transformers class import reads, every family's
# model_type -> every config.json key lmforge knows for it (honoured, refused at other values, or inert)
HF_CONFIG_KEYS: dict[str, dict[str, HFKey]] = {
    t: keys for f in FAMILIES.values() if f.hf is not None for t, keys in f.hf.config_keys.items()}


def _mapping(cfg: ModelConfig) -> HFMapping:
    family = family_of(cfg)
    if family.hf is None:
        raise ValueError(f"model family {family.name!r} has no Hugging Face mapping")
    return family.hf


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32", **extra: Any) -> dict:
    """A ``config.json`` for the HF class that computes exactly ``cfg``'s model (its family's
    ``config_to_hf``); ``ValueError`` for a model no HF class expresses."""
    return _mapping(cfg).config_to_hf(cfg, dtype, **extra)


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights under HF names and layouts; a tied output matrix is left out, as ``save_pretrained`` does.
    A µP model's multipliers are folded into its weights first (``fold_mup``). The multi-token prediction
    modules (``model.mtp``) are left out: no class lmforge exports to runs them (``main_weights``)."""
    return _mapping(cfg).state_to_hf(fold_mup(main_weights(state), cfg), cfg)


def main_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the multi-token prediction modules' weights (``mtp.*``): the model generation runs."""
    return {k: v for k, v in state.items() if not k.startswith("mtp.")}


def fold_mup(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``state`` with µP's multipliers (``model.mup``) moved into weights, so a class without them
    computes the same logits: the readout's 1/m into the final norm's gain (and bias), which the
    head reads alone, tied or not; the attention scale's factor √(base_head_dim / head_dim) into
    the queries (their norm's gain where they are normalised, else ``wq``'s rows and bias), since
    RoPE is linear. A gain
    stored as an offset from 1 (Gemma's ``1 + w``) is folded as such. Standard models pass through."""
    if not cfg.mup.enabled:
        return state
    offset = 1.0 if cfg.family == "gemma" else 0.0
    out = dict(state)

    def scale_gain(key: str, factor: float) -> None:
        out[key] = ((state[key].double() + offset) * factor - offset).to(state[key].dtype)

    scale_gain("norm.weight", 1.0 / cfg.width_mult())
    if "norm.bias" in state:
        out["norm.bias"] = (state["norm.bias"].double() / cfg.width_mult()).to(state["norm.bias"].dtype)
    if cfg.mup.base_head_dim is not None:
        factor = (cfg.mup.base_head_dim / cfg.head_dim) ** 0.5
        for i in range(cfg.n_layers):
            gain = next((k for k in (f"layers.{i}.attn.q_norm.weight", f"layers.{i}.attn.q_proj_norm.weight") if k in state), None)
            if gain is not None:  # the queries are normalised after wq (Qwen3's per head, OLMo 2's whole)
                scale_gain(gain, factor)
                continue
            for key in (k for k in (f"layers.{i}.attn.wq.weight", f"layers.{i}.attn.wq.bias") if k in state):
                out[key] = (state[key].double() * factor).to(state[key].dtype)
    return out


def state_dict_from_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF weights under our names; a tied output matrix becomes the embedding matrix."""
    return _mapping(cfg).state_from_hf(state, cfg)


def model_config_from_hf(config: dict, where: str = "config.json") -> ModelConfig:
    """The config of a ``config.json``, by the family that reads its ``model_type``; an
    ``InputError`` naming ``where`` for a model_type no family reads, or a key or value its
    family refuses."""
    if not isinstance(config, dict):
        raise InputError(f"{where}: must be a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    family = hf_family(model_type)
    if family is None:
        archs = config.get("architectures") or []
        supported = ", ".join(f"{cls} (model_type {t!r})" for t, cls in SUPPORTED_ARCHITECTURES.items())
        raise InputError(f"{where}: model_type {model_type!r} (architectures {archs}) is not supported; lmforge imports {supported}")
    return family.hf.config_from_hf(config, where)


def to_hf_name(name: str, family: str = "llama") -> str:
    """A parameter's (or with ``.weight``, a module's) HF name: ``layers.3.attn.wq.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``; ``KeyError`` where the family's layouts are not one to one."""
    mapping = FAMILIES[family].hf
    if mapping is None or mapping.name_to_hf is None:
        raise KeyError(f"model family {family!r} has no one-to-one Hugging Face names")
    return mapping.name_to_hf(name)


def from_hf_name(name: str, family: str = "llama") -> str:
    """The inverse of ``to_hf_name``."""
    mapping = FAMILIES[family].hf
    if mapping is None or mapping.name_from_hf is None:
        raise KeyError(f"model family {family!r} has no one-to-one Hugging Face names")
    return mapping.name_from_hf(name)


HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"

def check_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> None:
    """Raise unless ``state`` (our names; tied output optional) has exactly the model's parameters and shapes."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong = [f"{k} {tuple(state[k].shape)} (config says {expected[k]})" for k in expected if k in state and tuple(state[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        problems = [f"missing {missing[:5]}" if missing else "", f"unexpected {unexpected[:5]}" if unexpected else "", f"wrong shapes {wrong[:5]}" if wrong else ""]
        raise InputError(f"{where}: weights do not match the model config: {'; '.join(p for p in problems if p)}")


# --------------------------------------------------------------------------- files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cast_weights(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """Floating-point tensors cast to ``dtype`` (a key of ``DTYPES``); ``auto`` keeps them as stored."""
    if dtype == "auto":
        return state
    return {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}



def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards that ``model.safetensors.index.json`` lists."""
    single, index = directory / HF_WEIGHTS, directory / HF_WEIGHTS_INDEX
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise InputError(f"{index}: not a valid safetensors index (needs a 'weight_map'): {exc}") from exc
        files = [directory / name for name in sorted(set(weight_map.values()))]
    elif any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise InputError(
            f"{directory}: only PyTorch pickle weights (*.bin) found; lmforge reads safetensors. Convert with "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir) (safetensors is the default)"
        )
    else:
        raise InputError(f"{directory}: no weights found (expected {HF_WEIGHTS} or {HF_WEIGHTS_INDEX} with its shards)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise InputError(f"{f}: shard listed in {HF_WEIGHTS_INDEX} is missing")
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises its own error types for truncated files
            raise InputError(f"{f}: cannot read weights: {exc}") from exc
    return state


END_OF_TURN = "<|im_end|>"  # ChatML's end of a turn (lmforge.data.chatml.IM_END; hf.py imports no data module)


def read_tokenizer_files(tokenizer_dir: Path) -> tuple[dict[str, int], dict] | None:
    """(every token -> its id, ``tokenizer_config.json``) of a folder; None where either file is missing or unreadable."""
    tok_file, cfg_file = tokenizer_dir / "tokenizer.json", tokenizer_dir / "tokenizer_config.json"
    if not (tok_file.is_file() and cfg_file.is_file()):
        return None
    try:
        tok = json.loads(tok_file.read_text(encoding="utf-8"))
        tok_cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    vocab = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    model_vocab = tok.get("model", {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab = {**model_vocab, **vocab}
    return vocab, tok_cfg


def _token(tok_cfg: dict, role: str) -> str | None:
    token = tok_cfg.get(f"{role}_token")
    if isinstance(token, dict):  # {"content": "<s>", "lstrip": false, ...}
        token = token.get("content")
    return token if isinstance(token, str) else None


def special_token_ids(vocab: dict[str, int], tok_cfg: dict) -> dict[str, int]:
    """``bos_token_id``/``eos_token_id``/``pad_token_id`` named by a ``tokenizer_config.json``, where known.

    ``config.json`` carries these ids, as transformers' own exports do.
    """
    ids = {}
    for role in ("bos", "eos", "pad"):
        token = _token(tok_cfg, role)
        if token in vocab:
            ids[f"{role}_token_id"] = vocab[token]
    return ids


def chat_tokenizer_config(vocab: dict[str, int], tok_cfg: dict) -> dict:
    """The ``tokenizer_config.json`` an export writes: a chat model's (one with a ``chat_template``)
    ``eos_token`` is ``<|im_end|>``, the end of an assistant turn, as in Qwen2's chat models, so
    that tools which stop at ``tokenizer.eos_token`` stop at the end of the turn; others as they are."""
    if tok_cfg.get("chat_template") and END_OF_TURN in vocab:
        return {**tok_cfg, "eos_token": END_OF_TURN}
    return tok_cfg


def generation_config_dict(vocab: dict[str, int], tok_cfg: dict, exported_cfg: dict) -> dict:
    """``generation_config.json``: the exported tokenizer's special-token ids, with ``eos_token_id``
    the list of every stop token (the exported eos first, then ``<|im_end|>`` and the original end of
    text) when the vocabulary has ``<|im_end|>``, so ``model.generate`` on an ``apply_chat_template``
    prompt stops at the end of the turn, and a plain prompt at the end of the text."""
    ids = special_token_ids(vocab, exported_cfg)
    stops = [vocab[t] for t in (_token(exported_cfg, "eos"), END_OF_TURN, _token(tok_cfg, "eos")) if t in vocab]
    stops = list(dict.fromkeys(stops))
    if len(stops) > 1:
        ids["eos_token_id"] = stops
    return ids
