"""The Llama family's Hugging Face mapping: ``LlamaForCausalLM``, ``MistralForCausalLM`` (every
layer in a sliding window), ``Qwen2ForCausalLM`` (q/k/v biases; sliding windows on the layers
``layer_types`` names) and ``Qwen3ForCausalLM`` (QK-norm).

All of them apply RoPE to the two halves of each head (``rotate_half``), as the shared
attention does, so weights map one to one by name with no permutation. Every ``config.json``
key of the four classes is classified in ``CONFIG_KEYS`` (honoured, refused unless at a value
lmforge computes, or inert); tests/model/test_hf_fields.py holds each class against transformers.
"""

from __future__ import annotations

import math
from typing import Any

from lmforge.core.io import InputError
from lmforge.model.config import ModelConfig
from lmforge.model.hf_parts import (
    COMMON_KEYS,
    HF_PROJECTION_KEYS,
    HF_QK_NORM_KEYS,
    HONOURED,
    INERT,
    NOT_READ,
    HFKey,
    WeightNames,
    check_hf_config_keys,
    hf_max_position_embeddings,
    refused,
    rope_fields,
    rope_scaling_keys,
)

# model_type in config.json -> the one class whose weights we read
CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# ours -> HF, per layer
_LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    **HF_PROJECTION_KEYS,
    **HF_QK_NORM_KEYS,
}
NAMES = WeightNames("Llama", _LAYER_KEYS)
to_hf_name, from_hf_name = NAMES.to_hf, NAMES.from_hf

state_dict_to_hf, state_dict_from_hf = NAMES.state_to_hf, NAMES.state_from_hf



# --------------------------------------------------------------------------- config.json


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32", **extra: Any) -> dict:
    """A ``config.json`` for the HF class that computes exactly our model.

    Llama (optionally with biases on all four attention projections and/or the MLP),
    Qwen2 when only q/k/v have biases, Qwen3 when the model has QK-norm (both with the window's
    ``layer_types``), Mistral when every layer of a bias-free model slides. Raises ``ValueError``
    for models no HF class expresses (ALiBi, LayerNorm, GELU MLP, other bias or window mixes).
    """
    if cfg.positions != "rope":
        raise ValueError(f"the model uses positions {cfg.positions!r}; Hugging Face export supports RoPE models "
                         f"({', '.join(CLASSES.values())})")
    if cfg.norm != "rmsnorm" or cfg.ffn != "swiglu":
        raise ValueError(
            f"the model uses {cfg.norm} and a {cfg.ffn} MLP; Hugging Face export supports RMSNorm + SwiGLU models "
            f"({', '.join(CLASSES.values())}); HF's GPT-2 class uses learned positions, not RoPE"
        )
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hf_max_position_embeddings(cfg),
        "rms_norm_eps": cfg.norm_eps,
        # transformers < 5 reads rope_theta (and rope_scaling), transformers >= 5 rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        **rope_scaling_keys(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": cfg.attn_dropout,
        "torch_dtype": dtype,
        **extra,
    }
    all_attn_biases = cfg.qkv_bias == cfg.out_bias
    sliding = cfg.sliding_layers()
    qwen_window = _qwen_sliding_window_keys(cfg)
    if cfg.qkv_bias and not cfg.out_bias and not cfg.mlp_bias and not cfg.qk_norm:
        return {**common, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **qwen_window}
    if cfg.qk_norm and all_attn_biases and not cfg.mlp_bias:
        return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": cfg.qkv_bias,
                **qwen_window}
    if any(sliding) and not all(sliding):
        raise ValueError(
            f"layer_types {cfg.layer_types} mixes sliding and full layers; the Hugging Face class for this model "
            "(Mistral: no biases, no QK-norm) windows every layer (Qwen2 and Qwen3 express a per-layer pattern)"
        )
    if all(sliding) and not cfg.qkv_bias and not cfg.out_bias and not cfg.mlp_bias and not cfg.qk_norm:
        return {**common, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": cfg.sliding_window}
    if any(sliding):
        raise ValueError(
            f"no Hugging Face architecture has a sliding window with qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}, "
            f"mlp_bias={cfg.mlp_bias} (Mistral: no biases; Qwen2: q/k/v biases only; Qwen3: QK-norm)"
        )
    if not cfg.qk_norm and all_attn_biases:
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}
    raise ValueError(
        f"no Hugging Face architecture has this combination: qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}, "
        f"mlp_bias={cfg.mlp_bias}, qk_norm={cfg.qk_norm} (Llama: equal attention biases, any MLP bias; "
        "Qwen2: q/k/v biases only; Qwen3: QK-norm, equal attention biases, no MLP bias)"
    )


def _qwen_sliding_window_keys(cfg: ModelConfig) -> dict:
    """Qwen2/Qwen3's window keys: ``layer_types`` (what transformers >= 4.53 reads) and, where the
    sliding layers are the last ones, the ``max_window_layers`` older versions read."""
    sliding = cfg.sliding_layers()
    if not any(sliding):
        return {"use_sliding_window": False, "sliding_window": None}
    first = sliding.index(True)
    keys = {"use_sliding_window": True, "sliding_window": cfg.sliding_window,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
    if all(sliding[first:]):
        keys["max_window_layers"] = first
    return keys


_LLAMA_LINE = {
    **COMMON_KEYS,
    **dict.fromkeys("vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
                    "head_dim rms_norm_eps tie_word_embeddings max_position_embeddings".split(), HFKey(HONOURED, "the shape")),
    **dict.fromkeys("rope_parameters rope_scaling rope_theta original_max_position_embeddings".split(),
                    HFKey(HONOURED, "RoPE and its scaling (rope_fields)")),
    "hidden_act": HFKey(HONOURED, "lmforge's SwiGLU MLP uses silu", ("silu", "swish")),
    "pretraining_tp": HFKey(INERT, "transformers >= 4.45 ignores it; older ones split the same matmuls into slices"),
    "is_llama_config": HFKey(INERT, "nanotron's marker (SmolLM)"),
    "attention_dropout": HFKey(HONOURED, "dropout on the attention probabilities in training (attn_dropout)"),
    "partial_rotary_factor": refused("RoPE must cover the whole head", 1.0, None),
    "rope_interleaved": refused("lmforge, like these transformers classes, rotates the two halves of each head", False, None),
}
_BIASES = {"attention_bias": HFKey(HONOURED, "biases on q/k/v and the output projection"),
           "mlp_bias": HFKey(HONOURED, "biases on the MLP's three projections")}
_QWEN_WINDOW = dict.fromkeys("use_sliding_window sliding_window max_window_layers layer_types".split(),
                             HFKey(HONOURED, "the sliding window and its layers (_sliding_window)"))
_NO_WINDOW = dict.fromkeys(_QWEN_WINDOW, NOT_READ)
_CACHE_READS = "transformers' attention ignores it but its DynamicCache keeps only a sliding layer's window, so cached decoding would differ"
_LLAMA_NO_WINDOW = {
    **_NO_WINDOW,
    "sliding_window": refused(f"LlamaForCausalLM attends to every position; {_CACHE_READS} (a windowed model is model_type mistral)", None),
    "layer_types": refused(f"LlamaForCausalLM has only full attention; {_CACHE_READS}",
                            lambda v, _: v is None or all(t == "full_attention" for t in v)),
}
_MISTRAL_WINDOW = {  # Mistral's window, when set, is on every layer
    **_NO_WINDOW,
    "sliding_window": HFKey(HONOURED, "every layer's window"),
    "layer_types": refused(f"Mistral windows every layer or none; {_CACHE_READS}", lambda v, c: v is None or all(
        t == ("full_attention" if c.get("sliding_window") is None else "sliding_attention") for t in v)),
}
# model_type -> every config.json key lmforge knows for it; any other key is refused (lmforge does not know what it does)
CONFIG_KEYS: dict[str, dict[str, HFKey]] = {
    "llama": {**_LLAMA_LINE, **_BIASES, **_LLAMA_NO_WINDOW},
    "mistral": {**_LLAMA_LINE, **dict.fromkeys(_BIASES, NOT_READ), **_MISTRAL_WINDOW},
    "qwen2": {**_LLAMA_LINE, **dict.fromkeys(_BIASES, NOT_READ), **_QWEN_WINDOW},
    "qwen3": {**_LLAMA_LINE, "attention_bias": _BIASES["attention_bias"], "mlp_bias": NOT_READ, **_QWEN_WINDOW},
}


def model_config_from_hf(config: dict, where: str = "config.json") -> ModelConfig:
    """The ``ModelConfig`` of a Llama, Mistral, Qwen2 or Qwen3 ``config.json``.

    Plain RoPE and its scaling types (``linear``, ``dynamic``, ``yarn``, ``longrope``, Llama 3.1's
    ``llama3``) are read; anything else our model would compute differently is an ``InputError``
    (other RoPE types, a key ``HF_CONFIG_KEYS`` refuses at its value, a key it does not know). A sliding
    window is read as transformers reads it: Mistral's on every layer, Qwen2/Qwen3's with
    ``use_sliding_window`` on the layers ``layer_types`` names (or those from ``max_window_layers`` on).
    """
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    supported = ", ".join(f"{cls} (model_type {t!r})" for t, cls in CLASSES.items())
    if model_type not in CLASSES:
        raise InputError(f"{where}: model_type {model_type!r} (architectures {archs}) is not supported; lmforge imports {supported}")
    if archs and archs != [CLASSES[model_type]]:
        raise InputError(f"{where}: architectures {archs} is not supported; lmforge imports {supported}")
    check_hf_config_keys(config, CONFIG_KEYS[model_type], model_type, where)
    n_layers, n_heads = config["num_hidden_layers"], config["num_attention_heads"]
    max_seq_len = config.get("max_position_embeddings", 2048)
    rope = rope_fields(config, max_seq_len, where)
    if rope.get("rope_scaling") == "dynamic":
        # transformers' dynamic NTK has no end past max_position_embeddings; lmforge's context ends factor times it
        max_seq_len = max(max_seq_len, math.floor(rope["rope_factor"] * max_seq_len))
    window, layer_types = _sliding_window(config, model_type, n_layers, where)
    if window is not None and window >= max_seq_len:  # a window as long as the context hides nothing
        window = layer_types = None

    attention_bias = bool(config.get("attention_bias", False))
    qkv_bias = {"qwen2": True, "mistral": False}.get(model_type, attention_bias)
    out_bias = False if model_type in ("qwen2", "mistral") else attention_bias
    try:
        return ModelConfig(
            vocab_size=config["vocab_size"],
            d_model=config["hidden_size"],
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            ffn="swiglu",
            ffn_hidden=config["intermediate_size"],
            norm="rmsnorm",
            norm_eps=config.get("rms_norm_eps", 1e-6),
            **rope,
            max_seq_len=max_seq_len,
            sliding_window=window,
            layer_types=layer_types,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) if model_type == "llama" else False,
            attn_dropout=float(config.get("attention_dropout") or 0.0),
            init_std=config.get("initializer_range", 0.02),
        )
    except KeyError as exc:
        raise InputError(f"{where}: missing required key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: {exc}") from exc


def _sliding_window(config: dict, model_type: str, n_layers: int, where: str) -> tuple[int | None, list[str] | None]:
    """(the attention window, each layer's type or None for every layer) as transformers reads them:
    Mistral windows every layer; Qwen2/Qwen3 only with ``use_sliding_window``, the layers of
    ``layer_types``, else those from ``max_window_layers`` on. (None, None): no layer has a window."""
    window = config.get("sliding_window")
    if window is None or model_type == "llama":
        return None, None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise InputError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    if model_type == "mistral":
        return window, None
    if not config.get("use_sliding_window", False):  # Qwen2/Qwen3 ignore the window unless this is set
        return None, None
    layer_types = config.get("layer_types")
    if layer_types is None:
        start = config.get("max_window_layers", 28)  # transformers' default
        layer_types = ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list) or any(t not in ("sliding_attention", "full_attention") for t in layer_types):
        raise InputError(f"{where}: layer_types must list 'sliding_attention' or 'full_attention' per layer, got {layer_types!r}")
    if len(layer_types) != n_layers:
        raise InputError(f"{where}: layer_types has {len(layer_types)} entries; it needs one per layer, n_layers = {n_layers}")
    if "sliding_attention" not in layer_types:
        return None, None
    return window, None if all(t == "sliding_attention" for t in layer_types) else list(layer_types)


