"""Hugging Face interop: parameter names, ``config.json`` and weight files of the Llama family.

Our ``Transformer`` is the architecture of ``LlamaForCausalLM``, ``MistralForCausalLM``
(every layer in a sliding window), ``Qwen2ForCausalLM`` (q/k/v biases; sliding windows on the
layers ``layer_types`` names) and ``Qwen3ForCausalLM`` (QK-norm). All of them apply RoPE to
the two halves of each head (``rotate_half``), as we do, so weights map one to one by name
with no permutation. This module converts names, configs and weight files;
``stages/export.py`` and ``stages/import_hf.py`` put them on disk. Every ``config.json`` key
of the four classes is classified in ``HF_CONFIG_KEYS`` (honoured, refused unless at a value
lmforge computes, or inert), and import refuses a key it does not know rather than drop it
(tests/model/test_hf_fields.py holds each class against transformers). It never imports
``transformers``: conversion needs only safetensors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file

from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.model.config import ROPE_SCALING_FIELDS, ModelConfig
from lmforge.model.transformer import Transformer

# model_type in config.json -> the one class whose weights we read
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"

# ours -> HF, per layer
_LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.wo.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
    "mlp.w1.bias": "mlp.gate_proj.bias",
    "mlp.w3.bias": "mlp.up_proj.bias",
    "mlp.w2.bias": "mlp.down_proj.bias",
}
_LAYER_KEYS_FROM_HF = {theirs: ours for ours, theirs in _LAYER_KEYS.items()}
_TOP_KEYS = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
_TOP_KEYS_FROM_HF = {theirs: ours for ours, theirs in _TOP_KEYS.items()}


# --------------------------------------------------------------------------- names


def to_hf_name(name: str) -> str:
    """``layers.3.attn.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if name in _TOP_KEYS:
        return _TOP_KEYS[name]
    parts = name.split(".", 2)  # layers.<i>.<rest>
    if len(parts) != 3 or parts[0] != "layers" or parts[2] not in _LAYER_KEYS:
        raise KeyError(f"no Hugging Face parameter for lmforge parameter {name!r}")
    return f"model.layers.{parts[1]}.{_LAYER_KEYS[parts[2]]}"


def from_hf_name(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``layers.3.attn.wq.weight``."""
    if name in _TOP_KEYS_FROM_HF:
        return _TOP_KEYS_FROM_HF[name]
    parts = name.split(".", 3)  # model.layers.<i>.<rest>
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in _LAYER_KEYS_FROM_HF:
        raise KeyError(f"no lmforge parameter for Hugging Face parameter {name!r}")
    return f"layers.{parts[2]}.{_LAYER_KEYS_FROM_HF[parts[3]]}"


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights under HF names; a tied output matrix is left out, as ``save_pretrained`` does."""
    out = {to_hf_name(k): v for k, v in state.items()}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def state_dict_from_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF weights under our names; a tied output matrix becomes the embedding matrix."""
    out = {}
    for k, v in state.items():
        if k.endswith("rotary_emb.inv_freq"):  # a buffer some older checkpoints saved
            continue
        out[from_hf_name(k)] = v
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def check_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> None:
    """Raise unless ``state`` (our names; tied output optional) has exactly the model's parameters and shapes."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong = [f"{k} {tuple(state[k].shape)} (config says {expected[k]})" for k in expected if k in state and tuple(state[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        problems = [f"missing {missing[:5]}" if missing else "", f"unexpected {unexpected[:5]}" if unexpected else "", f"wrong shapes {wrong[:5]}" if wrong else ""]
        raise InputError(f"{where}: weights do not match the model config: {'; '.join(p for p in problems if p)}")


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
                         f"({', '.join(SUPPORTED_ARCHITECTURES.values())})")
    if cfg.norm != "rmsnorm" or cfg.ffn != "swiglu":
        raise ValueError(
            f"the model uses {cfg.norm} and a {cfg.ffn} MLP; Hugging Face export supports RMSNorm + SwiGLU models "
            f"({', '.join(SUPPORTED_ARCHITECTURES.values())}); HF's GPT-2 class uses learned positions, not RoPE"
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
        "max_position_embeddings": _hf_max_position_embeddings(cfg),
        "rms_norm_eps": cfg.norm_eps,
        # transformers < 5 reads rope_theta (and rope_scaling), transformers >= 5 rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        **_rope_scaling_keys(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
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


# ModelConfig's rope_* field -> its key in rope_scaling / rope_parameters
HF_ROPE_KEYS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_seq_len": "original_max_position_embeddings",
    "rope_beta_fast": "beta_fast",
    "rope_beta_slow": "beta_slow",
    "rope_mscale": "mscale",
    "rope_mscale_all_dim": "mscale_all_dim",
    "rope_attention_factor": "attention_factor",
    "rope_truncate": "truncate",
    "rope_short_factor": "short_factor",
    "rope_long_factor": "long_factor",
}
HF_ROPE_TYPES = {"default": "none", **{t: t for t in ROPE_SCALING_FIELDS if t != "none"}}  # rope_type -> rope_scaling


def _hf_max_position_embeddings(cfg: ModelConfig) -> int:
    """``max_position_embeddings``: the context, except for dynamic NTK, whose transformers
    implementation grows the base past ``max_position_embeddings``: there it is the original context."""
    return cfg.rope_original_max_seq_len if cfg.rope_scaling == "dynamic" else cfg.max_seq_len


def _rope_scaling_keys(cfg: ModelConfig) -> dict:
    """``rope_scaling`` (transformers < 5, and Meta's own configs) and ``rope_parameters``
    (transformers >= 5) for a model with RoPE scaling: the keys its type reads; nothing for plain RoPE."""
    if cfg.rope_scaling == "none":
        return {}
    scaling = {"rope_type": cfg.rope_scaling}
    for name in sorted(ROPE_SCALING_FIELDS[cfg.rope_scaling]):
        if getattr(cfg, name) is not None and not (cfg.rope_scaling == "dynamic" and name == "rope_original_max_seq_len"):
            scaling[HF_ROPE_KEYS[name]] = getattr(cfg, name)
    return {"rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta}}


def _rope_fields(config: dict, max_position_embeddings: int, where: str) -> dict:
    """The ModelConfig rope_* fields of a config.json, resolved as transformers' ``ROPE_INIT_FUNCTIONS``
    read them; unknown RoPE types and partial rotary are an ``InputError``.

    transformers >= 5 writes ``rope_parameters``; older versions and Meta's configs write
    ``rope_scaling`` beside a top-level ``rope_theta``. Where both are present
    ``rope_scaling`` wins, as in transformers 5's ``convert_rope_params_to_dict``. The original
    context of llama3, yarn and longrope is a top-level ``original_max_position_embeddings`` (Phi-3
    writes it there), else the one in ``rope_scaling``, else ``max_position_embeddings``; dynamic
    NTK's is ``max_position_embeddings``. yarn's and longrope's missing ``factor`` is the ratio of
    ``max_position_embeddings`` to the original context; yarn's ``beta_fast``/``beta_slow`` default
    to 32 and 1, and its ``mscale`` pair counts only when both are set, as in transformers.
    """
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InputError(f"{where}: rope_scaling/rope_parameters must be a mapping, got {rope!r}")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = rope.get("rope_theta") or config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    if rope.get("partial_rotary_factor") not in (None, 1.0):
        raise InputError(f"{where}: partial_rotary_factor {rope['partial_rotary_factor']} is not supported; RoPE must cover the whole head")
    if rope_type not in HF_ROPE_TYPES:
        raise InputError(
            f"{where}: RoPE scaling {rope_type!r} is not supported; lmforge implements rope_type "
            f"{', '.join(map(repr, HF_ROPE_TYPES))} (plain RoPE, position interpolation, dynamic NTK, YaRN, LongRoPE, Llama 3.1)"
        )
    if rope_type == "default":
        return {"rope_theta": float(theta)}
    reads = ROPE_SCALING_FIELDS[rope_type]
    ignored = sorted(set(rope) - {HF_ROPE_KEYS[k] for k in reads} - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if ignored:
        log.warning("%s: RoPE scaling %r does not read %s (transformers ignores them too)", where, rope_type, ", ".join(ignored))
    required = {"linear": ["factor"], "dynamic": ["factor"], "yarn": [], "longrope": ["short_factor", "long_factor"],
                "llama3": ["factor", "low_freq_factor", "high_freq_factor"]}[rope_type]
    missing = [k for k in required if rope.get(k) is None]
    if missing:
        raise InputError(f"{where}: RoPE scaling {rope_type!r} needs {', '.join(missing)}")
    if rope_type == "dynamic":
        original = max_position_embeddings
    else:
        original = config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or max_position_embeddings
    try:
        fields = {
            "rope_theta": float(theta),
            "rope_scaling": rope_type,
            "rope_factor": float(rope["factor"] if rope.get("factor") is not None else max_position_embeddings / original),
            "rope_original_max_seq_len": int(original),
        }
        if rope_type == "llama3":
            fields |= {"rope_low_freq_factor": float(rope["low_freq_factor"]), "rope_high_freq_factor": float(rope["high_freq_factor"])}
        if rope_type == "yarn":
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            fields |= {
                "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
                "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
                "rope_truncate": bool(rope.get("truncate", True)),
                "rope_mscale": float(mscale) if mscale and mscale_all_dim else None,
                "rope_mscale_all_dim": float(mscale_all_dim) if mscale and mscale_all_dim else None,
            }
        if rope_type == "longrope":
            fields |= {"rope_short_factor": [float(x) for x in rope["short_factor"]],
                       "rope_long_factor": [float(x) for x in rope["long_factor"]]}
        if rope_type in ("yarn", "longrope") and rope.get("attention_factor") is not None:
            fields["rope_attention_factor"] = float(rope["attention_factor"])
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: RoPE scaling {rope_type!r} has a non-numeric parameter in {rope}: {exc}") from exc
    if "rope_original_max_seq_len" not in reads:
        del fields["rope_original_max_seq_len"]
    return fields


# --------------------------------------------------------------------------- config.json keys

HONOURED, REFUSED, INERT = "honoured", "refused", "inert"


class HFKey(NamedTuple):
    """How import treats one ``config.json`` key: ``honoured`` (read into ModelConfig), ``refused``
    unless it is one of ``supported`` (lmforge computes only those; any other value is an InputError),
    or ``inert`` (no effect on the logits of the class transformers builds for this model_type)."""

    kind: str
    why: str
    # the values lmforge computes, or a test of (value, config.json); () = any value (honoured keys: any their reader takes)
    supported: tuple | Callable[[Any, dict], bool] = ()


def _refused(why: str, *supported: Any) -> HFKey:
    """A key lmforge computes only at ``supported``: the values, or one test of (value, config.json)."""
    return HFKey(REFUSED, why, supported[0] if len(supported) == 1 and callable(supported[0]) else supported)


_INERT_BASE = dict.fromkeys(  # PretrainedConfig's own keys (transformers 4 and 5): metadata, outputs, generation, heads
    """_name_or_path transformers_version dtype torch_dtype use_bfloat16 _attn_implementation_autoset attn_implementation
    output_attentions output_hidden_states return_dict torchscript tf_legacy_loss chunk_size_feed_forward
    is_encoder_decoder is_decoder add_cross_attention cross_attention_hidden_size tie_encoder_decoder
    id2label label2id num_labels problem_type finetuning_task task_specific_params tokenizer_class prefix
    bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id use_cache
    max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty temperature top_k
    top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size
    bad_words_ids num_return_sequences output_scores return_dict_in_generate forced_bos_token_id forced_eos_token_id
    remove_invalid_values exponential_decay_length_penalty suppress_tokens begin_suppress_tokens""".split(),
    HFKey(INERT, "metadata, outputs, generation defaults or token ids (a pad id only zeroes its embedding row at init)"),
)
_LLAMA_LINE = {
    **_INERT_BASE,
    "model_type": HFKey(HONOURED, "selects the class (SUPPORTED_ARCHITECTURES)"),
    "architectures": HFKey(HONOURED, "must name the class of model_type"),
    **dict.fromkeys("vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
                    "head_dim rms_norm_eps tie_word_embeddings max_position_embeddings".split(), HFKey(HONOURED, "the shape")),
    **dict.fromkeys("rope_parameters rope_scaling rope_theta original_max_position_embeddings".split(),
                    HFKey(HONOURED, "RoPE and its scaling (_rope_fields)")),
    "hidden_act": HFKey(HONOURED, "lmforge's SwiGLU MLP uses silu", ("silu", "swish")),
    "initializer_range": HFKey(INERT, "the init std of training from scratch (kept as init_std)"),
    "pretraining_tp": HFKey(INERT, "transformers >= 4.45 ignores it; older ones split the same matmuls into slices"),
    "is_llama_config": HFKey(INERT, "nanotron's marker (SmolLM)"),
    "attention_dropout": _refused("lmforge has no attention dropout; set it to 0.0 to fine-tune without it", 0.0, None),
    "partial_rotary_factor": _refused("RoPE must cover the whole head", 1.0, None),
    "rope_interleaved": _refused("lmforge, like these transformers classes, rotates the two halves of each head", False, None),
    "quantization_config": _refused("quantized weights; use the unquantized (bf16/fp16/fp32) ones", None, {}),
    "pruned_heads": _refused("pruned attention heads change the projections' shapes", None, {}),
    "auto_map": _refused("custom modelling code computes this model, not the transformers class (tokenizer entries are fine)",
                         lambda v, _: isinstance(v, dict) and not any(k.startswith(("AutoConfig", "AutoModel")) for k in v)),
}
_NOT_READ = HFKey(INERT, "this model_type's transformers class does not read it")
_BIASES = {"attention_bias": HFKey(HONOURED, "biases on q/k/v and the output projection"),
           "mlp_bias": HFKey(HONOURED, "biases on the MLP's three projections")}
_QWEN_WINDOW = dict.fromkeys("use_sliding_window sliding_window max_window_layers layer_types".split(),
                             HFKey(HONOURED, "the sliding window and its layers (_sliding_window)"))
_NO_WINDOW = dict.fromkeys(_QWEN_WINDOW, _NOT_READ)
_CACHE_READS = "transformers' attention ignores it but its DynamicCache keeps only a sliding layer's window, so cached decoding would differ"
_LLAMA_NO_WINDOW = {
    **_NO_WINDOW,
    "sliding_window": _refused(f"LlamaForCausalLM attends to every position; {_CACHE_READS} (a windowed model is model_type mistral)", None),
    "layer_types": _refused(f"LlamaForCausalLM has only full attention; {_CACHE_READS}",
                            lambda v, _: v is None or all(t == "full_attention" for t in v)),
}
_MISTRAL_WINDOW = {  # Mistral's window, when set, is on every layer
    **_NO_WINDOW,
    "sliding_window": HFKey(HONOURED, "every layer's window"),
    "layer_types": _refused(f"Mistral windows every layer or none; {_CACHE_READS}", lambda v, c: v is None or all(
        t == ("full_attention" if c.get("sliding_window") is None else "sliding_attention") for t in v)),
}
# model_type -> every config.json key lmforge knows for it; any other key is refused (lmforge does not know what it does)
HF_CONFIG_KEYS: dict[str, dict[str, HFKey]] = {
    "llama": {**_LLAMA_LINE, **_BIASES, **_LLAMA_NO_WINDOW},
    "mistral": {**_LLAMA_LINE, **dict.fromkeys(_BIASES, _NOT_READ), **_MISTRAL_WINDOW},
    "qwen2": {**_LLAMA_LINE, **dict.fromkeys(_BIASES, _NOT_READ), **_QWEN_WINDOW},
    "qwen3": {**_LLAMA_LINE, "attention_bias": _BIASES["attention_bias"], "mlp_bias": _NOT_READ, **_QWEN_WINDOW},
}


def supports(spec: HFKey, value: Any, config: dict) -> bool:
    """Whether lmforge computes ``value`` of a key classified ``spec`` in ``config``."""
    if callable(spec.supported):
        return spec.supported(value, config)
    return not spec.supported or value in spec.supported


def check_hf_config_keys(config: dict, model_type: str, where: str) -> None:
    """Refuse a key set to a value lmforge does not compute, and a key lmforge does not know, rather than drop it."""
    known = HF_CONFIG_KEYS[model_type]
    for key, value in config.items():
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        spec = known.get(key)
        if spec is None:
            raise InputError(
                f"{where}: key {key!r} = {shown} is not one lmforge knows for model_type {model_type!r}: lmforge does not "
                "know what it does to the arithmetic (a newer transformers may read it), so it refuses rather than drop it"
            )
        if not supports(spec, value, config):
            listed = not callable(spec.supported)
            supported = f"; lmforge supports {' or '.join(json.dumps(s) for s in spec.supported)}" if listed else ""
            raise InputError(f"{where}: {key} = {shown} is not supported ({spec.why}){supported}")


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
    supported = ", ".join(f"{cls} (model_type {t!r})" for t, cls in SUPPORTED_ARCHITECTURES.items())
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise InputError(f"{where}: model_type {model_type!r} (architectures {archs}) is not supported; lmforge imports {supported}")
    if archs and archs != [SUPPORTED_ARCHITECTURES[model_type]]:
        raise InputError(f"{where}: architectures {archs} is not supported; lmforge imports {supported}")
    check_hf_config_keys(config, model_type, where)
    n_layers, n_heads = config["num_hidden_layers"], config["num_attention_heads"]
    max_seq_len = config.get("max_position_embeddings", 2048)
    rope = _rope_fields(config, max_seq_len, where)
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
