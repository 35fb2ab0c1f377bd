"""DeepSeek-V3's Hugging Face mapping: ``DeepseekV3ForCausalLM``.

Its attention is the same multi-head latent attention with the same layout (queries per head as
[no-RoPE part ; RoPE part], the joint latent + RoPE-key projection, per-head [key ; value] rows of
the up-projection) and rotates the interleaved pairs of ``rope_interleave`` as ``mla.rotate_interleaved``
does, so attention's weights map one to one by name. A routed layer's experts are our stacked matrices'
slices: export writes them per expert (``mlp.experts.<e>.gate_proj.weight``, what ``save_pretrained`` and the
Hub hold), import reads that layout or transformers 5's fused one; a missing or mis-shaped expert tensor is
one line naming it. Every ``config.json`` key of the class is classified in
``CONFIG_KEYS`` (honoured, refused unless at a value lmforge computes, or inert);
tests/model/families/test_deepseek_v3.py holds the table against transformers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lmforge.core.io import InputError
from lmforge.model.families.deepseek_v3.config import DeepseekV3Config
from lmforge.model.hf_parts import (
    COMMON_KEYS,
    HONOURED,
    INERT,
    HFExperts,
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
    # a routed layer's router, its selection bias and its shared experts
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    **{f"mlp.shared.{ours}.weight": f"mlp.shared_experts.{theirs}_proj.weight"
       for ours, theirs in (("w1", "gate"), ("w3", "up"), ("w2", "down"))},
}
NAMES = WeightNames("DeepseekV3ForCausalLM", _LAYER_KEYS)
to_hf_name, from_hf_name = NAMES.to_hf, NAMES.from_hf  # the stacked experts have no one HF name: KeyError

_EXPERTS = HFExperts("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})  # ours -> the class's, per expert


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """Our weights under the class's names, each expert's matrices apart (the layout ``save_pretrained``
    writes and the Hub's checkpoints hold) and every routed layer with its ``e_score_correction_bias`` (zeros
    where the model keeps no selection bias, and 0-wide shared experts where it has none: the class always has
    both); a tied output matrix is left out."""
    out = {}
    for k, v in state.items():
        parts = k.split(".")
        if parts[0] == "layers" and parts[2:4] == ["mlp", "experts"]:
            out |= _EXPERTS.to_hf(parts[1], parts[4], v)
        else:
            out[NAMES.to_hf(k)] = v
        if k.endswith("mlp.router.weight"):  # what the class holds on every routed layer, whatever the model lacks
            layer = f"model.layers.{parts[1]}.mlp"
            if f"layers.{parts[1]}.mlp.router.expert_bias" not in state:
                out[f"{layer}.gate.e_score_correction_bias"] = torch.zeros(v.shape[0], dtype=torch.float32)
            if f"layers.{parts[1]}.mlp.shared.w1.weight" not in state:  # no shared expert: the class's are 0 wide
                d = v.shape[1]
                out |= {f"{layer}.shared_experts.gate_proj.weight": v.new_zeros(0, d),
                        f"{layer}.shared_experts.up_proj.weight": v.new_zeros(0, d),
                        f"{layer}.shared_experts.down_proj.weight": v.new_zeros(d, 0)}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def state_dict_from_hf(state: dict[str, torch.Tensor], cfg: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """The class's weights under our names: per-expert matrices (or transformers 5's fused ``gate_up_proj`` /
    ``down_proj``) stacked by expert; ``KeyError`` naming an expert tensor that is missing or mis-shaped."""
    out, rest = _EXPERTS.from_hf(state, cfg.moe.n_experts)
    for k, v in rest.items():
        if k.endswith("rotary_emb.inv_freq") or (".shared_experts." in k and v.numel() == 0):
            continue  # a buffer of older files; the 0-wide shared experts of n_shared_experts = 0
        out[NAMES.from_hf(k)] = v
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def hf_config_dict(cfg: DeepseekV3Config, dtype: str = "float32", **extra: Any) -> dict:
    """A ``config.json`` for ``DeepseekV3ForCausalLM``, which computes every ``DeepseekV3Config`` (its refusals
    keep the config to what the class expresses): the routed FFN from ``first_k_dense_replace`` on, no
    multi-token prediction module. Token ids are unset unless ``extra`` gives them (the class's defaults,
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
        "first_k_dense_replace": min(cfg.moe.first_dense_layers, cfg.n_layers),
        "n_routed_experts": cfg.moe.n_experts,
        "num_experts_per_tok": cfg.moe.n_experts_per_token,
        "moe_intermediate_size": cfg.moe.width(cfg.ffn_hidden),
        "n_shared_experts": cfg.moe.n_shared_experts,
        "n_group": cfg.moe.n_group,
        "topk_group": cfg.moe.topk_group,
        "norm_topk_prob": cfg.moe.norm_topk_prob,
        "routed_scaling_factor": cfg.moe.routed_scaling_factor,
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


_MOE = HFKey(HONOURED, "the routed FFN of the layers from first_k_dense_replace on (model.moe)")
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
    **dict.fromkeys("first_k_dense_replace moe_intermediate_size n_shared_experts n_routed_experts routed_scaling_factor "
                    "n_group topk_group num_experts_per_tok norm_topk_prob".split(), _MOE),
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
    """The ``DeepseekV3Config`` of a DeepSeek-V3 ``config.json``, its routed FFN with the selection bias the
    class always holds (``moe.selection_bias``, read from ``e_score_correction_bias``): plain RoPE or any
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
    n_layers = config.get("num_hidden_layers", 61)
    moe = dict(n_experts=config.get("n_routed_experts", 256), n_experts_per_token=config.get("num_experts_per_tok", 8),
               expert_ffn_hidden=config.get("moe_intermediate_size", 2048), scores="sigmoid",
               norm_topk_prob=bool(config.get("norm_topk_prob", True)),
               routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)),
               n_shared_experts=config.get("n_shared_experts", 1), n_group=config.get("n_group", 8),
               topk_group=config.get("topk_group", 4), selection_bias=True,
               first_dense_layers=min(config.get("first_k_dense_replace", 3), n_layers))
    try:
        return DeepseekV3Config(
            vocab_size=config.get("vocab_size", 129280),
            d_model=config.get("hidden_size", 7168),
            n_layers=n_layers,
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
            moe=moe,
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: {exc}") from exc
