"""The GPT-2 family's Hugging Face mapping: ``GPT2LMHeadModel``.

GPT-2's linears are ``Conv1D`` modules, which store their weight as (in, out), the transpose of
``nn.Linear``'s, and its attention has one input projection, ``c_attn``, whose output columns are
q | k | v: import transposes each matrix and splits ``c_attn`` in three, export joins and
transposes them back. A model without some biases is exported with those biases zero (what it
computes), and imports with them (GPT-2 always has them). Every ``config.json`` key of GPT2Config
is classified in ``CONFIG_KEYS``; a key missing from a folder takes transformers' default, as
``GPT2Config`` gives it (``HF_DEFAULTS``).
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.core.io import InputError
from lmforge.model.families.gpt2.config import GPT2Config
from lmforge.model.hf_parts import COMMON_KEYS, HONOURED, INERT, HFKey, check_hf_config_keys, refused

CLASSES = {"gpt2": "GPT2LMHeadModel"}

# ours -> HF, per layer (after ``transformer.h.<i>.``); the Conv1D weights (``_CONV1D``) transposed
_LAYER_KEYS = {
    "attn_norm.weight": "ln_1.weight",
    "attn_norm.bias": "ln_1.bias",
    "attn.wo.weight": "attn.c_proj.weight",
    "attn.wo.bias": "attn.c_proj.bias",
    "mlp_norm.weight": "ln_2.weight",
    "mlp_norm.bias": "ln_2.bias",
    "mlp.w1.weight": "mlp.c_fc.weight",
    "mlp.w1.bias": "mlp.c_fc.bias",
    "mlp.w2.weight": "mlp.c_proj.weight",
    "mlp.w2.bias": "mlp.c_proj.bias",
}
_LAYER_KEYS_FROM_HF = {theirs: ours for ours, theirs in _LAYER_KEYS.items()}
_CONV1D = {"attn.wo.weight", "mlp.w1.weight", "mlp.w2.weight"}
_QKV = ("attn.wq", "attn.wk", "attn.wv")  # c_attn's output columns, in this order
_TOP_KEYS = {
    "embed.weight": "transformer.wte.weight",
    "pos_embed.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}
_TOP_KEYS_FROM_HF = {theirs.removeprefix("transformer."): ours for ours, theirs in _TOP_KEYS.items()}
# buffers older checkpoints saved (the causal mask), which transformers ignores on load
_OLD_BUFFERS = (".attn.bias", ".attn.masked_bias")


# --------------------------------------------------------------------------- weights


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: GPT2Config) -> dict[str, torch.Tensor]:
    """Our weights under GPT-2's names and layouts: Conv1D matrices transposed, q/k/v joined into
    ``c_attn``, a bias the model lacks written as zeros; a tied output matrix left out."""
    out = {}
    for name, tensor in state.items():
        if name in _TOP_KEYS:
            out[_TOP_KEYS[name]] = tensor
            continue
        _, i, rest = name.split(".", 2)  # layers.<i>.<rest>
        if rest.startswith(_QKV):
            continue  # joined below
        if rest not in _LAYER_KEYS:
            raise KeyError(f"no GPT2LMHeadModel parameter for lmforge parameter {name!r}")
        out[f"transformer.h.{i}.{_LAYER_KEYS[rest]}"] = tensor.t().contiguous() if rest in _CONV1D else tensor
    for i in range(cfg.n_layers):
        h, layer = f"transformer.h.{i}.", f"layers.{i}."
        weights = [state[f"{layer}{p}.weight"] for p in _QKV]
        out[h + "attn.c_attn.weight"] = torch.cat(weights).t().contiguous()
        out[h + "attn.c_attn.bias"] = torch.cat([state.get(f"{layer}{p}.bias", w.new_zeros(w.shape[0]))
                                                 for p, w in zip(_QKV, weights)])
        for ours in ("attn.wo", "mlp.w1", "mlp.w2"):
            weight = state[f"{layer}{ours}.weight"]
            out.setdefault(h + _LAYER_KEYS[f"{ours}.bias"], weight.new_zeros(weight.shape[0]))
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def state_dict_from_hf(state: dict[str, torch.Tensor], cfg: GPT2Config) -> dict[str, torch.Tensor]:
    """GPT-2's weights under our names: ``c_attn`` split into q, k, v, Conv1D matrices transposed;
    a tied output matrix becomes the embedding matrix. Names with or without the ``transformer.``
    prefix (openai-community/gpt2 saved its ``GPT2Model`` without it)."""
    out = {}
    d = cfg.n_heads * cfg.head_dim
    for name, tensor in state.items():
        name = name.removeprefix("transformer.")
        if name.endswith(_OLD_BUFFERS):
            continue
        ours = _TOP_KEYS_FROM_HF.get(name)
        if ours is not None:
            out[ours] = tensor
            continue
        parts = name.split(".", 2)  # h.<i>.<rest>
        if len(parts) != 3 or parts[0] != "h":
            raise KeyError(f"no lmforge parameter for GPT2LMHeadModel parameter {name!r}")
        layer, rest = f"layers.{parts[1]}.", parts[2]
        if rest in ("attn.c_attn.weight", "attn.c_attn.bias"):
            kind = rest.rsplit(".", 1)[1]
            joined = tensor.t() if kind == "weight" else tensor
            for p, part in zip(_QKV, joined.split(d)):
                out[f"{layer}{p}.{kind}"] = part.contiguous()
        elif rest in _LAYER_KEYS_FROM_HF:
            mine = _LAYER_KEYS_FROM_HF[rest]
            out[layer + mine] = tensor.t().contiguous() if mine in _CONV1D else tensor
        else:
            raise KeyError(f"no lmforge parameter for GPT2LMHeadModel parameter {name!r}")
    if cfg.tie_embeddings and "embed.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]
    return out


# --------------------------------------------------------------------------- config.json


def hf_config_dict(cfg: GPT2Config, dtype: str = "float32", **extra: Any) -> dict:
    """A ``config.json`` for ``GPT2LMHeadModel`` computing exactly our model; ``ValueError`` (one
    line naming every part it lacks) for a model with GQA/MQA, another head width, RMSNorm, SwiGLU,
    QK-norm or a sliding window, none of which GPT2LMHeadModel has."""
    lacks = []
    if cfg.n_kv_heads != cfg.n_heads:
        lacks.append(f"n_kv_heads = {cfg.n_kv_heads} (it has multi-head attention: n_kv_heads = n_heads = {cfg.n_heads})")
    if cfg.n_heads * cfg.head_dim != cfg.d_model:
        lacks.append(f"head_dim = {cfg.head_dim} (its heads are d_model / n_heads = {cfg.d_model / cfg.n_heads:g} wide)")
    if cfg.norm != "layernorm":
        lacks.append(f"norm {cfg.norm!r} (it has LayerNorm)")
    if cfg.ffn != "gelu":
        lacks.append(f"ffn {cfg.ffn!r} (it has a tanh-GELU MLP)")
    if cfg.qk_norm:
        lacks.append("qk_norm (it has none)")
    if cfg.sliding_window is not None:
        lacks.append(f"sliding_window = {cfg.sliding_window} (every layer attends to every position)")
    if lacks:
        raise ValueError(f"GPT2LMHeadModel cannot compute this model: {'; '.join(lacks)}")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": None if cfg.ffn_hidden == 4 * cfg.d_model else cfg.ffn_hidden,  # None: GPT-2's 4 d_model
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "embd_pdrop": cfg.embed_dropout,
        "attn_pdrop": cfg.attn_dropout,
        "resid_pdrop": cfg.resid_dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": None,  # GPT2Config's default is GPT-2's own <|endoftext|>, 50256: the export's tokenizer says
        "eos_token_id": None,
        "torch_dtype": dtype,
        **extra,
    }


# what transformers' GPT2Config takes for a key a config.json leaves out
HF_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
               "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
               "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "tie_word_embeddings": True}
# GPT2Config.attribute_map: the common names transformers reads as GPT-2's own
ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
           "num_hidden_layers": "n_layer"}
# activation_function values that are GELU's tanh approximation, as the shared MLP computes it (to float32 rounding)
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh", "gelu_accurate")

_SHAPE = HFKey(HONOURED, "the shape")
_DOUBLE_HEADS = HFKey(INERT, "GPT2DoubleHeadsModel's multiple-choice head; GPT2LMHeadModel has none")
# model_type -> every config.json key lmforge knows for it; any other key is refused (lmforge does not know what it does)
CONFIG_KEYS: dict[str, dict[str, HFKey]] = {"gpt2": {
    **COMMON_KEYS,
    **dict.fromkeys("vocab_size n_positions n_embd n_layer n_head layer_norm_epsilon tie_word_embeddings".split(), _SHAPE),
    **dict.fromkeys(ALIASES, HFKey(HONOURED, "the shape, under the name GPT2Config.attribute_map reads as GPT-2's")),
    "n_inner": HFKey(HONOURED, "the MLP's width (null: 4 n_embd)"),
    "activation_function": HFKey(HONOURED, "lmforge's GELU MLP uses GELU's tanh approximation", TANH_GELUS),
    "embd_pdrop": HFKey(HONOURED, "dropout on the embeddings in training (embed_dropout)"),
    "attn_pdrop": HFKey(HONOURED, "dropout on the attention probabilities in training (attn_dropout)"),
    "resid_pdrop": HFKey(HONOURED, "dropout on each attention and MLP output in training (resid_dropout)"),
    "scale_attn_weights": refused("lmforge scales attention scores by 1/sqrt(head_dim)", True),
    "scale_attn_by_inverse_layer_idx": refused("lmforge does not divide layer i's scores by i + 1", False),
    "reorder_and_upcast_attn": HFKey(INERT, "float32 scores and softmax for 16-bit attention (float32 logits are "
                                            "identical; lmforge's attention kernels keep the softmax in float32)"),
    "add_cross_attention": refused("cross-attention layers over an encoder's states; lmforge's model is a decoder "
                                   "only", False, None),
    "n_ctx": HFKey(INERT, "older transformers' name for the context; n_positions is read"),
    **dict.fromkeys("summary_type summary_use_proj summary_activation summary_proj_to_labels summary_first_dropout "
                    "summary_last_dropout".split(), _DOUBLE_HEADS),
}}


def model_config_from_hf(config: dict, where: str = "config.json") -> GPT2Config:
    """The ``GPT2Config`` of a GPT-2 ``config.json``: a key it leaves out takes transformers'
    default; a key ``CONFIG_KEYS`` refuses at its value, or does not know, is an ``InputError``."""
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    if model_type not in CLASSES:
        raise InputError(f"{where}: model_type {model_type!r} is not GPT-2's; this mapping reads model_type 'gpt2'")
    if archs and archs != [CLASSES[model_type]]:
        raise InputError(f"{where}: architectures {archs} is not supported; lmforge imports GPT2LMHeadModel "
                         "(model_type 'gpt2')")
    check_hf_config_keys(config, CONFIG_KEYS[model_type], model_type, where)
    c = {**HF_DEFAULTS, **config, **{ALIASES[k]: v for k, v in config.items() if k in ALIASES}}
    try:
        return GPT2Config(
            vocab_size=c["vocab_size"],
            d_model=c["n_embd"],
            n_layers=c["n_layer"],
            n_heads=c["n_head"],
            ffn_hidden=c["n_inner"],
            norm_eps=c["layer_norm_epsilon"],
            max_seq_len=c["n_positions"],
            tie_embeddings=bool(c["tie_word_embeddings"]),
            embed_dropout=float(c["embd_pdrop"]),
            attn_dropout=float(c["attn_pdrop"]),
            resid_dropout=float(c["resid_pdrop"]),
            init_std=c["initializer_range"],
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: {exc}") from exc
