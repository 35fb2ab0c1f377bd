"""OLMo 2's Hugging Face mapping: ``Olmo2ForCausalLM``.

Its attention rotates the two halves of each head (``rotate_half``), as the shared attention does,
and its QK-norm gains cover the whole q and k projections as lmforge's do, so weights map one
to one by name. Every ``config.json`` key of the class is classified in ``CONFIG_KEYS`` (honoured,
refused unless at a value lmforge computes, or inert); tests/model/families/test_olmo2.py holds
the table against transformers.
"""

from __future__ import annotations

import math
from typing import Any

from lmforge.core.io import InputError
from lmforge.model.families.olmo2.config import Olmo2Config
from lmforge.model.hf_parts import (
    COMMON_KEYS,
    HF_PROJECTION_KEYS,
    HONOURED,
    HFKey,
    WeightNames,
    check_hf_config_keys,
    hf_max_position_embeddings,
    refused,
    rope_fields,
    rope_scaling_keys,
)

CLASSES = {"olmo2": "Olmo2ForCausalLM"}  # model_type -> the one class whose weights we read

# ours -> HF, per layer
_LAYER_KEYS = {
    **HF_PROJECTION_KEYS,
    # its QK-norm gains over the whole projections, under the names of Qwen3's per-head ones
    "attn.q_proj_norm.weight": "self_attn.q_norm.weight",
    "attn.k_proj_norm.weight": "self_attn.k_norm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
}
NAMES = WeightNames("Olmo2ForCausalLM", _LAYER_KEYS)
to_hf_name, from_hf_name = NAMES.to_hf, NAMES.from_hf

state_dict_to_hf, state_dict_from_hf = NAMES.state_to_hf, NAMES.state_from_hf


def hf_config_dict(cfg: Olmo2Config, dtype: str = "float32", **extra: Any) -> dict:
    """A ``config.json`` for ``Olmo2ForCausalLM``, which computes every ``Olmo2Config`` (its refusals
    keep the config to what the class expresses). Token ids are unset unless ``extra`` gives them:
    the class's defaults (pad 1, eos 50279) belong to OLMo 2's own tokenizer."""
    return {
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,  # not a field of Olmo2Config, but its attention and RoPE read it
        "hidden_act": "silu",
        "max_position_embeddings": hf_max_position_embeddings(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        **rope_scaling_keys(cfg),
        "attention_bias": cfg.qkv_bias,
        "attention_dropout": cfg.attn_dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": dtype,
        **extra,
    }


_CACHE_READS = ("transformers' Olmo2 attention ignores it but its DynamicCache keeps only a sliding layer's window, "
                "so cached decoding would differ")
# every config.json key lmforge knows for Olmo2ForCausalLM; any other key is refused (lmforge does not know what it does)
CONFIG_KEYS: dict[str, dict[str, HFKey]] = {"olmo2": {
    **COMMON_KEYS,
    **dict.fromkeys("vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
                    "head_dim rms_norm_eps tie_word_embeddings max_position_embeddings".split(), HFKey(HONOURED, "the shape")),
    **dict.fromkeys("rope_parameters rope_scaling rope_theta original_max_position_embeddings".split(),
                    HFKey(HONOURED, "RoPE and its scaling (rope_fields)")),
    "hidden_act": HFKey(HONOURED, "lmforge's SwiGLU MLP uses silu", ("silu", "swish")),
    "attention_bias": HFKey(HONOURED, "biases on q/k/v and the output projection (qkv_bias, out_bias)"),
    "attention_dropout": HFKey(HONOURED, "dropout on the attention probabilities in training (attn_dropout)"),
    "partial_rotary_factor": refused("RoPE must cover the whole head", 1.0, None),
    "sliding_window": refused(f"Olmo2ForCausalLM attends to every position; {_CACHE_READS}", None),
    "layer_types": refused(f"Olmo2ForCausalLM has only full attention; {_CACHE_READS}",
                           lambda v, _: v is None or all(t == "full_attention" for t in v)),
}}


def model_config_from_hf(config: dict, where: str = "config.json") -> Olmo2Config:
    """The ``Olmo2Config`` of an OLMo 2 ``config.json``: plain RoPE or any scaling type transformers'
    ``ROPE_INIT_FUNCTIONS`` offer (Olmo2ForCausalLM reads them all); a key the table refuses at its
    value, or does not know, is an ``InputError``."""
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    if model_type not in CLASSES or (archs and archs != [CLASSES[model_type]]):
        raise InputError(f"{where}: model_type {model_type!r} (architectures {archs}) is not supported by family olmo2; "
                         "it imports Olmo2ForCausalLM (model_type 'olmo2')")
    check_hf_config_keys(config, CONFIG_KEYS[model_type], model_type, where)
    max_seq_len = config.get("max_position_embeddings", 2048)
    rope = rope_fields(config, max_seq_len, where)
    if rope.get("rope_scaling") == "dynamic":
        # transformers' dynamic NTK has no end past max_position_embeddings; lmforge's context ends factor times it
        max_seq_len = max(max_seq_len, math.floor(rope["rope_factor"] * max_seq_len))
    attention_bias = bool(config.get("attention_bias", False))
    try:
        n_heads = config["num_attention_heads"]
        return Olmo2Config(
            vocab_size=config["vocab_size"],
            d_model=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            ffn_hidden=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-5),
            **rope,
            max_seq_len=max_seq_len,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            out_bias=attention_bias,
            attn_dropout=float(config.get("attention_dropout") or 0.0),
            init_std=config.get("initializer_range", 0.02),
        )
    except KeyError as exc:
        raise InputError(f"{where}: missing required key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: {exc}") from exc
