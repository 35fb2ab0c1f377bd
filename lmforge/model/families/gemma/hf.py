"""The Gemma family's Hugging Face mapping: ``Gemma2ForCausalLM`` (model_type ``gemma2``) and
``Gemma3ForCausalLM`` (``gemma3_text``, the text model; a multimodal ``gemma3`` folder is
``Gemma3ForConditionalGeneration`` and not read).

Both rotate the two halves of each head and store each (1 + w) gain as w, as lmforge does, so
weights map one to one by name. Every ``config.json`` key of the two classes is classified in
``CONFIG_KEYS`` (honoured, refused unless at a value lmforge computes, or inert);
tests/model/families/test_gemma.py holds each against transformers. A config's class follows
from what it computes: QK-norm is Gemma 3's (its RoPE per layer type in ``rope_parameters``),
attention soft-capping Gemma 2's.
"""

from __future__ import annotations

import math
from typing import Any

from lmforge.core.io import InputError
from lmforge.model.families.gemma.config import GemmaConfig
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

CLASSES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
ACTIVATION = "gelu_pytorch_tanh"  # transformers' name of GeGLU's GELU (tanh approximation)
GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig's defaults

_LAYER_KEYS = {  # ours -> HF, per layer
    "attn_norm.weight": "input_layernorm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "mlp_norm.weight": "pre_feedforward_layernorm.weight",
    "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
    **HF_PROJECTION_KEYS,
    **HF_QK_NORM_KEYS,
}
NAMES = WeightNames("Gemma", _LAYER_KEYS)
to_hf_name, from_hf_name = NAMES.to_hf, NAMES.from_hf

state_dict_to_hf, state_dict_from_hf = NAMES.state_to_hf, NAMES.state_from_hf


# --------------------------------------------------------------------------- config.json, export


def hf_config_dict(cfg: GemmaConfig, dtype: str = "float32", **extra: Any) -> dict:
    """A ``config.json`` for the class that computes ``cfg``'s model: Gemma 3 with QK-norm, else Gemma 2.

    Raises ``ValueError`` where neither does: QK-norm with attention soft-capping (Gemma 3's
    attention does not cap), a local RoPE base without QK-norm (Gemma 2 has one RoPE).
    """
    sliding = cfg.sliding_layers()
    config = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_activation": ACTIVATION,
        "max_position_embeddings": hf_max_position_embeddings(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias,
        "attention_dropout": cfg.attn_dropout,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
        # transformers builds a window mask in every forward: a model without one gets a window that hides nothing
        "sliding_window": cfg.sliding_window or cfg.max_seq_len,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "final_logit_softcapping": cfg.final_softcap,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
    }
    global_rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **rope_scaling_keys(cfg).get("rope_parameters", {})}
    if not cfg.qk_norm:
        if cfg.rope_local_theta is not None:
            raise ValueError(f"rope_local_theta = {cfg.rope_local_theta} without qk_norm: Gemma 2 has one RoPE for every "
                             "layer and Gemma 3, which has a local base, has QK-norm; set qk_norm or remove rope_local_theta")
        # transformers < 5 reads rope_theta (and rope_scaling), transformers >= 5 rope_parameters
        return {**config, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                "attn_logit_softcapping": cfg.attn_softcap, "rope_theta": cfg.rope_theta,
                **rope_scaling_keys(cfg), "rope_parameters": global_rope, **extra}
    if cfg.attn_softcap is not None:
        raise ValueError(f"attn_softcap = {cfg.attn_softcap} with qk_norm: Gemma 3 (QK-norm) does not cap attention scores "
                         "and Gemma 2 (capped) has no QK-norm; remove one")
    local = global_rope if cfg.rope_local_theta is None else {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
    # transformers < 5 reads rope_theta, rope_local_base_freq and rope_scaling (the global layers' only)
    older = {"rope_theta": cfg.rope_theta, "rope_local_base_freq": local["rope_theta"]}
    if cfg.rope_local_theta is not None:
        older |= {k: v for k, v in rope_scaling_keys(cfg).items() if k == "rope_scaling"}
    return {**config, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attn_logit_softcapping": None,
            **older, "rope_parameters": {"sliding_attention": local, "full_attention": global_rope}, **extra}


# --------------------------------------------------------------------------- config.json, import

_SHAPE = dict.fromkeys(
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "rms_norm_eps tie_word_embeddings max_position_embeddings".split(), HFKey(HONOURED, "the shape"))
_ROPE = HFKey(HONOURED, "RoPE and its scaling (rope_fields)")
_GEMMA = {
    **COMMON_KEYS,
    **_SHAPE,
    "hidden_activation": HFKey(HONOURED, "GeGLU's GELU: lmforge computes the tanh approximation", (ACTIVATION,)),
    "hidden_act": HFKey(INERT, "Gemma 1's key, which older exports still carry; Gemma 2 and 3 read hidden_activation"),
    "attention_bias": HFKey(HONOURED, "biases on q, k, v and the output projection"),
    "attention_dropout": HFKey(HONOURED, "dropout on the attention probabilities in training (attn_dropout)"),
    "query_pre_attn_scalar": HFKey(HONOURED, "attention scores scaled by its -1/2 power"),
    "final_logit_softcapping": HFKey(HONOURED, "logits soft-capped, c·tanh(z / c) (final_softcap)"),
    "sliding_window": HFKey(HONOURED, "the sliding layers' window"),
    "layer_types": HFKey(HONOURED, "which layers slide"),
    "rope_parameters": _ROPE,
    "rope_scaling": _ROPE,
    "rope_theta": _ROPE,
    "partial_rotary_factor": refused("RoPE must cover the whole head", 1.0, None),
    "use_bidirectional_attention": refused("lmforge's decoder attends causally", False, None),
    "cache_implementation": HFKey(INERT, "generation's choice of cache class"),
}
# model_type -> every config.json key lmforge knows for it; any other key is refused (lmforge does not know what it does)
CONFIG_KEYS: dict[str, dict[str, HFKey]] = {
    "gemma2": {
        **_GEMMA,
        "attn_logit_softcapping": HFKey(HONOURED, "attention scores soft-capped, c·tanh(s / c) (attn_softcap)"),
        "original_max_position_embeddings": _ROPE,
        **dict.fromkeys(("rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"), NOT_READ),
    },
    "gemma3_text": {
        **_GEMMA,
        "attn_logit_softcapping": refused("transformers' Gemma 3 attention does not read it; a folder that sets it "
                                          "means scores lmforge cannot tell whether to cap", None),
        "rope_local_base_freq": HFKey(HONOURED, "the sliding layers' RoPE base (rope_local_theta)"),
        "sliding_window_pattern": HFKey(HONOURED, "every this-many-th layer is full, without layer_types"),
        "_sliding_window_pattern": HFKey(INERT, "what transformers 5 writes of sliding_window_pattern; never read back"),
        "original_max_position_embeddings": HFKey(INERT, "Gemma 3's per-layer RoPE reads its own, inside rope_parameters"),
    },
}


def model_config_from_hf(config: dict, where: str = "config.json") -> GemmaConfig:
    """The ``GemmaConfig`` of a Gemma 2 or Gemma 3 text ``config.json``, read as transformers reads it;
    an ``InputError`` naming ``where`` for anything lmforge would compute differently."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    supported = ", ".join(f"{cls} (model_type {t!r})" for t, cls in CLASSES.items())
    if model_type not in CLASSES:
        raise InputError(f"{where}: model_type {model_type!r} (architectures {archs}) is not supported; lmforge imports {supported}")
    if archs and archs != [CLASSES[model_type]]:
        raise InputError(f"{where}: architectures {archs} is not supported; lmforge imports {supported}")
    check_hf_config_keys(config, CONFIG_KEYS[model_type], model_type, where)
    try:
        n_layers, n_heads, head_dim = config["num_hidden_layers"], config["num_attention_heads"], config.get("head_dim", 256)
        max_seq_len = config.get("max_position_embeddings", 8192 if model_type == "gemma2" else 131_072)
        if model_type == "gemma2":
            rope, local_theta = rope_fields(config, max_seq_len, where), None
        else:
            rope, local_theta = _gemma3_rope(config, max_seq_len, where)
        if rope.get("rope_scaling") == "dynamic":
            # transformers' dynamic NTK has no end past max_position_embeddings; lmforge's context ends factor times it
            max_seq_len = max(max_seq_len, math.floor(rope["rope_factor"] * max_seq_len))
        window, layer_types = _sliding_window(config, model_type, n_layers, max_seq_len, where)
        scalar = config.get("query_pre_attn_scalar", 256)
        if not isinstance(scalar, int) or isinstance(scalar, bool) or scalar < 1:
            raise InputError(f"{where}: query_pre_attn_scalar must be a positive integer (transformers' type), got {scalar!r}")
        return GemmaConfig(
            vocab_size=config["vocab_size"],
            d_model=config["hidden_size"],
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads", 4),  # both classes default to 4
            head_dim=head_dim,
            ffn_hidden=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            **rope,
            rope_local_theta=local_theta if window is not None else None,
            max_seq_len=max_seq_len,
            sliding_window=window,
            layer_types=layer_types,
            tie_embeddings=bool(config.get("tie_word_embeddings", True)),
            qk_norm=model_type == "gemma3_text",
            qkv_bias=bool(config.get("attention_bias", False)),
            out_bias=bool(config.get("attention_bias", False)),
            attn_softcap=config.get("attn_logit_softcapping", 50.0) if model_type == "gemma2" else None,
            final_softcap=config.get("final_logit_softcapping", 30.0 if model_type == "gemma2" else None),
            query_pre_attn_scalar=None if scalar == head_dim else scalar,
            attn_dropout=float(config.get("attention_dropout") or 0.0),
            init_std=config.get("initializer_range", 0.02),
        )
    except InputError:
        raise
    except KeyError as exc:
        raise InputError(f"{where}: missing required key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: {exc}") from exc


def _gemma3_rope(config: dict, max_seq_len: int, where: str) -> tuple[dict, float | None]:
    """(the global layers' rope_* fields, the sliding layers' base or None where they rotate alike) of a
    Gemma 3 config, as ``Gemma3TextConfig.convert_rope_params_to_dict`` resolves them: ``rope_parameters``
    by layer type (transformers 5), a flat ``rope_scaling`` updating the global layers', and
    ``rope_theta`` / ``rope_local_base_freq`` (transformers 4) where those name no base."""
    nested = config.get("rope_parameters") or {}
    if not isinstance(nested, dict) or not set(nested) <= set(GEMMA3_THETA):
        raise InputError(f"{where}: Gemma 3's rope_parameters must map 'sliding_attention' and 'full_attention' to "
                         f"their RoPE, got {nested!r}")
    full = dict(nested.get("full_attention") or {"rope_type": "default"}) | (config.get("rope_scaling") or {})
    full.setdefault("rope_theta", config.get("rope_theta", GEMMA3_THETA["full_attention"]))
    local = dict(nested.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", config.get("rope_local_base_freq", GEMMA3_THETA["sliding_attention"]))
    # the top-level original_max_position_embeddings is not read: each layer type's dict holds its own
    rope = rope_fields({"rope_parameters": full}, max_seq_len, where)
    if local == full:
        return rope, None
    local_type = local.get("rope_type") or local.get("type") or "default"
    if local_type != "default" or set(local) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}:
        raise InputError(f"{where}: rope_parameters.sliding_attention = {local!r} is not supported; lmforge gives the "
                         "sliding layers plain RoPE (rope_type 'default' with its rope_theta) or the full layers' RoPE")
    if local.get("partial_rotary_factor") not in (None, 1.0):
        raise InputError(f"{where}: partial_rotary_factor {local['partial_rotary_factor']} is not supported; RoPE must "
                         "cover the whole head")
    return rope, float(local["rope_theta"])


def _sliding_window(config: dict, model_type: str, n_layers: int, max_seq_len: int,
                    where: str) -> tuple[int | None, list[str] | None]:
    """(the window, each layer's type or None for every layer) as transformers reads them: ``layer_types``,
    else Gemma 2's every other layer from the first, Gemma 3's all but every ``sliding_window_pattern``-th.
    A window past the context hides nothing: it becomes the context (the layers keep their type, and so
    their RoPE). (None, None): no layer slides."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        every = 2 if model_type == "gemma2" else config.get("sliding_window_pattern", 6)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InputError(f"{where}: sliding_window_pattern must be a positive integer, got {every!r}")
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list) or any(t not in ("sliding_attention", "full_attention") for t in layer_types):
        raise InputError(f"{where}: layer_types must list 'sliding_attention' or 'full_attention' per layer, got {layer_types!r}")
    if len(layer_types) != n_layers:
        raise InputError(f"{where}: layer_types has {len(layer_types)} entries; it needs one per layer, n_layers = {n_layers}")
    window = config.get("sliding_window", 4096)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise InputError(f"{where}: sliding_window = {window!r} is not supported: transformers' Gemma builds a window "
                         "mask in every forward, so it must be a positive integer")
    if "sliding_attention" not in layer_types:
        return None, None
    window = min(window, max_seq_len)
    return window, None if all(t == "sliding_attention" for t in layer_types) else list(layer_types)
