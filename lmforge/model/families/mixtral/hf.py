"""The mixture-of-experts family's Hugging Face mapping: ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``.

Both rotate the two halves of each head as the shared attention does, and their experts' matrices
are our stacked ones' slices, so weights map by name with a stack (import) or an unbind (export).
Export writes the per-expert layout of the Hub's checkpoints (``block_sparse_moe.experts.<e>.w1.weight``
for Mixtral, ``mlp.experts.<e>.gate_proj.weight`` for Qwen3-MoE), which transformers 4 and 5 (it
converts on load and back on save), vLLM and llama.cpp read; import reads it and transformers 5's
own fused layout (``mlp.experts.gate_up_proj``, ``down_proj``). A folder whose expert tensors are
missing or of the wrong shape is one line naming it. Every ``config.json`` key of the two classes is
classified in ``CONFIG_KEYS``; tests/model/families/test_mixtral.py holds the table against transformers.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from lmforge.core.io import InputError
from lmforge.model.families.mixtral.config import MixtralConfig
from lmforge.model.hf_parts import (
    COMMON_KEYS,
    HF_PROJECTION_KEYS,
    HF_QK_NORM_KEYS,
    HONOURED,
    INERT,
    NOT_READ,
    HFExperts,
    HFKey,
    WeightNames,
    check_hf_config_keys,
    hf_max_position_embeddings,
    refused,
    rope_fields,
    rope_scaling_keys,
)
from lmforge.model.moe import MoEConfig

CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# ours -> HF, per layer, where one to one (attention, norms, a dense layer's MLP)
_LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    **HF_PROJECTION_KEYS,
    **HF_QK_NORM_KEYS,
}
NAMES = WeightNames("Mixtral/Qwen3-MoE", _LAYER_KEYS)
# each class's routed FFN: its module, and our expert matrices' names in it (transformers 5 fuses Mixtral's under mlp)
_EXPERTS = {"mixtral": HFExperts("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"}, also_read=("mlp",)),
            "qwen3_moe": HFExperts("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})}
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")


def to_hf_name(name: str) -> str:
    """One parameter's HF name (PEFT adapters): attention, norms and a dense MLP map one to one; the
    router's name differs by class and the stacked experts have no single HF tensor (``KeyError``)."""
    if ".mlp.router." in name or ".mlp.experts." in name or ".mlp.shared." in name:
        raise KeyError(f"lmforge parameter {name!r} (the routed FFN) has no one Hugging Face name: Mixtral and "
                       "Qwen3-MoE name the router differently and hold each expert apart; adapt attention instead")
    return NAMES.to_hf(name)


from_hf_name = NAMES.from_hf


def model_type_of(cfg: MixtralConfig) -> str:
    """The class that computes ``cfg``: Qwen3-MoE when it has QK-norm, Mixtral otherwise."""
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: MixtralConfig) -> dict[str, torch.Tensor]:
    """Our weights under the class's names, each expert's matrices apart (the Hub's layout); a tied output
    matrix is left out."""
    experts = _EXPERTS[model_type_of(cfg)]
    out = {}
    for k, v in state.items():
        parts = k.split(".")
        if parts[0] == "layers" and parts[2:4] == ["mlp", "router"]:
            out[f"model.layers.{parts[1]}.{experts.module}.gate.weight"] = v
        elif parts[0] == "layers" and parts[2:4] == ["mlp", "experts"]:
            out |= experts.to_hf(parts[1], parts[4], v)
        elif k.endswith("expert_bias"):
            continue  # export refuses a model whose bias matters (hf_config_dict); an all-zero one is no bias
        else:
            out[NAMES.to_hf(k)] = v
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def state_dict_from_hf(state: dict[str, torch.Tensor], cfg: MixtralConfig) -> dict[str, torch.Tensor]:
    """The class's weights under our names: per-expert matrices (or transformers 5's fused ones) stacked
    by expert; ``KeyError`` naming what is missing or mis-shaped."""
    out, rest = _EXPERTS[model_type_of(cfg)].from_hf(state, cfg.moe.n_experts)
    for k, v in rest.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if m := _ROUTER.fullmatch(k):
            out[f"layers.{m[1]}.mlp.router.weight"] = v
        else:
            out[NAMES.from_hf(k)] = v
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out


# --------------------------------------------------------------------------- config.json


def _exportable(cfg: MixtralConfig) -> None:
    """Refuse, in one line, a routed FFN that neither class computes."""
    moe = cfg.moe
    unsupported = [f"{k}={getattr(moe, k)!r}" for k, plain in (("scores", "softmax"), ("n_shared_experts", 0),
                   ("n_group", 1), ("routed_scaling_factor", 1.0), ("selection_bias", False), ("bias_update_rate", 0.0))
                   if getattr(moe, k) != plain]
    if unsupported:
        raise ValueError(f"model.moe {', '.join(unsupported)}: MixtralForCausalLM and Qwen3MoeForCausalLM route by "
                         "softmax without shared experts, groups, scaling or a selection bias (DeepSeek-V3's class does)")
    if cfg.qkv_bias != cfg.out_bias:
        raise ValueError(f"qkv_bias = {cfg.qkv_bias} with out_bias = {cfg.out_bias}: Qwen3-MoE's attention_bias puts "
                         "biases on q, k, v and the output projection together, and Mixtral has none")


def hf_config_dict(cfg: MixtralConfig, dtype: str = "float32", **extra: Any) -> dict:
    """A ``config.json`` for ``Qwen3MoeForCausalLM`` (a model with QK-norm) or ``MixtralForCausalLM``; a
    ``ValueError`` for a model neither computes (sigmoid or group-limited routing, shared experts, a selection
    bias; for Mixtral also biases, dense layers or experts of another width than ffn_hidden). Token ids are
    unset unless ``extra`` gives them."""
    _exportable(cfg)
    moe, sparse = cfg.moe, cfg.sparse_layers()
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hf_max_position_embeddings(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        **rope_scaling_keys(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": cfg.attn_dropout,
        "num_experts_per_tok": moe.n_experts_per_token,
        "output_router_logits": moe.aux_loss_coef > 0,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": dtype,
        **extra,
    }
    if cfg.qk_norm:
        return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": cfg.expert_width(),
                "num_experts": moe.n_experts, "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, s in enumerate(sparse) if not s], "attention_bias": cfg.qkv_bias,
                "use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window}
    why = [reason for reason, bad in (
        ("q/k/v or output biases", cfg.qkv_bias or cfg.out_bias),
        ("dense layers", not all(sparse)),
        (f"experts of width {cfg.expert_width()} beside ffn_hidden {cfg.ffn_hidden}", cfg.expert_width() != cfg.ffn_hidden),
        ("norm_topk_prob false", not moe.norm_topk_prob)) if bad]
    if why:
        raise ValueError(f"MixtralForCausalLM has no {', '.join(why)} (Qwen3MoeForCausalLM does: set qk_norm, its "
                         "per-head QK-norm)")
    return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": cfg.ffn_hidden, "num_local_experts": moe.n_experts, "router_jitter_noise": 0.0,
            "sliding_window": cfg.sliding_window}


_SHAPE = HFKey(HONOURED, "the shape")
_ROUTING = HFKey(HONOURED, "the routed FFN (model.moe)")
_AUX = HFKey(HONOURED, "training only: router_aux_loss_coef is model.moe.aux_loss_coef when output_router_logits "
                       "is true (transformers adds the loss then), else 0")
_COMMON = {
    **COMMON_KEYS,
    **dict.fromkeys("vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
                    "head_dim rms_norm_eps tie_word_embeddings max_position_embeddings".split(), _SHAPE),
    **dict.fromkeys("rope_parameters rope_scaling rope_theta".split(), HFKey(HONOURED, "RoPE and its scaling (rope_fields)")),
    "hidden_act": HFKey(HONOURED, "lmforge's SwiGLU experts use silu", ("silu", "swish")),
    "attention_dropout": HFKey(HONOURED, "dropout on the attention probabilities in training (attn_dropout)"),
    "num_experts_per_tok": _ROUTING,
    "output_router_logits": _AUX,
    "router_aux_loss_coef": _AUX,
    "partial_rotary_factor": refused("RoPE must cover the whole head", 1.0, None),
}
# model_type -> every config.json key lmforge knows for it; any other key is refused (lmforge does not know what it does)
CONFIG_KEYS: dict[str, dict[str, HFKey]] = {
    "mixtral": {
        **_COMMON,
        "num_local_experts": _ROUTING,
        "num_experts": _ROUTING,  # MixtralConfig's alias of num_local_experts
        "sliding_window": HFKey(HONOURED, "every layer's window"),
        "router_jitter_noise": refused("multiplicative noise on the routed FFN's input in training, which lmforge "
                                       "does not draw", 0, 0.0, None),
        "original_max_position_embeddings": HFKey(HONOURED, "RoPE scaling's original context (rope_fields)"),
    },
    "qwen3_moe": {
        **_COMMON,
        "moe_intermediate_size": _ROUTING,
        "num_experts": _ROUTING,
        "num_local_experts": _ROUTING,  # transformers 5's name of num_experts
        "norm_topk_prob": _ROUTING,
        "decoder_sparse_step": _ROUTING,
        "mlp_only_layers": _ROUTING,
        "attention_bias": HFKey(HONOURED, "biases on q/k/v and the output projection (qkv_bias, out_bias)"),
        "use_sliding_window": HFKey(HONOURED, "with sliding_window, every layer's window"),
        "sliding_window": HFKey(HONOURED, "every layer's window, when use_sliding_window"),
        "max_window_layers": NOT_READ,
        "original_max_position_embeddings": HFKey(HONOURED, "RoPE scaling's original context (rope_fields)"),
    },
}
CONFIG_KEYS["qwen3_moe"]["layer_types"] = HFKey(INERT, "Qwen3MoeForCausalLM windows every layer by use_sliding_window")


def model_config_from_hf(config: dict, where: str = "config.json") -> MixtralConfig:
    """The ``MixtralConfig`` of a Mixtral or Qwen3-MoE ``config.json`` (QK-norm for Qwen3-MoE), read as
    transformers reads it; a key the table refuses at its value, or does not know, is an ``InputError``."""
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    if model_type not in CLASSES or (archs and archs != [CLASSES[model_type]]):
        raise InputError(f"{where}: model_type {model_type!r} (architectures {archs}) is not supported by family "
                         "mixtral; it imports MixtralForCausalLM (model_type 'mixtral') and Qwen3MoeForCausalLM "
                         "(model_type 'qwen3_moe')")
    check_hf_config_keys(config, CONFIG_KEYS[model_type], model_type, where)
    max_seq_len = config.get("max_position_embeddings", 131072 if model_type == "mixtral" else 32768)
    rope = rope_fields(config, max_seq_len, where)
    if rope.get("rope_scaling") == "dynamic":
        max_seq_len = max(max_seq_len, math.floor(rope["rope_factor"] * max_seq_len))
    window = config.get("sliding_window")
    if model_type == "qwen3_moe" and not config.get("use_sliding_window", False):
        window = None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise InputError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    if window is not None and window >= max_seq_len:
        window = None
    aux = float(config.get("router_aux_loss_coef", 0.0) or 0.0) if config.get("output_router_logits") else 0.0
    qwen = model_type == "qwen3_moe"
    attention_bias = bool(config.get("attention_bias", False)) if qwen else False
    try:
        n_heads = config["num_attention_heads"]
        if qwen:
            n_experts = config.get("num_experts", config.get("num_local_experts", 128))
            moe = MoEConfig(n_experts=n_experts, n_experts_per_token=config.get("num_experts_per_tok", 8),
                            expert_ffn_hidden=config.get("moe_intermediate_size", 768),
                            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                            sparse_step=config.get("decoder_sparse_step", 1) or 1,
                            dense_layers=list(config.get("mlp_only_layers") or []) or None, aux_loss_coef=aux)
            if n_experts == 0:  # transformers' Qwen3-MoE keeps the dense MLP everywhere
                raise InputError(f"{where}: num_experts = 0 is a dense model; import it as Qwen3 (model_type qwen3)")
        else:
            moe = MoEConfig(n_experts=config.get("num_local_experts", config.get("num_experts", 8)),
                            n_experts_per_token=config.get("num_experts_per_tok", 2), aux_loss_coef=aux)
        return MixtralConfig(
            vocab_size=config["vocab_size"],
            d_model=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            ffn_hidden=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6 if qwen else 1e-5),
            **rope,
            max_seq_len=max_seq_len,
            sliding_window=window,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=qwen,
            qkv_bias=attention_bias,
            out_bias=attention_bias,
            attn_dropout=float(config.get("attention_dropout") or 0.0),
            init_std=config.get("initializer_range", 0.02),
            moe=moe,
        )
    except KeyError as exc:
        raise InputError(f"{where}: missing required key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: {exc}") from exc
