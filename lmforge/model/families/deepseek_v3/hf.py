"""DeepSeek-V3's Hugging Face mapping: ``DeepseekV3ForCausalLM``.

Its attention is the same multi-head latent attention with the same layout (queries per head as
[no-RoPE part ; RoPE part], the joint latent + RoPE-key projection, per-head [key ; value] rows of
the up-projection) and rotates the interleaved pairs of ``rope_interleave`` as lmforge's pair order
does, so weights map one to one by name. Every ``config.json`` key of the class is classified in
``CONFIG_KEYS`` (honoured, refused unless at a value lmforge computes, or inert);
tests/model/families/test_deepseek_v3.py holds the table against transformers.
"""

from __future__ import annotations

import math
from typing import Any

from lmforge.core.io import InputError
from lmforge.model.families.deepseek_v3.config import DeepseekV3Config
from lmforge.model.hf_parts import (
    COMMON_KEYS,
    HONOURED,
    INERT,
    HFKey,
    WeightNames,
    check_hf_config_keys,
    hf_max_position_embeddings,
    refused,
    rope_fields,
    rope_scaling_keys,
)

CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM"}  # model_type -> the one class whose weights we read

_LAYER_KEYS = {  # ours -> HF, per layer
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.wq_a.bias": "self_attn.q_a_proj.bias",
    "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.wkv_a.bias": "self_attn.kv_a_proj_with_mqa.bias",
    "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.wo.bias": "self_attn.o_proj.bias",
    **{f"mlp.{ours}.weight": f"mlp.{theirs}_proj.weight" for ours, theirs in (("w1", "gate"), ("w3", "up"), ("w2", "down"))},
}
NAMES = WeightNames("DeepseekV3ForCausalLM", _LAYER_KEYS)
to_hf_name, from_hf_name = NAMES.to_hf, NAMES.from_hf

state_dict_to_hf, state_dict_from_hf = NAMES.state_to_hf, NAMES.state_from_hf


def hf_config_dict(cfg: DeepseekV3Config, dtype: str = "float32", **extra: Any) -> dict:
    """A ``config.json`` for ``DeepseekV3ForCausalLM``, which computes every ``DeepseekV3Config`` (its refusals
    keep the config to what the class expresses): every layer dense (``first_k_dense_replace`` = the layers),
    no multi-token prediction module. Token ids are unset unless ``extra`` gives them (the class's defaults,
    bos 0 and eos 1, belong to DeepSeek's own tokenizer)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_interleave": cfg.rope_interleave,
        "first_k_dense_replace": cfg.n_layers,
        "num_nextn_predict_layers": 0,
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


def _all_dense(value: Any, config: dict) -> bool:
    return value is None or (isinstance(value, int) and value >= config.get("num_hidden_layers", 61))


_MOE_ONLY = HFKey(INERT, "read by the mixture-of-experts layers only, and first_k_dense_replace makes every layer dense")
# every config.json key lmforge knows for DeepseekV3ForCausalLM; any other key is refused (lmforge does not know what it does)
CONFIG_KEYS: dict[str, dict[str, HFKey]] = {"deepseek_v3": {
    **COMMON_KEYS,
    **dict.fromkeys("vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads rms_norm_eps "
                    "tie_word_embeddings max_position_embeddings".split(), HFKey(HONOURED, "the shape")),
    **dict.fromkeys("q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim".split(),
                    HFKey(HONOURED, "multi-head latent attention's shape (model.mla)")),
    **dict.fromkeys("rope_parameters rope_scaling rope_theta".split(), HFKey(HONOURED, "RoPE and its scaling (rope_fields)")),
    "rope_interleave": HFKey(HONOURED, "RoPE over interleaved pairs (rope_interleave)"),
    "hidden_act": HFKey(HONOURED, "lmforge's SwiGLU MLP uses silu", ("silu", "swish")),
    "attention_bias": HFKey(HONOURED, "biases on the compressing projections and the output projection (qkv_bias, out_bias)"),
    "attention_dropout": HFKey(HONOURED, "dropout on the attention probabilities in training (attn_dropout)"),
    "num_key_value_heads": refused("multi-head latent attention gives every query head its own keys and values; "
                                   "transformers' eager attention computes only num_key_value_heads = num_attention_heads",
                                   lambda v, c: v is None or v == c.get("num_attention_heads")),
    "first_k_dense_replace": refused("the layers from first_k_dense_replace on are mixtures of experts, which "
                                     "lmforge's DeepSeek-V3 does not build yet; it imports models whose every layer is dense",
                                     _all_dense),
    **dict.fromkeys("moe_intermediate_size n_shared_experts n_routed_experts routed_scaling_factor n_group topk_group "
                    "num_experts_per_tok norm_topk_prob".split(), _MOE_ONLY),
    "output_router_logits": HFKey(INERT, "an output option (the routers' logits returned)"),
    **dict.fromkeys(("num_nextn_predict_layers", "num_mtp_layers"),  # the second: the class's alias of the first
                    HFKey(INERT, "multi-token prediction modules: DeepseekV3ForCausalLM's forward does not run them")),
    "head_dim": refused("transformers' RoPE reads it as the rotated part's width, which MLA's weights make qk_rope_head_dim",
                        lambda v, c: v is None or v == c.get("qk_rope_head_dim", 64)),
    "qk_head_dim": HFKey(INERT, "transformers sets it to qk_nope_head_dim + qk_rope_head_dim whatever the file says"),
    "pretraining_tp": HFKey(INERT, "Llama's tensor-parallel pretraining note; DeepseekV3ForCausalLM does not read it"),
}}


def _check_mscale(config: dict, where: str) -> None:
    """DeepSeek's attention reads ``mscale_all_dim`` on its own (the scores' mscale²) for any scaled RoPE;
    lmforge computes it with YaRN and ``mscale`` beside it."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, dict) or not rope.get("mscale_all_dim"):
        return
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default" and (rope_type != "yarn" or not rope.get("mscale")):
        key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
        raise InputError(f"{where}: {key} = {rope!r} is not supported (DeepSeek's attention scales its scores by "
                         "mscale_all_dim's mscale²; lmforge computes that with rope_type 'yarn' and mscale set beside it)")


def model_config_from_hf(config: dict, where: str = "config.json") -> DeepseekV3Config:
    """The ``DeepseekV3Config`` of a DeepSeek-V3 ``config.json`` whose every layer is dense: plain RoPE or any
    scaling type transformers' ``ROPE_INIT_FUNCTIONS`` offer over the ``qk_rope_head_dim`` part; a key the
    table refuses at its value, or does not know, is an ``InputError``."""
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    if model_type not in CLASSES or (archs and archs != [CLASSES[model_type]]):
        raise InputError(f"{where}: model_type {model_type!r} (architectures {archs}) is not supported by family "
                         "deepseek_v3; it imports DeepseekV3ForCausalLM (model_type 'deepseek_v3')")
    check_hf_config_keys(config, CONFIG_KEYS[model_type], model_type, where)
    _check_mscale(config, where)
    max_seq_len = config.get("max_position_embeddings", 4096)
    rope = rope_fields(config, max_seq_len, where)
    if rope.get("rope_scaling") == "dynamic":
        # transformers' dynamic NTK has no end past max_position_embeddings; lmforge's context ends factor times it
        max_seq_len = max(max_seq_len, math.floor(rope["rope_factor"] * max_seq_len))
    attention_bias = bool(config.get("attention_bias", False))
    try:
        return DeepseekV3Config(
            vocab_size=config.get("vocab_size", 129280),
            d_model=config.get("hidden_size", 7168),
            n_layers=config.get("num_hidden_layers", 61),
            n_heads=config.get("num_attention_heads", 128),
            ffn_hidden=config.get("intermediate_size", 18432),
            norm_eps=config.get("rms_norm_eps", 1e-6),
            q_lora_rank=config.get("q_lora_rank", 1536),
            kv_lora_rank=config.get("kv_lora_rank", 512),
            qk_nope_head_dim=config.get("qk_nope_head_dim", 128),
            qk_rope_head_dim=config.get("qk_rope_head_dim", 64),
            v_head_dim=config.get("v_head_dim", 128),
            rope_interleave=bool(config.get("rope_interleave", True)),
            **rope,
            max_seq_len=max_seq_len,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            out_bias=attention_bias,
            attn_dropout=float(config.get("attention_dropout") or 0.0),
            init_std=config.get("initializer_range", 0.02),
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: {exc}") from exc
