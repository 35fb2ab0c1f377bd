"""Phi-3's Hugging Face mapping: ``Phi3ForCausalLM``.

The arithmetic is the shared transformer's; the layout is not. Hugging Face joins each layer's
query, key and value projections into one ``qkv_proj`` (rows q | k | v) and the MLP's gate and up
projections into one ``gate_up_proj`` (rows gate | up): import splits them, export joins them
(so a parameter name maps one to one only outside those two, ``to_hf_name``). Both sides rotate
the two halves of each head. RoPE is plain or LongRoPE (``rope_scaling`` of type ``longrope``, or
the older ``su`` and ``yarn`` that transformers' Phi3Config reads as longrope), with the pretraining
context at the top level, ``original_max_position_embeddings`` (4096 when absent, the class default).
LongRoPE needs heads ``hidden_size / num_attention_heads`` wide: Phi3Config counts the factors by that
width while RoPE rotates heads of ``head_dim``, so export and import refuse LongRoPE where the two differ.
``sliding_window`` windows every layer, as transformers 5's Phi3Model masks. Every ``config.json``
key is classified in ``CONFIG_KEYS``; tests/model/families/test_phi3.py holds it against transformers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lmforge.core.io import InputError
from lmforge.model.families.phi3.config import Phi3Config
from lmforge.model.hf_parts import (
    COMMON_KEYS,
    HONOURED,
    NOT_READ,
    HFKey,
    WeightNames,
    check_hf_config_keys,
    hf_max_position_embeddings,
    refused,
    rope_fields,
    rope_scaling_keys,
)

CLASSES = {"phi3": "Phi3ForCausalLM"}  # model_type -> the one class whose weights we read
ORIGINAL_CONTEXT = 4096  # Phi3Config's original_max_position_embeddings when config.json has none
LONGROPE_SPELLINGS = ("longrope", "su", "yarn")  # rope types Phi3Config reads as longrope

# ours -> HF, per layer, where one maps to one
_LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_JOINED = {"self_attn.qkv_proj.weight": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"),
           "mlp.gate_up_proj.weight": ("mlp.w1.weight", "mlp.w3.weight")}
NAMES = WeightNames("Phi3ForCausalLM", _LAYER_KEYS)
from_hf_name = NAMES.from_hf  # ``KeyError`` for ``qkv_proj`` and ``gate_up_proj``, which are no one parameter of ours


def to_hf_name(name: str) -> str:
    """``layers.3.attn.wo.weight`` -> ``model.layers.3.self_attn.o_proj.weight``; a ``KeyError`` for the
    projections Hugging Face joins (q/k/v, gate/up), which have no parameter of their own there."""
    parts = name.split(".", 2)  # layers.<i>.<rest>
    joined = next((theirs for theirs, ours in _JOINED.items() if len(parts) == 3 and parts[2] in ours), None)
    if joined is not None:
        raise KeyError(f"lmforge parameter {name!r} is part of Phi3ForCausalLM's joined {joined.removesuffix('.weight')}, "
                       "which has no parameter of its own, so a PEFT adapter cannot name it (a LoRA run's final/ holds "
                       "the merged weights; adapt only wo and w2 for a PEFT adapter)")
    return NAMES.to_hf(name)


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: Phi3Config) -> dict[str, torch.Tensor]:
    """Our weights under HF names, q/k/v and gate/up joined by rows; a tied output matrix is left out."""
    out, joined = {}, set()
    for layer in sorted({k.split(".")[1] for k in state if k.startswith("layers.")}, key=int):
        for theirs, ours in _JOINED.items():
            names = [f"layers.{layer}.{k}" for k in ours]
            out[f"model.layers.{layer}.{theirs}"] = torch.cat([state[n] for n in names])
            joined.update(names)
    out |= {to_hf_name(k): v for k, v in state.items() if k not in joined}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def state_dict_from_hf(state: dict[str, torch.Tensor], cfg: Phi3Config) -> dict[str, torch.Tensor]:
    """HF weights under our names, ``qkv_proj`` split into q, k, v and ``gate_up_proj`` into gate (w1) and
    up (w3); a tied output matrix becomes the embedding matrix."""
    kv = cfg.n_kv_heads * cfg.head_dim
    sizes = {"self_attn.qkv_proj.weight": (cfg.n_heads * cfg.head_dim, kv, kv),
             "mlp.gate_up_proj.weight": (cfg.ffn_hidden, cfg.ffn_hidden)}
    out = {}
    for k, v in state.items():
        if k.endswith("rotary_emb.inv_freq"):  # a buffer some older checkpoints saved
            continue
        parts = k.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _JOINED:
            if v.shape[0] != sum(sizes[parts[3]]):
                raise KeyError(f"{k} has {v.shape[0]} rows; the config's q/k/v or gate/up widths sum to "
                               f"{sum(sizes[parts[3]])}")
            out |= {f"layers.{parts[2]}.{name}": piece for name, piece in
                    zip(_JOINED[parts[3]], v.split(sizes[parts[3]]))}
        else:
            out[from_hf_name(k)] = v
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def hf_config_dict(cfg: Phi3Config, dtype: str = "float32", **extra: Any) -> dict:
    """A ``config.json`` for ``Phi3ForCausalLM``, which computes every ``Phi3Config`` (its refusals keep
    the config to what the class expresses). Token ids are unset unless ``extra`` gives them: the class's
    defaults (bos 1, eos and pad 32000) belong to Phi-3's own tokenizer; a ``ValueError`` for LongRoPE on
    heads whose width is not d_model / n_heads, which no Phi3Config expresses (``_check_longrope_width``)."""
    longrope = cfg.rope_scaling == "longrope"
    if longrope:
        _check_longrope_width(cfg.head_dim, cfg.d_model, cfg.n_heads, "d_model / n_heads")
    return {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,  # not a field of Phi3Config, but its attention and RoPE read it
        "hidden_act": "silu",
        "max_position_embeddings": hf_max_position_embeddings(cfg),
        # transformers' Phi3 takes LongRoPE's original context from here, over the one in rope_scaling
        "original_max_position_embeddings": cfg.rope_original_max_seq_len if longrope else cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        **rope_scaling_keys(cfg),
        "sliding_window": cfg.sliding_window,
        "attention_dropout": cfg.attn_dropout,
        "resid_pdrop": cfg.resid_dropout,
        "embd_pdrop": cfg.embed_dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": dtype,
        **extra,
    }


def _check_longrope_width(head_dim: int, width: int, n_heads: int, per_head: str) -> None:
    """transformers' (and Microsoft's) Phi3Config counts LongRoPE's factors by ``hidden_size //
    num_attention_heads`` while its attention and RoPE rotate heads of ``head_dim``: with the two apart no
    config.json both loads and rotates every pair, so export and import refuse it (a ``ValueError``)."""
    if head_dim != width // n_heads:
        raise ValueError(f"rope_scaling 'longrope' with head_dim = {head_dim} other than {per_head} = {width // n_heads} is "
                         "not supported: transformers' Phi3Config wants one LongRoPE factor per pair of a "
                         f"{width // n_heads}-wide head and refuses the {head_dim // 2} its RoPE needs; use heads of "
                         f"{width // n_heads} or plain RoPE")


def _microsoft_code(value: Any, _config: dict) -> bool:
    """Whether an ``auto_map`` names only Microsoft's own Phi-3 code (``configuration_phi3.Phi3Config``,
    ``modeling_phi3.Phi3ForCausalLM``, as its hub folders do), of which transformers' Phi3 is the port."""
    if not isinstance(value, dict):
        return False
    ports = {"AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}
    return all(not k.startswith(("AutoConfig", "AutoModel")) or (k in ports and str(v).endswith(ports[k]))
               for k, v in value.items())


# every config.json key lmforge knows for Phi3ForCausalLM; any other key is refused (lmforge does not know what it does)
CONFIG_KEYS: dict[str, dict[str, HFKey]] = {"phi3": {
    **COMMON_KEYS,
    **dict.fromkeys("vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
                    "head_dim rms_norm_eps tie_word_embeddings max_position_embeddings".split(), HFKey(HONOURED, "the shape")),
    **dict.fromkeys("rope_parameters rope_scaling rope_theta original_max_position_embeddings".split(),
                    HFKey(HONOURED, "RoPE and LongRoPE (model_config_from_hf)")),
    "hidden_act": HFKey(HONOURED, "lmforge's SwiGLU MLP uses silu", ("silu", "swish")),
    "sliding_window": HFKey(HONOURED, "every layer's window (Phi3Model's sliding-window mask)"),
    "attention_dropout": HFKey(HONOURED, "dropout on the attention probabilities in training (attn_dropout)"),
    "resid_pdrop": HFKey(HONOURED, "dropout on each attention and MLP output in training (resid_dropout)"),
    "embd_pdrop": HFKey(HONOURED, "dropout on the embedding in training (embed_dropout); transformers' Phi3Model "
                                  "defines the key but applies no embedding dropout"),
    "partial_rotary_factor": refused("RoPE must cover the whole head", 1.0, None),
    "attention_bias": NOT_READ,  # written by Microsoft's configs (false); transformers' Phi3 has no biases to read it
    "auto_map": refused("custom modelling code computes this model, not the transformers class (Microsoft's own "
                        "configuration_phi3 / modeling_phi3, which transformers' Phi3 ports, and tokenizer entries "
                        "are fine)", _microsoft_code),
}}


def model_config_from_hf(config: dict, where: str = "config.json") -> Phi3Config:
    """The ``Phi3Config`` of a Phi-3 ``config.json``, read as transformers' Phi3Config reads it: plain RoPE
    or LongRoPE (``su`` and ``yarn`` are its old names), its original context from the top level (4096
    when absent), the window on every layer. A key the table refuses at its value, a key it does not
    know and any other RoPE type (transformers' Phi3Config refuses them too) is an ``InputError``."""
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    if model_type not in CLASSES or (archs and archs != [CLASSES[model_type]]):
        raise InputError(f"{where}: model_type {model_type!r} (architectures {archs}) is not supported by family phi3; "
                         "it imports Phi3ForCausalLM (model_type 'phi3')")
    check_hf_config_keys(config, CONFIG_KEYS[model_type], model_type, where)
    max_seq_len = config.get("max_position_embeddings", 4096)
    rope = _phi3_rope(config, max_seq_len, where)
    window = config.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise InputError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    if window is not None and window >= max_seq_len:  # a window as long as the context hides nothing
        window = None
    try:
        n_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
        if rope.get("rope_scaling") == "longrope":
            _check_longrope_width(head_dim, config["hidden_size"], n_heads, "hidden_size / num_attention_heads")
        return Phi3Config(
            vocab_size=config["vocab_size"],
            d_model=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            ffn_hidden=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-5),
            **rope,
            max_seq_len=max_seq_len,
            sliding_window=window,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            attn_dropout=float(config.get("attention_dropout") or 0.0),
            resid_dropout=float(config.get("resid_pdrop") or 0.0),
            embed_dropout=float(config.get("embd_pdrop") or 0.0),
            init_std=config.get("initializer_range", 0.02),
        )
    except KeyError as exc:
        raise InputError(f"{where}: missing required key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: {exc}") from exc


def _phi3_rope(config: dict, max_seq_len: int, where: str) -> dict:
    """The rope_* fields of a Phi-3 config.json: ``rope_fields`` of the config with LongRoPE's old
    names read as longrope and the top-level original context (or Phi3Config's default) in place."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InputError(f"{where}: rope_scaling/rope_parameters must be a mapping, got {rope!r}")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", *LONGROPE_SPELLINGS):
        raise InputError(f"{where}: RoPE scaling {rope_type!r} is not supported for model_type 'phi3': Phi3ForCausalLM "
                         "computes plain RoPE or longrope (su and yarn are its old names)")
    if rope_type == "default":
        return rope_fields(config, max_seq_len, where)
    original = config.get("original_max_position_embeddings") or ORIGINAL_CONTEXT
    longrope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "longrope"}
    fields = rope_fields({**config, "rope_scaling": longrope, "original_max_position_embeddings": original}, max_seq_len, where)
    if not math.isfinite(fields["rope_factor"]) or fields["rope_factor"] < 1:  # a context shorter than the original
        fields["rope_factor"] = 1.0  # attention factor 1, as transformers' for a factor <= 1
    return fields
